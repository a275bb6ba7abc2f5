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
from tokenmill.core.kv_tier import KVTier
from tokenmill.core.pinned_prefixes import PIN_RELEASE_BLOCKS, PinnedPrefixes
from tokenmill.core.request import Request
from tokenmill.core.tier_reads import READ_WAIT_S, TierHit, TierReads

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


def first_needed_block(position: int, window: Optional[int], block_size: int) -> int:
    """Index of the first block a chunk starting at `position` reads in a layer with `window`: its
    first query sees keys from position - window + 1 on (None: every block).

        window 6, block_size 4, chunk from position 13: keys 8.. -> blocks 2..
        |b0 0-3|b1 4-7|b2 8-11|b3 12-15|
    """
    if window is None:
        return 0
    return max(0, position - window + 1) // block_size


class KVCacheManager:
    """Block tables of every request, one per KV cache group (core.kv_cache_groups), over one pool.

    A group of sliding-window layers keeps only the blocks its window can still reach: entries behind
    it point to the pool's null block. With a single group of full-attention layers (the common case)
    this is one block table per request, exactly as before.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0, group_windows: Sequence[Optional[int]] = (None,),
                 tier: Optional[KVTier] = None, max_pinned_blocks: int = 0) -> None:
        """tier: the prefix cache's second tier: full blocks are stored there once computed, and a prefix the
        memory cache lacks is read back from it instead of computed.
        max_pinned_blocks: how many blocks requests' `cache_ttl_s` may keep resident at once."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows)
        windowed = any(window is not None for window in self.group_windows)
        self.pool = BlockPool(num_blocks, enable_caching, reserve_null_block=windowed)
        self.null_block = self.pool.null_block
        # Per group: request id -> its block table (KVBlock per block of tokens, null_block where dropped).
        self.group_blocks: list[dict[str, list[KVBlock]]] = [{} for _ in self.group_windows]
        self.req_to_blocks = self.group_blocks[0]
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
        if tier is not None and not enable_caching:
            raise ValueError("the KV offload tier needs prefix caching")
        self.tier = tier
        self.tier_stats = PrefixCacheStats()  # tokens the memory cache lacked, and those the tier restored
        # Runner work of the step being scheduled: (block id, payload) to copy in before the forward pass,
        # (block id, key) to copy out after it (blocks this step fills, for the tier).
        self.pending_loads: list[tuple[int, bytearray]] = []
        self.pending_stores: list[tuple[int, bytes]] = []
        self.tier_reads = TierReads(tier) if tier is not None else None
        # Pinned prefixes (a request's cache_ttl_s).
        self.pins = PinnedPrefixes(self.pool, max_pinned_blocks)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        return [b.block_id for b in self.group_blocks[group].get(request_id, ())]

    def block_ids_from(self, request_id: str, start: int, group: int = 0) -> list[int]:
        """The request's block ids from index `start` on (what a runner that holds `start` lacks)."""
        return [b.block_id for b in self.group_blocks[group].get(request_id, ())[start:]]

    def num_held_blocks(self, request_id: str) -> list[int]:
        """Per group, the blocks the request holds (dropped entries behind a window not counted)."""
        return [sum(b is not self.null_block for b in blocks.get(request_id, ())) for blocks in self.group_blocks]

    def take_rewritten_tables(self) -> set[str]:
        rewritten, self.rewritten_tables = self.rewritten_tables, set()
        return rewritten

    def _real(self, blocks: Sequence[KVBlock]) -> list[KVBlock]:
        return [b for b in blocks if b is not self.null_block]

    @staticmethod
    def _cache_key(block_hash: bytes, group: int) -> bytes:
        # Each group holds its own copy of a block of tokens (other layers' K/V).
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    # ---- hashing -------------------------------------------------------------------------
    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to cover the full blocks among its first num_tokens tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        while (len(hashes) + 1) * bs <= num_tokens:
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else None
            # The first block carries the request's salt (its LoRA adapter's): the chain carries it on.
            hashes.append(hash_block_tokens(parent, request.all_token_ids[start:start + bs],
                                            b"" if hashes else request.cache_salt))

    # ---- lookup --------------------------------------------------------------------------
    def _cached_prefix(self, request: Request, tier_look: Optional[bool] = None) -> list[list]:
        """Per group, the blocks of the request's longest cached prefix. The last token must be computed
        to get logits, so at most num_tokens - 1 tokens are looked up. With `tier_look` (True: stat the
        directory for other processes' blocks too, False: this process's index only), a block the memory
        cache lacks may come from the second tier: a TierHit without its payload yet.

        A hit of k blocks needs, in a full-attention group, blocks 0..k-1 cached; in a sliding-window
        group only the blocks the window of position k * block_size reaches (the entries before them
        are the null block). Chained hashes make a block's key name every token before it, so a
        cached block's K/V is right for any request whose prefix reaches its key.
        """
        max_tokens = request.num_tokens - 1
        self._update_block_hashes(request, max_tokens)
        hashes = request.block_hashes[: max_tokens // self.block_size]
        limit = len(hashes)
        found: list[list] = []
        for group, window in enumerate(self.group_windows):
            blocks: list = []
            for block_hash in hashes[:limit]:
                key = self._cache_key(block_hash, group)
                block = self.pool.get_cached_block(key)
                if block is None and tier_look is not None and self.tier.contains(key, look=tier_look):
                    block = TierHit(key, None)
                if block is None and window is None:
                    break
                blocks.append(block)
            if window is None:
                limit = len(blocks)
            found.append(blocks)
        num_hits = limit
        while num_hits > 0 and not all(self._window_present(blocks, num_hits, window)
                                       for blocks, window in zip(found, self.group_windows)):
            num_hits -= 1
        hits = []
        for blocks, window in zip(found, self.group_windows):
            first = first_needed_block(num_hits * self.block_size, window, self.block_size)
            hits.append([self.null_block] * first + blocks[first:num_hits])
        return hits

    def _window_present(self, blocks: list, num_hits: int, window: Optional[int]) -> bool:
        first = first_needed_block(num_hits * self.block_size, window, self.block_size)
        return all(block is not None for block in blocks[first:num_hits])

    def _pack(self, hits: list[list]) -> list:
        """Cache hits as the scheduler holds them: a block per hit (one group), or a tuple of one
        block per group."""
        return hits[0] if self.num_groups == 1 else list(zip(*hits))

    def _unpack(self, hits: Sequence) -> list[list]:
        if self.num_groups == 1:
            return [list(hits)]
        return [list(column) for column in zip(*hits)] if hits else [[] for _ in self.group_windows]

    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        """Longest cached prefix of the request, leaving at least its last token to compute: the hit
        blocks (for several groups, a tuple per block of tokens; read back from the tier: TierHit) and
        the tokens they hold."""
        if not self.enable_caching:
            return [], 0
        hits = self._cached_prefix(request)
        num_hits = len(hits[0])
        self.prefix_stats.queries += request.num_tokens
        self.prefix_stats.hits += num_hits * self.block_size
        if self.tier is not None:
            restored = self._read_from_tier(request, hits)
            if restored is None:  # being read in the background: is_reading() says so; nothing counted yet
                return [], 0
            self.tier_stats.queries += request.num_tokens - num_hits * self.block_size
            self.tier_stats.hits += (len(restored[0]) - num_hits) * self.block_size
            hits = restored
        return self._pack(hits), len(hits[0]) * self.block_size

    def peek_cached_tokens(self, request: Request) -> int:
        """Cached prefix length in tokens (the tier's blocks this process knows of included), without
        taking the blocks or counting a query."""
        if not self.enable_caching:
            return 0
        return len(self._cached_prefix(request, tier_look=False if self.tier is not None else None)[0]) \
            * self.block_size

    # ---- the second tier -----------------------------------------------------------------
    def _read_from_tier(self, request: Request, memory_hits: list[list]) -> Optional[list[list]]:
        """The longest prefix the memory cache and the tier hold together, the tier's blocks read back (see
        TierReads.read); None while a background read of them runs."""
        if len(memory_hits[0]) == (request.num_tokens - 1) // self.block_size:
            self.tier_reads.forget(request.request_id)  # the memory cache holds every block a hit may cover
            return memory_hits
        return self.tier_reads.read(request.request_id, memory_hits,
                                    lambda: self._cached_prefix(request, tier_look=True), self.block_size)

    def wait_for_reads(self, timeout_s: float = READ_WAIT_S) -> None:
        """Blocks until a background tier read finishes (or timeout_s passes): a step with nothing else to
        do waits here instead of spinning (which would also hold the interpreter the reader needs)."""
        if self.tier_reads is not None:
            self.tier_reads.wait(timeout_s)

    def is_reading(self, request: Request) -> bool:
        """Whether the request's tier blocks are being read in the background (it waits this step)."""
        return self.tier_reads is not None and self.tier_reads.is_reading(request.request_id)

    def take_pending_tier_io(self) -> tuple[list[tuple[int, bytearray]], list[tuple[int, bytes]]]:
        """The step's tier copies for the runner: payloads into blocks before the forward pass, blocks
        out (for the tier) after it."""
        io = (self.pending_loads, self.pending_stores)
        self.pending_loads, self.pending_stores = [], []
        return io

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence = ()) -> Optional[list[KVBlock]]:
        """Give the request room for num_new_tokens more tokens (after its computed ones and any
        cache hits). Returns the newly allocated blocks, or None when the pool cannot fit them
        (nothing is changed then but dropping blocks its windows have passed, and the scheduler
        may preempt)."""
        rid = request.request_id
        bs = self.block_size
        hits = self._unpack(new_computed_blocks)
        num_hits = len(new_computed_blocks)
        # Blocks read back from the tier take fresh blocks.
        num_restored = sum(isinstance(hit, TierHit) for column in hits for hit in column)
        tables = [blocks.setdefault(rid, []) for blocks in self.group_blocks]
        num_computed = request.num_computed_tokens + num_hits * bs
        total_tokens = num_computed + num_new_tokens
        self._drop_behind_windows(tables, num_computed)
        num_needed = [-(-total_tokens // bs) - len(table) - num_hits for table in tables]
        # Cache hits sitting in the free queue stop being free once we take them.
        num_revived = sum(1 for column in hits for b in column
                          if isinstance(b, KVBlock) and b is not self.null_block and b.ref_cnt == 0)
        shared = [self._shared_partial_block(request, table) if num_new_tokens > 0 else None for table in tables]
        num_copies = sum(index is not None for index in shared)
        if (sum(max(n, 0) for n in num_needed) + num_revived + num_copies + num_restored
                > self.pool.num_free_blocks):
            if not tables[0]:
                for blocks in self.group_blocks:
                    blocks.pop(rid, None)
            return None
        # Every group's hits leave the free queue before any block is allocated: otherwise one group's
        # allocation could evict (and reuse) a free cached block that is a later group's hit.
        for column in hits:
            self.pool.touch([b for b in self._real(column) if isinstance(b, KVBlock)])
        for table, column in zip(tables, hits):
            table.extend(self._restore(hit) if isinstance(hit, TierHit) else hit for hit in column)
        new_blocks: list[KVBlock] = []
        for table, count, index in zip(tables, num_needed, shared):
            if index is not None:
                self._copy_on_write(table, index)
                self.rewritten_tables.add(rid)
            fresh = self.pool.get_new_blocks(count) if count > 0 else []
            table.extend(fresh)
            new_blocks += fresh
        if self.enable_caching:
            self._cache_full_blocks(request, total_tokens)
        return new_blocks

    def _restore(self, hit: TierHit) -> KVBlock:
        """A fresh block for a block read back from the tier; the runner copies the payload in before the
        step's forward pass."""
        block = self.pool.get_new_blocks(1)[0]
        self.pending_loads.append((block.block_id, hit.payload))
        self.tier_reads.restored(hit)
        return block

    def _drop_behind_windows(self, tables: list[list[KVBlock]], position: int) -> None:
        """Sliding-window groups: return the blocks a chunk starting at `position` (and every later one)
        no longer reads to the pool; their entries become the null block. Cached ones stay in the prefix
        cache (free, LRU) until evicted."""
        for table, window in zip(tables, self.group_windows):
            first = min(first_needed_block(position, window, self.block_size), len(table))
            dropped = []
            # Entries are dropped front to back, so the first null entry met going back ends the scan.
            for i in range(first - 1, -1, -1):
                if table[i] is self.null_block:
                    break
                dropped.append(table[i])
                table[i] = self.null_block
            # Oldest first: the blocks a later hit is least likely to need are evicted first.
            self.pool.free_blocks(reversed(dropped))

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
        for blocks in self.group_blocks:
            table = blocks.get(parent.request_id, [])
            self.pool.touch(self._real(table))
            blocks[child.request_id] = list(table)
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks in the prefix cache. Their KV is written during the
        coming forward pass, before any later step can read it through a cache hit."""
        # Only tokens whose ids are known can be hashed (speculative or future ones cannot).
        num_tokens = min(num_tokens, request.num_tokens)
        self._update_block_hashes(request, num_tokens)
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        tier = self.tier
        for group, blocks in enumerate(self.group_blocks):
            table = blocks[request.request_id]
            for i in range(start, end):
                if table[i] is not self.null_block:
                    key = self._cache_key(request.block_hashes[i], group)
                    if self.pool.cache_full_block(table[i], key) and tier is not None and tier.wants(key):
                        self.pending_stores.append((table[i].block_id, key))
        self.num_cached_blocks[request.request_id] = max(start, end)

    # ---- swapping ------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        """Swapping copies one block table; models with sliding-window groups recompute instead."""
        blocks = self.req_to_blocks.get(request.request_id)
        return (self.host_pool is not None and self.null_block is None and self.num_groups == 1 and bool(blocks)
                and len(blocks) <= self.host_pool.num_free_blocks)

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

    # ---- pinned prefixes -------------------------------------------------------------------
    def pin_prompt(self, request: Request, ttl_s: float, now: float) -> None:
        """Keeps the request's cached prompt blocks resident until `now + ttl_s`, as far as the pinned share
        allows (core.pinned_prefixes). With a tier, its copies are kept from the tier's eviction too."""
        until = now + ttl_s
        num_blocks = (request.num_prompt_tokens - 1) // self.block_size
        blocks = []
        for group, tables in enumerate(self.group_blocks):
            table = tables.get(request.request_id, ())
            for i in range(min(num_blocks, len(table), len(request.block_hashes))):
                key = self._cache_key(request.block_hashes[i], group)
                # Not behind a sliding window, nor a private copy of a block cached elsewhere.
                if table[i] is not self.null_block and table[i].block_hash == key:
                    blocks.append((key, table[i]))
        self.pins.pin(blocks, until)
        if self.tier is not None and blocks:
            self.tier.pin([key for key, _ in blocks], until)

    def expire_pins(self, now: float) -> int:
        """Releases the pins whose time is up: their blocks become ordinary cached blocks (LRU)."""
        return self.pins.expire(now)

    def release_pins(self, count: int = PIN_RELEASE_BLOCKS) -> int:
        """Releases up to `count` pins, those expiring soonest first; the number released."""
        return self.pins.release(count)

    def free(self, request: Request) -> None:
        if self.tier_reads is not None:
            self.tier_reads.forget(request.request_id)
        host = self.req_to_host_blocks.pop(request.request_id, None)
        if host:
            self.host_pool.free_blocks(host)
        self.num_cached_blocks.pop(request.request_id, None)
        for group_blocks in self.group_blocks:
            blocks = group_blocks.pop(request.request_id, None)
            if blocks:
                # Tail blocks first: they are the least likely to be shared, so they are evicted first.
                self.pool.free_blocks(reversed(self._real(blocks)))

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block, pinned ones included; False while requests hold blocks."""
        self.pins.unpin(list(self.pins.pinned))
        return self.pool.reset_prefix_cache()
