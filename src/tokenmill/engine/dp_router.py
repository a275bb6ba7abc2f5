"""Data parallelism: which engine core serves a request.

With `--data-parallel-size N` one API server drives N engine cores, each with its own KV cache. A
prompt's prefix-cache hits happen only on a core that computed the same prefix before, so the router
remembers, per core, the block hashes of the prompts it sent there (chained SHA-256 of full blocks,
exactly as the prefix cache hashes them) and sends a request to the core holding the longest run of
its leading blocks — unless that core carries more requests than the least-loaded one by more than
`max_imbalance`, in which case (and when no core holds any of its blocks) the least-loaded core
takes it. Each core's memory of hashes is an LRU bounded by that core's KV block count, so the
router forgets prefixes the core itself would have evicted first.

`round_robin` ignores prefixes (the baseline a benchmark compares against).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from tokenmill.config import DATA_PARALLEL_ROUTING as ROUTING_POLICIES
from tokenmill.core.kv_cache_manager import hash_block_tokens


@dataclass
class EngineLoad:
    in_flight: int = 0
    routed: int = 0  # requests sent here
    routed_by_prefix: int = 0  # of those, sent for a cached prefix
    # Block hashes this core is believed to hold, least recently routed first.
    blocks: "OrderedDict[bytes, None]" = field(default_factory=OrderedDict)


class DataParallelRouter:
    def __init__(self, num_engines: int, block_size: int, capacity_blocks: int, policy: str = "prefix",
                 max_imbalance: int = 4) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}")
        self.engines = [EngineLoad() for _ in range(num_engines)]
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.policy = policy
        self.max_imbalance = max_imbalance
        self._next = 0

    def block_hashes(self, prompt_token_ids: Sequence[int]) -> list[bytes]:
        hashes: list[bytes] = []
        bs = self.block_size
        for start in range(0, len(prompt_token_ids) - bs + 1, bs):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, prompt_token_ids[start:start + bs]))
        return hashes

    def choose(self, prompt_token_ids: Sequence[int]) -> int:
        """The engine index for a new request (counted as in flight there until `finished`)."""
        if self.policy == "round_robin":
            index = self._next % len(self.engines)
            self._next += 1
            self._assign(index, [], by_prefix=False)
            return index
        hashes = self.block_hashes(prompt_token_ids)
        # Least loaded: fewest in flight, then the fewest remembered blocks (the most room for a new
        # prefix), so prompts arriving one at a time still spread over the cores.
        least = min(range(len(self.engines)),
                    key=lambda i: (self.engines[i].in_flight, len(self.engines[i].blocks), i))
        best, best_len = least, 0
        for i, engine in enumerate(self.engines):
            matched = 0
            for digest in hashes:
                if digest not in engine.blocks:
                    break
                matched += 1
            if matched > best_len or (matched == best_len and matched and
                                      engine.in_flight < self.engines[best].in_flight):
                best, best_len = i, matched
        by_prefix = best_len > 0 and (self.engines[best].in_flight - self.engines[least].in_flight
                                      <= self.max_imbalance)
        index = best if by_prefix else least
        self._assign(index, hashes, by_prefix)
        return index

    def _assign(self, index: int, hashes: list[bytes], by_prefix: bool) -> None:
        engine = self.engines[index]
        engine.in_flight += 1
        engine.routed += 1
        engine.routed_by_prefix += by_prefix
        blocks = engine.blocks
        for digest in hashes:
            blocks[digest] = None
            blocks.move_to_end(digest)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

    def finished(self, index: int) -> None:
        self.engines[index].in_flight -= 1

    def stats(self) -> list[dict[str, int]]:
        return [{"engine": i, "in_flight": e.in_flight, "routed": e.routed, "routed_by_prefix": e.routed_by_prefix}
                for i, e in enumerate(self.engines)]
