"""The KV offload tier as a store: what it writes is what it reads, across instances (a restart); files it
did not write whole, or under another fingerprint, are never returned; errors never raise."""
from __future__ import annotations

import errno
import hashlib
import logging
import multiprocessing
import os

import pytest

from tokenmill.core.kv_tier import HEADER, KVTier, fingerprint_of

PAYLOAD = 4096
COMPONENTS = {"model": "m1", "kv_cache_dtype": "bfloat16", "block_size": 16}


def key(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(PAYLOAD))


def open_tier(directory, components=COMPONENTS, budget=1 << 30) -> KVTier:
    return KVTier(directory, budget, fingerprint_of(components), PAYLOAD, dict(components))


def test_written_blocks_read_back_and_survive_a_restart(tmp_path):
    tier = open_tier(tmp_path)
    for i in range(5):
        assert tier.wants(key(i))
        tier.put(key(i), payload(i))
    assert tier.flush()
    assert [bytes(tier.read(key(i))) for i in range(5)] == [payload(i) for i in range(5)]
    assert not tier.wants(key(0)) and tier.stats.blocks_written == 5 and tier.stats.blocks_read == 5
    again = open_tier(tmp_path)  # another process's view of the same directory, as after a restart
    assert again.stored_blocks == 5
    assert all(again.contains(key(i), look=False) for i in range(5))
    assert bytes(again.read(key(3))) == payload(3)
    assert again.read(key(9)) is None and not again.contains(key(9))


def test_the_level_in_memory_serves_the_latest_blocks_before_the_directory(tmp_path):
    """With host_budget_bytes, the latest blocks written or read are served from process memory (no file
    read), the least recently used leave it over its budget and are read from the directory again."""
    tier = KVTier(tmp_path, 1 << 30, fingerprint_of(COMPONENTS), PAYLOAD, dict(COMPONENTS),
                  host_budget_bytes=3 * PAYLOAD)
    for i in range(4):
        tier.put(key(i), payload(i))
    assert tier.flush() and tier.host_stored_bytes == 3 * PAYLOAD and tier.stats.host_evictions == 1
    for path in tier.root.glob("*/*.kv"):
        path.unlink()  # only the level in memory can answer now
    assert [bytes(tier.read(key(i))) for i in (1, 2, 3)] == [payload(i) for i in (1, 2, 3)]
    assert tier.stats.host_blocks_read == 3 and tier.stats.blocks_read == 3
    assert tier.read(key(0)) is None  # evicted from memory, its file gone: a miss
    tier.put(key(0), payload(0))
    assert tier.flush() and tier.contains(key(0), look=False)
    # A block read from the directory joins the level; the least recently read leaves it.
    again = KVTier(tmp_path, 1 << 30, fingerprint_of(COMPONENTS), PAYLOAD, dict(COMPONENTS),
                   host_budget_bytes=PAYLOAD)
    assert bytes(again.read(key(0))) == payload(0) and again.stats.host_blocks_read == 0
    assert bytes(again.read(key(0))) == payload(0) and again.stats.host_blocks_read == 1
    assert again.counters()["host_stored_bytes"] == PAYLOAD
    assert open_tier(tmp_path).host_stored_bytes == 0  # no level without a budget


def test_the_level_in_memory_takes_blocks_while_writes_are_paused(tmp_path, monkeypatch):
    tier = KVTier(tmp_path, 1 << 30, fingerprint_of(COMPONENTS), PAYLOAD, dict(COMPONENTS),
                  host_budget_bytes=4 * PAYLOAD)
    monkeypatch.setattr(tier, "_write", lambda k, p: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    tier.put(key(0), payload(0))
    assert tier.flush() and tier.stats.write_errors == 1
    assert tier.wants(key(1))  # writes are paused, yet the level in memory lacks it
    tier.put(key(1), payload(1))
    assert tier.flush() and tier.stats.write_errors == 1  # paused: the writer skipped it
    assert not tier.wants(key(1))  # held in memory already
    assert bytes(tier.read(key(1))) == payload(1) and tier.stats.host_blocks_read == 1


def test_another_fingerprint_is_ignored_and_said_once(tmp_path, caplog):
    tier = open_tier(tmp_path)
    tier.put(key(1), payload(1))
    assert tier.flush()
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        other = open_tier(tmp_path, {**COMPONENTS, "kv_cache_dtype": "float16"})
    assert other.stored_blocks == 0 and not other.contains(key(1)) and other.read(key(1)) is None
    notes = [r.getMessage() for r in caplog.records if "another fingerprint" in r.getMessage()]
    assert len(notes) == 1 and "kv_cache_dtype" in notes[0] and "1 blocks" in notes[0]


@pytest.mark.parametrize("damage", ["truncate", "flip", "extend", "header", "foreign"])
def test_damaged_files_are_misses_and_removed(tmp_path, damage):
    tier = open_tier(tmp_path)
    tier.put(key(1), payload(1))
    tier.put(key(2), payload(2))
    assert tier.flush()
    path = tier._path(key(1))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:len(data) - 100]
    elif damage == "flip":
        data[HEADER.size + 1000] ^= 0x40
    elif damage == "extend":
        data += b"\0"
    elif damage == "header":
        data[0] ^= 1
    else:  # a whole, valid file of another block under this one's name
        data = bytearray(tier._path(key(2)).read_bytes())
    path.write_bytes(bytes(data))
    assert tier.read(key(1)) is None
    assert tier.stats.corrupt == 1 and not path.exists() and not tier.contains(key(1))
    assert bytes(tier.read(key(2))) == payload(2)


def test_budget_evicts_least_recently_used(tmp_path):
    tier = open_tier(tmp_path, budget=3 * (HEADER.size + PAYLOAD))
    for i in range(3):
        tier.put(key(i), payload(i))
    assert tier.flush()
    assert tier.read(key(0)) is not None  # block 0 is now the most recently used
    tier.put(key(3), payload(3))
    assert tier.flush()
    assert [tier.contains(key(i), look=False) for i in range(4)] == [True, False, True, True]
    assert not tier._path(key(1)).exists() and tier.stats.evictions == 1 and tier.stored_blocks == 3


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EROFS, errno.EIO])
def test_write_failures_degrade_to_no_new_blocks(tmp_path, caplog, monkeypatch, error):
    """A full disk, a read-only directory or an I/O error while writing (injected: this test may run as
    root, which writes into read-only directories)."""
    tier = open_tier(tmp_path)
    tier.put(key(1), payload(1))
    assert tier.flush()

    def failing_replace(src, dst):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr("tokenmill.core.kv_tier.os.replace", failing_replace)
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        tier.put(key(2), payload(2))
        assert tier.flush()
    assert tier.stats.write_errors == 1 and not tier.contains(key(2))
    assert not list(tier.root.glob("*/*.tmp"))  # the partial file is gone
    assert not tier.wants(key(3))  # writes pause after a failure
    assert bytes(tier.read(key(1))) == payload(1)  # what is there still serves
    assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1


def test_unreadable_directory_is_a_tier_with_nothing_in_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    tier = open_tier(blocker / "tier")  # mkdir fails: no tier to read or write, and no exception
    assert tier.stats.write_errors == 1 and tier.stored_blocks == 0
    assert tier.read(key(1)) is None and not tier.contains(key(1))


def _write_many(directory: str, start: int) -> None:
    tier = open_tier(directory)
    for i in range(start, start + 40):
        tier.put(key(i % 50), payload(i % 50))  # blocks 0-49, overlapping between the two writers
    assert tier.flush()


def test_two_writers_share_one_directory(tmp_path):
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_many, args=(str(tmp_path), start)) for start in (0, 10)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
        assert writer.exitcode == 0
    tier = open_tier(tmp_path)
    assert tier.stored_blocks == 50
    assert all(bytes(tier.read(key(i))) == payload(i) for i in range(50))
    assert not list(tier.root.glob("*/*.tmp"))


def test_restore_decision_follows_the_measured_rates(tmp_path):
    tier = open_tier(tmp_path)
    assert tier.restore_pays(10, 160)  # before any measurement: reading is assumed cheap
    for _ in range(50):  # a fast accelerator, a slow disk
        tier.costs.observe_compute(100_000, 0.01)
        tier.costs.observe_read(4096, 0.01)
    assert not tier.restore_pays(10, 160) and tier.stats.skipped_restores == 1


def test_a_long_restore_is_read_in_the_background_while_its_request_waits(tmp_path):
    """The KV cache manager over a tier: a prefix of READ_AHEAD_MIN_BLOCKS or more unread blocks makes the
    request wait while a background thread reads them; the next lookup takes them (exact block ids)."""
    from tokenmill.core.kv_cache_manager import KVCacheManager
    from tokenmill.core.request import Request
    from tokenmill.core.tier_reads import READ_AHEAD_MIN_BLOCKS, TierHit
    from tokenmill.sampling_params import SamplingParams

    tier = open_tier(tmp_path)
    kv = KVCacheManager(num_blocks=32, block_size=4, tier=tier)
    first = Request("a", list(range(4 * READ_AHEAD_MIN_BLOCKS + 1)), SamplingParams(max_tokens=1))
    kv.allocate_slots(first, first.num_tokens)
    for i, key in enumerate(first.block_hashes):
        tier.put(key, payload(i))
    assert tier.flush()
    kv.take_pending_tier_io()
    kv.free(first)
    assert kv.reset_prefix_cache()
    again = Request("b", list(range(4 * READ_AHEAD_MIN_BLOCKS + 1)), SamplingParams(max_tokens=1))
    assert kv.get_computed_blocks(again) == ([], 0) and kv.is_reading(again)
    kv.tier_reads.in_flight["b"].result(timeout=30)
    hits, cached = kv.get_computed_blocks(again)
    assert not kv.is_reading(again) and cached == 4 * READ_AHEAD_MIN_BLOCKS
    assert [bytes(hit.payload) for hit in hits] == [payload(i) for i in range(READ_AHEAD_MIN_BLOCKS)]
    assert all(isinstance(hit, TierHit) for hit in hits)
    assert len(kv.allocate_slots(again, 1, hits)) == 1  # the last token's block; the restored ones are hits
    loads, _ = kv.take_pending_tier_io()
    assert [block_id for block_id, _ in loads] == kv.block_ids("b")[:READ_AHEAD_MIN_BLOCKS]
    assert [bytes(data) for _, data in loads] == [payload(i) for i in range(READ_AHEAD_MIN_BLOCKS)]
