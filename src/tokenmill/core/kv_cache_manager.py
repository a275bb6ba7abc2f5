"""Per-request block tables on top of the BlockPool: prefix-cache lookup, allocation, fork, free.

Prefix-cache keys are chained SHA-256 digests: H(parent digest, token ids, extra keys). A 256-bit
digest makes an accidental collision (two different prefixes sharing a key) astronomically unlikely
(~2^-128 for 2^64 cached blocks), so a hit is trusted without comparing tokens.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Optional, Sequence

from tokenmill.core.block_pool import BlockPool, KVBlock
from tokenmill.core.request import Request

_ROOT_HASH = b"tokenmill-root"


def hash_block_tokens(parent_hash: Optional[bytes], token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    digest = hashlib.sha256(parent_hash or _ROOT_HASH)
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra_keys)
    return digest.digest()


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are already in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()
        # (src, dst) block copies the runner must do before the next forward pass (copy-on-write).
        self.pending_copies: list[tuple[int, int]] = []
        # Requests whose existing block ids changed (copy-on-write): the runner gets their table anew.
        self.rewritten_tables: set[str] = set()
        # Swap space: host blocks holding the KV of swapped-out requests.
        self.host_pool = BlockPool(num_host_blocks, enable_caching=False) if num_host_blocks > 0 else None
        self.req_to_host_blocks: dict[str, list[KVBlock]] = {}
        self.pending_swap_out: list[tuple[int, int]] = []  # (device block, host block)
        self.pending_swap_in: list[tuple[int, int]] = []  # (host block, device block)
        # Host blocks released by a swap-in are reused only after the copy back has run.
        self._host_blocks_to_free: list[KVBlock] = []

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def block_ids_from(self, request_id: str, start: int) -> list[int]:
        """The request's block ids from index `start` on (what a runner that holds `start` lacks)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())[start:]]

    def take_rewritten_tables(self) -> set[str]:
        rewritten, self.rewritten_tables = self.rewritten_tables, set()
        return rewritten

    # ---- hashing -------------------------------------------------------------------------
    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to cover the full blocks among its first num_tokens tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        while (len(hashes) + 1) * bs <= num_tokens:
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[start:start + bs]))

    # ---- lookup --------------------------------------------------------------------------
    def _cached_prefix(self, request: Request) -> list[KVBlock]:
        """Cached blocks of the request's longest cached prefix. The last token must be computed to
        get logits, so at most num_tokens - 1 tokens are looked up."""
        max_tokens = request.num_tokens - 1
        self._update_block_hashes(request, max_tokens)
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[: max_tokens // self.block_size]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, leaving at least its last token to compute."""
        if not self.enable_caching:
            return [], 0
        hits = self._cached_prefix(request)
        self.prefix_stats.queries += request.num_tokens
        self.prefix_stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def peek_cached_tokens(self, request: Request) -> int:
        """Cached prefix length in tokens, without taking the blocks or counting a query."""
        if not self.enable_caching:
            return 0
        return len(self._cached_prefix(request)) * self.block_size

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = ()) -> Optional[list[KVBlock]]:
        """Give the request room for num_new_tokens more tokens (after its computed ones and any
        cache hits). Returns the newly allocated blocks, or None when the pool cannot fit them
        (nothing is changed then, and the scheduler may preempt)."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_needed = -(-total_tokens // self.block_size) - len(blocks) - len(new_computed_blocks)
        # Cache hits sitting in the free queue stop being free once we take them.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        shared_partial = self._shared_partial_block(request, blocks) if num_new_tokens > 0 else None
        num_copies = 1 if shared_partial is not None else 0
        if max(num_needed, 0) + num_revived + num_copies > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if shared_partial is not None:
            self._copy_on_write(blocks, shared_partial)
            self.rewritten_tables.add(request.request_id)
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_needed) if num_needed > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, total_tokens)
        return new_blocks

    def _shared_partial_block(self, request: Request, blocks: list[KVBlock]) -> Optional[int]:
        """Index of the block the next token is written into, if other requests share it."""
        index = request.num_computed_tokens // self.block_size
        if request.num_computed_tokens % self.block_size and index < len(blocks) and blocks[index].ref_cnt > 1:
            return index
        return None

    def _copy_on_write(self, blocks: list[KVBlock], index: int) -> None:
        """Give the request a private copy of a shared, partially filled block before it writes."""
        shared = blocks[index]
        private = self.pool.get_new_blocks(1)[0]
        self.pending_copies.append((shared.block_id, private.block_id))
        self.pool.free_blocks([shared])
        blocks[index] = private

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (ref counts up); writes copy on demand."""
        blocks = self.req_to_blocks.get(parent.request_id, [])
        self.pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks in the prefix cache. Their KV is written during the
        coming forward pass, before any later step can read it through a cache hit."""
        # Only tokens whose ids are known can be hashed (speculative or future ones cannot).
        num_tokens = min(num_tokens, request.num_tokens)
        self._update_block_hashes(request, num_tokens)
        blocks = self.req_to_blocks[request.request_id]
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        for i in range(start, end):
            self.pool.cache_full_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    # ---- swapping ------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        blocks = self.req_to_blocks.get(request.request_id)
        return self.host_pool is not None and bool(blocks) and len(blocks) <= self.host_pool.num_free_blocks

    def swap_out(self, request: Request) -> None:
        """Copy the request's blocks to host memory (at the start of the next step) and free them."""
        blocks = self.req_to_blocks.pop(request.request_id)
        self.num_cached_blocks.pop(request.request_id, None)
        host = self.host_pool.get_new_blocks(len(blocks))
        self.pending_swap_out += [(d.block_id, h.block_id) for d, h in zip(blocks, host)]
        self.req_to_host_blocks[request.request_id] = host
        self.pool.free_blocks(reversed(blocks))

    def can_swap_in(self, request: Request, reserve: int = 0) -> bool:
        """Whether the request's blocks fit on the device with `reserve` blocks to spare."""
        return len(self.req_to_host_blocks.get(request.request_id, ())) + reserve <= self.pool.num_free_blocks

    def swap_in(self, request: Request) -> None:
        host = self.req_to_host_blocks.pop(request.request_id)
        device = self.pool.get_new_blocks(len(host))
        self.pending_swap_in += [(h.block_id, d.block_id) for h, d in zip(host, device)]
        self.req_to_blocks[request.request_id] = device
        self._host_blocks_to_free += host
        if self.enable_caching:
            self.num_cached_blocks[request.request_id] = 0
            self._cache_full_blocks(request, request.num_computed_tokens)

    def take_pending_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Swap copies for the runner: all swap-outs run before all swap-ins."""
        swaps = (self.pending_swap_out, self.pending_swap_in)
        self.pending_swap_out, self.pending_swap_in = [], []
        if self._host_blocks_to_free:
            self.host_pool.free_blocks(self._host_blocks_to_free)
            self._host_blocks_to_free = []
        return swaps

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free_blocks if self.host_pool is not None else 0

    def free(self, request: Request) -> None:
        host = self.req_to_host_blocks.pop(request.request_id, None)
        if host:
            self.host_pool.free_blocks(host)
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            # Tail blocks first: they are the least likely to be shared, so they are evicted first.
            self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
