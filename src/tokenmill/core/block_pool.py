"""KV blocks, their reference counts, the LRU free queue and the prefix-cache hash map.

A block is free when its ref_cnt is 0. Free blocks sit in one doubly linked queue:
    head  [uncached blocks ... | cached blocks, least recently used first ...]  tail
New blocks are taken from the head, so blocks that still hold a reusable prefix are evicted last,
and among those the least recently freed goes first (LRU). A cache hit on a free block pulls it out
of the middle of the queue in O(1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Chained hash of the block's tokens while the block holds a cached full block, else None.
    block_hash: Optional[bytes] = None
    prev_free: Optional["KVBlock"] = None
    next_free: Optional["KVBlock"] = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) pop from the head, push at either end, and removal."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels keep the link updates branch-free
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        block.prev_free = anchor
        block.next_free = anchor.next_free
        anchor.next_free.prev_free = block
        anchor.next_free = block
        self.num_free_blocks += 1

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def block_ids(self) -> list[int]:
        ids, block = [], self._head.next_free
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, reserve_null_block: bool = False) -> None:
        if num_blocks < 1 + reserve_null_block:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0
        # Sliding-window layers: block 0 stands in for blocks a request no longer holds (behind its
        # window). Nobody writes it and nobody frees it; attention never reads it unmasked.
        self.null_block: Optional[KVBlock] = None
        if reserve_null_block:
            self.null_block = self.free_queue.popleft()
            self.null_block.ref_cnt = 1

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(count):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1

    def get_cached_block(self, block_hash: bytes) -> Optional[KVBlock]:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the cache, reviving them from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(self, block: KVBlock, block_hash: bytes) -> bool:
        """Registers a full block under its hash; False when it was cached already, or an identical block is."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # an identical block is already cached; this copy stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block. Pass blocks in eviction order (first = evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue.append(block)
                else:
                    self.free_queue.appendleft(block)

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True
