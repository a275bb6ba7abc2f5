"""Pinned prefixes (a request's `cache_ttl_s`): blocks kept resident in the prefix cache until a deadline.

A pin holds one reference, so its block never reaches the pool's free queue (never evicted) until the pin
expires or gives way; then the block is an ordinary cached block again (LRU).
"""
from __future__ import annotations

from typing import Iterable

from tokenmill.core.block_pool import BlockPool, KVBlock

# Pins released at a time when pinned prefixes must give way to a request that cannot fit otherwise.
PIN_RELEASE_BLOCKS = 16


class PinnedPrefixes:
    """Cache key -> (block, expiry on time.monotonic()), at most `max_blocks` of them."""

    def __init__(self, pool: BlockPool, max_blocks: int) -> None:
        self.pool = pool
        self.max_blocks = max_blocks
        self.pinned: dict[bytes, tuple[KVBlock, float]] = {}
        self.num_refused = 0  # blocks a pin could not hold: the pinned share was full

    def __len__(self) -> int:
        return len(self.pinned)

    def pin(self, blocks: Iterable[tuple[bytes, KVBlock]], until: float) -> None:
        """Pins each (key, block) in order (a prefix from its first block on, so what fits is always a
        usable prefix) until `until`; a pin on a block already pinned extends it."""
        for key, block in blocks:
            if key in self.pinned:
                self.pinned[key] = (block, max(until, self.pinned[key][1]))
            elif len(self.pinned) < self.max_blocks:
                self.pool.touch([block])
                self.pinned[key] = (block, until)
            else:
                self.num_refused += 1

    def expire(self, now: float) -> int:
        """Releases the pins whose time is up; the number released."""
        return self.unpin([key for key, (_, until) in self.pinned.items() if until <= now])

    def release(self, count: int = PIN_RELEASE_BLOCKS) -> int:
        """Releases up to `count` pins, those expiring soonest first (a request that cannot fit otherwise
        needs their blocks); the number released."""
        return self.unpin(sorted(self.pinned, key=lambda key: self.pinned[key][1])[:count])

    def unpin(self, keys: list[bytes]) -> int:
        """Drops the pins' references, the later blocks of a prefix first in the free queue (evicted first)."""
        self.pool.free_blocks([self.pinned.pop(key)[0] for key in reversed(keys)])
        return len(keys)
