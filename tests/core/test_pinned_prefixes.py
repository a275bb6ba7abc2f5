"""Pinned prefixes (a request's cache_ttl_s): the prompt's cached blocks stay resident, out of the free
queue, until the pin expires, within the pinned share; then they are ordinary LRU cached blocks."""
from __future__ import annotations

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def finished(kv: KVCacheManager, rid: str, tokens: list[int], ttl: float, now: float = 0.0) -> Request:
    """A request whose prompt was computed, pinned for `ttl` and freed (what the scheduler does at its end)."""
    request = Request(rid, tokens, SamplingParams(max_tokens=1, cache_ttl_s=ttl))
    hits, cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, len(tokens) - cached, hits) is not None
    request.num_computed_tokens = len(tokens)
    kv.pin_prompt(request, ttl, now)
    kv.free(request)
    return request


def test_a_pinned_prompt_survives_eviction_pressure_until_it_expires():
    kv = KVCacheManager(num_blocks=8, block_size=4, max_pinned_blocks=4)
    finished(kv, "a", list(range(13)), ttl=10.0)  # 3 full prompt blocks pinned (0, 1, 2); block 3 freed
    assert sorted(b.block_id for b, _ in kv.pins.pinned.values()) == [0, 1, 2]
    assert [b.ref_cnt for b in kv.pool.blocks[:4]] == [1, 1, 1, 0]
    # A request taking every free block evicts everything but the pinned three.
    big = Request("big", list(range(100, 120)), SamplingParams(max_tokens=1))
    assert [b.block_id for b in kv.allocate_slots(big, 20)] == [3, 4, 5, 6, 7]
    kv.free(big)
    again = Request("again", list(range(13)), SamplingParams(max_tokens=1))
    hits, cached = kv.get_computed_blocks(again)
    assert [b.block_id for b in hits] == [0, 1, 2] and cached == 12
    # Expired, they are ordinary cached blocks: the next allocation may evict them.
    assert kv.expire_pins(now=10.0) == 3 and not kv.pins.pinned
    assert [b.ref_cnt for b in kv.pool.blocks[:3]] == [0, 0, 0] and kv.num_free_blocks == 8
    kv.allocate_slots(Request("c", list(range(200, 232)), SamplingParams(max_tokens=1)), 32)
    assert kv.get_computed_blocks(Request("d", list(range(13)), SamplingParams(max_tokens=1)))[1] == 0


def test_the_pinned_share_bounds_pins_to_a_prefix_and_a_repeat_extends_them():
    kv = KVCacheManager(num_blocks=16, block_size=4, max_pinned_blocks=2)
    finished(kv, "a", list(range(17)), ttl=5.0)  # 4 full blocks, only the first 2 fit the share
    assert sorted(b.block_id for b, _ in kv.pins.pinned.values()) == [0, 1] and kv.pins.num_refused == 2
    finished(kv, "b", list(range(9)), ttl=30.0, now=1.0)  # the same first two blocks: extended, not doubled
    assert sorted(until for _, until in kv.pins.pinned.values()) == [31.0, 31.0]
    assert [b.ref_cnt for b in kv.pool.blocks[:2]] == [1, 1]
    assert kv.expire_pins(now=6.0) == 0 and kv.expire_pins(now=31.0) == 2


def test_reset_prefix_cache_drops_pins():
    kv = KVCacheManager(num_blocks=8, block_size=4, max_pinned_blocks=8)
    finished(kv, "a", list(range(9)), ttl=100.0)
    assert kv.reset_prefix_cache() and not kv.pins.pinned and kv.num_free_blocks == 8
