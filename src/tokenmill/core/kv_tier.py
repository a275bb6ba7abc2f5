"""The prefix cache's second tier: KV blocks kept in a directory, found again after eviction or a restart.

One file per block, named by the block's prefix-cache key (the chained SHA-256 of every token before and
in it, core.kv_cache_manager), under a directory named by the fingerprint of everything that changes a
block's bytes (model files, dtypes, numerics, block size, tensor-parallel size, bytes per block, this file
format). A block computed under other settings lives under another fingerprint and is never read.

    <dir>/<fingerprint[:16]>/fingerprint.json        what the fingerprint covers, in words
    <dir>/<fingerprint[:16]>/<key[:2]>/<key>.kv      header (magic, version, fingerprint, key, length, CRC-32)
                                                     + the block's K/V bytes as the runner laid them out

Why plain files rather than LMCache's or vLLM's offloading stores: those manage GPU <-> host transfers and
their own servers; here a block is a few hundred KiB written once and read whole, the OS page cache is
the host tier, a rename makes each write atomic for every process sharing the directory, and the file
name is the index (a restarted server lists the directory, another core's new block is one stat away).

In front of the directory an optional level in process memory (`host_budget_bytes`, LRU) keeps the
latest blocks written or read, as vLLM's offloading keeps them in host memory before disk: on an
accelerator, where the KV cache lives in device memory, a hit there is a memory copy with no system call
(the runner stages the copies through pinned memory). On a CPU the KV cache is host memory already and the
OS page cache holds recent files, so the level is off by default there.

Nothing a reader could mistake for a block is ever decoded: a file whose header, length or CRC-32 does not
match is a miss (and is removed). Errors never fail a request: a write that fails (full disk, read-only
directory) stops writing for a while and counts an error; a read that fails is a miss.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

logger = logging.getLogger("tokenmill")

LAYOUT_VERSION = 1
MAGIC = b"TMKVBLK\0"
# magic, layout version, fingerprint (32 bytes), SHA-256 of the key, payload length, CRC-32 of the payload
HEADER = struct.Struct("<8sI32s32sQI")
SUFFIX = ".kv"
# A failed write (full disk, read-only directory) stops writes for this long before one is tried again.
WRITE_RETRY_S = 60.0
# Blocks handed to the writer but not yet written, at most (beyond, new writes are dropped and counted).
MAX_PENDING_WRITE_BYTES = 256 * 2**20
# Before any measurement: reading a block back is assumed to take this many bytes per second, and a
# prefill step this many tokens per second (a CPU's order of magnitude: restoring then always pays).
INITIAL_READ_BYTES_PER_S = 500e6
INITIAL_COMPUTE_TOKENS_PER_S = 1e3
EMA_WEIGHT = 0.2


def fingerprint_of(components: dict[str, Any]) -> bytes:
    """SHA-256 of the components (sorted JSON) together with this file format's version."""
    text = json.dumps({"layout_version": LAYOUT_VERSION, **components}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def files_digest(paths: Iterable[Path], sample_bytes: int = 1 << 20) -> str:
    """A digest of model files that reads at most 2 x sample_bytes of each: its name, size and first and
    last `sample_bytes`. Two different files alike in all of those are not a case that occurs in practice
    (quantized files differ within their first bytes' metadata), and hashing gigabytes at every start
    would cost seconds."""
    digest = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(sample_bytes))
            if size > sample_bytes:
                f.seek(max(sample_bytes, size - sample_bytes))
                digest.update(f.read(sample_bytes))
    return digest.hexdigest()


def block_path(root: Path, key: bytes) -> Path:
    """Where a tier keeps a block: <root>/<key[:2]>/<key>.kv (root: the fingerprint's directory)."""
    name = key.hex()
    return Path(root) / name[:2] / (name + SUFFIX)


class TierView:
    """What a process that only routes requests (the data-parallel router) sees of a tier the engine
    cores share: which leading blocks of a prompt it holds, by one stat per block."""

    def __init__(self, root: str, file_bytes: int) -> None:
        self.root = Path(root)
        self.file_bytes = file_bytes

    def leading_blocks(self, keys: Iterable[bytes]) -> int:
        count = 0
        for key in keys:
            try:
                if block_path(self.root, key).stat().st_size != self.file_bytes:
                    break
            except OSError:
                break
            count += 1
        return count


@dataclass(slots=True)
class KVTierStats:
    """Cumulative counts (the engine core sends them with its stats; the prompt tokens looked up and restored
    are the KV cache manager's, which does the lookups)."""

    blocks_written: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    restore_seconds: float = 0.0
    evictions: int = 0
    corrupt: int = 0  # files refused by their header, length or checksum
    write_errors: int = 0
    read_errors: int = 0
    dropped_writes: int = 0  # the writer fell behind
    skipped_restores: int = 0  # tier hits recomputed because computing was estimated cheaper
    host_blocks_read: int = 0  # of blocks_read, those found in the level in process memory
    host_evictions: int = 0  # blocks dropped from that level for its budget (the directory keeps them)


@dataclass(slots=True)
class _Costs:
    """Running estimates that decide, per request, whether reading blocks back beats recomputing them."""

    read_bytes_per_s: float = INITIAL_READ_BYTES_PER_S
    compute_tokens_per_s: float = INITIAL_COMPUTE_TOKENS_PER_S

    def observe_read(self, num_bytes: int, seconds: float) -> None:
        if seconds > 0 and num_bytes > 0:
            self.read_bytes_per_s += EMA_WEIGHT * (num_bytes / seconds - self.read_bytes_per_s)

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        if seconds > 0 and num_tokens > 0:
            self.compute_tokens_per_s += EMA_WEIGHT * (num_tokens / seconds - self.compute_tokens_per_s)


@dataclass
class KVTier:
    """A directory of KV blocks with a byte budget, LRU eviction and a background writer.

    payload_bytes: the size of one block as the runner lays it out (every valid file holds exactly that).
    host_budget_bytes: the level in process memory in front of the directory (0: none).
    """

    directory: Path
    budget_bytes: int
    fingerprint: bytes
    payload_bytes: int
    components: dict[str, Any] = field(default_factory=dict)
    stats: KVTierStats = field(default_factory=KVTierStats)
    host_budget_bytes: int = 0

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        self.root = self.directory / self.fingerprint.hex()[:16]
        self.file_bytes = HEADER.size + self.payload_bytes
        self.costs = _Costs()
        self._lock = threading.Lock()
        # key -> present, least recently used first (this process's view: other processes' writes are
        # found by a stat on lookup, their evictions by a failed read).
        self._index: OrderedDict[bytes, None] = OrderedDict()
        self._queued: set[bytes] = set()
        # The level in process memory: key -> payload, least recently used first.
        self._host: OrderedDict[bytes, bytearray] = OrderedDict()
        self._pending_bytes = 0
        self._pinned: dict[bytes, float] = {}  # key -> time.monotonic() until which eviction skips it
        self._writes_paused_until = 0.0
        self._queue: queue.Queue = queue.Queue()
        self._open()
        self._writer = threading.Thread(target=self._write_loop, name="tokenmill-kv-tier-writer", daemon=True)
        self._writer.start()

    @property
    def stored_blocks(self) -> int:
        """Blocks the tier holds, as this process knows them."""
        return len(self._index)

    @property
    def stored_bytes(self) -> int:
        return len(self._index) * self.file_bytes

    @property
    def host_stored_bytes(self) -> int:
        return len(self._host) * self.payload_bytes

    def counters(self) -> dict[str, float]:
        """The cumulative counts and the gauges (stored blocks and bytes, bytes in process memory), by name."""
        return {**dataclasses.asdict(self.stats), "stored_blocks": self.stored_blocks,
                "stored_bytes": self.stored_bytes, "host_stored_bytes": self.host_stored_bytes}

    # ---- start-up ------------------------------------------------------------------------
    def _open(self) -> None:
        """Find what an earlier run left under this fingerprint (oldest first), and say once what other
        fingerprints' entries are being ignored."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            description = self.root / "fingerprint.json"
            if not description.exists():
                tmp = description.with_suffix(f".tmp.{os.getpid()}")
                tmp.write_text(json.dumps({"layout_version": LAYOUT_VERSION, **self.components}, indent=1,
                                          sort_keys=True, default=str))
                os.replace(tmp, description)
        except OSError as exc:
            self._write_failed(exc)
        found = []
        for path in self._block_files(self.root):
            try:
                stat = path.stat()
            except OSError:
                continue
            if stat.st_size == self.file_bytes:
                found.append((stat.st_mtime, bytes.fromhex(path.stem)))
        for _, key in sorted(found):
            self._index[key] = None
        others = self._other_fingerprints()
        if others:
            logger.info("KV offload: ignoring %d blocks in %s written under another fingerprint (%s)",
                        sum(count for _, count in others), self.directory,
                        "; ".join(f"{name}: {count} blocks" for name, count in others))
        logger.info("KV offload: %s, %d blocks (%.1f MiB) found, budget %.1f GiB%s", self.root, len(self._index),
                    self.stored_bytes / 2**20, self.budget_bytes / 2**30,
                    f", {self.host_budget_bytes / 2**30:.1f} GiB in memory before it" if self.host_budget_bytes else "")
        self._evict_over_budget()

    @staticmethod
    def _block_files(root: Path) -> list[Path]:
        try:
            return [path for sub in root.iterdir() if sub.is_dir() for path in sub.glob("*" + SUFFIX)]
        except OSError:
            return []

    def _other_fingerprints(self) -> list[tuple[str, int]]:
        """(what differs from this fingerprint, block count) for each other fingerprint in the directory."""
        others = []
        try:
            subdirs = [d for d in self.directory.iterdir() if d.is_dir() and d != self.root]
        except OSError:
            return []
        ours = {"layout_version": LAYOUT_VERSION, **json.loads(json.dumps(self.components, default=str))}
        for sub in subdirs:
            count = len(self._block_files(sub))
            if not count:
                continue
            try:
                theirs = json.loads((sub / "fingerprint.json").read_text())
                differs = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
                name = "differs in " + ", ".join(differs)
            except (OSError, ValueError):
                name = sub.name
            others.append((name, count))
        return others

    # ---- lookup and read -------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return block_path(self.root, key)

    def contains(self, key: bytes, look: bool = True) -> bool:
        """Whether the tier holds the block; `look`: also stat the directory for a block another process
        wrote (otherwise only this process's index answers)."""
        with self._lock:
            if key in self._index or key in self._host:
                return True
        if not look:
            return False
        try:
            present = self._path(key).stat().st_size == self.file_bytes
        except OSError:
            return False
        if present:
            with self._lock:
                self._index[key] = None
        return present

    def read(self, key: bytes) -> Optional[bytearray]:
        """The block's payload, verified; None when it is missing, unreadable or fails a check. The caller
        must not change it (the level in memory may hand the same buffer out again)."""
        with self._lock:
            payload = self._host.get(key)
            if payload is not None:
                self._host.move_to_end(key)
                self.stats.blocks_read += 1
                self.stats.host_blocks_read += 1
                self.stats.bytes_read += len(payload)
                return payload
        path = self._path(key)
        start = time.perf_counter()
        try:
            with open(path, "rb") as f:
                header = f.read(HEADER.size)
                payload = bytearray(self.payload_bytes)
                got = f.readinto(payload) if len(header) == HEADER.size else 0
                trailing = f.read(1)
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as exc:
            self.stats.read_errors += 1
            logger.warning("KV offload: cannot read %s (%s); computing the block instead", path, exc)
            self._forget(key)
            return None
        problem = self._check(header, got, trailing, key, payload)
        if problem is not None:
            self.stats.corrupt += 1
            logger.warning("KV offload: %s %s; the block is computed instead and the file removed", path, problem)
            self._forget(key)
            try:
                path.unlink()
            except OSError:
                pass
            return None
        seconds = time.perf_counter() - start
        self.costs.observe_read(len(payload), seconds)
        self.stats.blocks_read += 1
        self.stats.bytes_read += len(payload)
        self.stats.restore_seconds += seconds
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self._keep_in_host(key, payload)
        try:
            os.utime(path)  # a restarted server's LRU order
        except OSError:
            pass
        return payload

    def _check(self, header: bytes, got: int, trailing: bytes, key: bytes, payload: bytearray) -> Optional[str]:
        if len(header) != HEADER.size:
            return "is truncated"
        magic, version, fingerprint, key_digest, length, crc = HEADER.unpack(header)
        if magic != MAGIC or version != LAYOUT_VERSION:
            return "is not a block file of this version"
        if fingerprint != self.fingerprint or key_digest != hashlib.sha256(key).digest():
            return "belongs to another fingerprint or key"
        if length != self.payload_bytes or got != length or trailing:
            return "is truncated" if got < length else "has the wrong length"
        if zlib.crc32(payload) != crc:
            return "fails its checksum"
        return None

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._index.pop(key, None)

    def _keep_in_host(self, key: bytes, payload: bytearray) -> None:
        """Keeps a payload in the level in process memory, dropping the least recently used over its budget.
        Called with the lock held."""
        if self.host_budget_bytes < self.payload_bytes:
            return
        self._host[key] = payload
        self._host.move_to_end(key)
        while len(self._host) * self.payload_bytes > self.host_budget_bytes:
            self._host.popitem(last=False)
            self.stats.host_evictions += 1

    def restore_pays(self, num_blocks: int, num_tokens: int) -> bool:
        """Whether reading `num_blocks` back is estimated to take less time than computing their
        `num_tokens` tokens (both rates measured as the engine runs)."""
        read_s = num_blocks * self.file_bytes / self.costs.read_bytes_per_s
        compute_s = num_tokens / self.costs.compute_tokens_per_s
        if read_s < compute_s:
            return True
        self.stats.skipped_restores += 1
        return False

    # ---- write -----------------------------------------------------------------------------
    def wants(self, key: bytes) -> bool:
        """Whether a block is worth handing to `put`: not stored or queued, and writes not paused (while they
        are, the level in memory still takes blocks it lacks)."""
        with self._lock:
            if key in self._index or key in self._queued:
                return False
            return time.monotonic() >= self._writes_paused_until or (
                self.host_budget_bytes >= self.payload_bytes and key not in self._host)

    def put(self, key: bytes, payload: bytes) -> None:
        """Queue a block for the writer thread (dropped, and counted, if the writer is far behind)."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"a block of {len(payload)} bytes where {self.payload_bytes} were expected")
        with self._lock:
            if key in self._index or key in self._queued:
                return
            if key not in self._host:
                self._keep_in_host(key, bytearray(payload))
            if self._pending_bytes + len(payload) > MAX_PENDING_WRITE_BYTES:
                self.stats.dropped_writes += 1
                return
            self._queued.add(key)
            self._pending_bytes += len(payload)
        self._queue.put((key, payload))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written (tests; a graceful shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queued:
                    return True
            time.sleep(0.005)
        return False

    def _write_loop(self) -> None:
        while True:
            key, payload = self._queue.get()
            try:
                if time.monotonic() >= self._writes_paused_until:
                    self._write(key, payload)
            except OSError as exc:
                self._write_failed(exc)
            except Exception:  # never let the writer die: a lost block is only a future miss
                logger.exception("KV offload: writing a block failed")
            finally:
                with self._lock:
                    self._queued.discard(key)
                    self._pending_bytes -= len(payload)

    def _write(self, key: bytes, payload: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        header = HEADER.pack(MAGIC, LAYOUT_VERSION, self.fingerprint, hashlib.sha256(key).digest(),
                             len(payload), zlib.crc32(payload))
        # Written under a private name, then renamed: a reader (this or another process) sees the whole
        # file or none, and two writers of one block leave one whole copy.
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        with self._lock:
            self._index[key] = None
            self.stats.blocks_written += 1
            self.stats.bytes_written += len(payload)
        self._evict_over_budget()

    def _write_failed(self, exc: OSError) -> None:
        self.stats.write_errors += 1
        first = self._writes_paused_until == 0.0
        self._writes_paused_until = time.monotonic() + WRITE_RETRY_S
        reason = {errno.ENOSPC: "the disk is full", errno.EROFS: "the directory is read-only",
                  errno.EACCES: "no permission to write", errno.EDQUOT: "the disk quota is spent"}.get(
                      exc.errno, str(exc))
        (logger.warning if first else logger.debug)(
            "KV offload: cannot write to %s (%s); serving without new tier blocks, trying again in %.0f s",
            self.root, reason, WRITE_RETRY_S)

    def pin(self, keys: Iterable[bytes], until: float) -> None:
        """Keeps the blocks from the budget's eviction until `until` (time.monotonic()), later pins winning."""
        with self._lock:
            for key in keys:
                self._pinned[key] = max(until, self._pinned.get(key, 0.0))

    def _victim(self) -> Optional[bytes]:
        """The least recently used block no pin holds (expired pins are dropped on the way)."""
        now = time.monotonic()
        for key in self._index:
            until = self._pinned.get(key)
            if until is None:
                return key
            if until <= now:
                del self._pinned[key]
                return key
        return None

    def _evict_over_budget(self) -> None:
        while True:
            with self._lock:
                if self.stored_bytes <= self.budget_bytes or not self._index:
                    return
                key = self._victim()
                if key is None:
                    return  # everything left is pinned: the budget is exceeded until the pins expire
                del self._index[key]
                self.stats.evictions += 1
            try:
                self._path(key).unlink()
            except OSError:
                pass
