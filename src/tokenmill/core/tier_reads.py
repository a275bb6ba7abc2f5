"""Reading a request's prefix blocks back from the second tier (core.kv_tier) for the KV cache manager.

A restore of many blocks is read on a background thread while its request waits (other requests' steps go
on); a few blocks are read at once, since the step's wait is shorter than a step. Payloads read for a request
that then did not fit are kept for its next try, within a bound.
"""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Optional

from tokenmill.core.kv_tier import KVTier

# Payloads read for a request that then did not fit are kept for its next try, up to this many bytes.
MAX_HELD_TIER_BYTES = 512 * 2**20
# A restore of at least this many blocks not yet read is read in the background while its request waits
# (fewer are read at once: the step's wait is shorter than a step).
READ_AHEAD_MIN_BLOCKS = 8
# A step with nothing to run waits at most this long for such a read.
READ_WAIT_S = 0.05


@dataclass(slots=True)
class TierHit:
    """A block of a request's prefix found in the second tier and read back: it takes a fresh block at
    allocation, and the runner copies the payload into it before the step's forward pass."""

    key: bytes
    payload: Optional[bytearray]  # None while only the tier's index has been asked


class TierReads:
    """The tier's reads on behalf of requests: at once, or in the background while the request waits."""

    def __init__(self, tier: KVTier) -> None:
        self.tier = tier
        self.held: dict[bytes, bytearray] = {}  # read, not yet restored into a block
        # Requests whose tier blocks a background thread is reading: id -> its future.
        self.in_flight: dict[str, Future] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-kv-tier-reader")

    def read(self, request_id: str, memory_hits: list[list], lookup: Callable[[], list[list]],
             block_size: int) -> Optional[list[list]]:
        """The longest prefix the memory cache and the tier hold together (`lookup()`: per group, memory
        blocks and TierHits), with the tier's blocks read and verified, when reading them is estimated
        cheaper than computing what they add over `memory_hits`; else `memory_hits`. A block that fails its
        checks is dropped from the tier, and the prefix is looked up again without it (the rest is
        computed). None while a background read of the blocks runs."""
        num_memory = len(memory_hits[0])
        reading = self.in_flight.pop(request_id, None)
        if reading is not None:
            if not reading.done():
                self.in_flight[request_id] = reading
                return None
            self.held.update((key, payload) for key, payload in reading.result().items() if payload is not None)
        while True:
            hits = lookup()
            wanted = [hit for column in hits for hit in column if isinstance(hit, TierHit)]
            gained = (len(hits[0]) - num_memory) * block_size
            if not wanted or gained <= 0 or not self.tier.restore_pays(len(wanted), gained):
                return memory_hits
            missing = [hit.key for hit in wanted if hit.key not in self.held]
            if reading is None and len(missing) >= READ_AHEAD_MIN_BLOCKS:
                # Off the step's critical path: the request waits while its blocks are read.
                self.in_flight[request_id] = self._reader.submit(self._read_all, missing)
                return None
            if self._fill(wanted):
                return hits

    def _fill(self, wanted: list[TierHit]) -> bool:
        """Each hit's payload, from those held or read now; False when the tier lost one (the next lookup
        ends before it)."""
        complete = True
        for hit in wanted:
            hit.payload = self.held.get(hit.key)
            if hit.payload is None:
                hit.payload = self.tier.read(hit.key)
                if hit.payload is None:
                    complete = False
                    break
                self.held[hit.key] = hit.payload
        # Kept until allocated (a request that does not fit now tries again next step), within a bound.
        while self.held and len(self.held) * self.tier.payload_bytes > MAX_HELD_TIER_BYTES:
            del self.held[next(iter(self.held))]
        return complete

    def _read_all(self, keys: list[bytes]) -> dict[bytes, Optional[bytearray]]:
        """Runs on the reader thread: each block read and verified (None where it fails)."""
        return {key: self.tier.read(key) for key in keys}

    def restored(self, hit: TierHit) -> None:
        """The hit's payload went into a block: no longer held here."""
        self.held.pop(hit.key, None)

    def forget(self, request_id: str) -> None:
        """The request needs no read (any more): a read in flight finishes unused."""
        self.in_flight.pop(request_id, None)

    def wait(self, timeout_s: float = READ_WAIT_S) -> None:
        """Blocks until a background read finishes (or timeout_s passes)."""
        if self.in_flight:
            wait(list(self.in_flight.values()), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def is_reading(self, request_id: str) -> bool:
        return request_id in self.in_flight
