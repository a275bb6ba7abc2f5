"""Data parallelism: which engine core serves a request.

With `--data-parallel-size N` one API server drives N engine cores, each with its own KV cache. A
prompt's prefix-cache hits happen only on a core that computed the same prefix before, so the router
remembers, per core, the block hashes of the prompts it sent there (chained SHA-256 of full blocks,
exactly as the prefix cache hashes them) and sends a request to the core holding the longest run of
its leading blocks — unless that core carries more requests than the least-loaded one by more than
`max_imbalance`, in which case (and when no core holds any of its blocks) the least-loaded core
takes it. Each core's memory of hashes is an LRU bounded by that core's KV block count, so the
router forgets prefixes the core itself would have evicted first. That policy is `PrefixAffinity`,
keyed by any replica name, which the Ray Serve router (tokenmill.serve) shares.

`round_robin` ignores prefixes (the baseline a benchmark compares against).

Length-aware lanes (`--data-parallel-long-prompt-threshold T`): prompts of more than T tokens go to the last
core, shorter ones to the others, and each policy chooses within the lane. A 3,000-token prefill then
shares steps only with other long prompts, and the short requests' first tokens never wait behind a
queue of them. The long lane lends nothing, but borrows: a long prompt that would queue behind another
in its own lane goes to a short-lane core carrying no long prompt, if there is one (unless
`--no-data-parallel-long-prompt-borrowing`). A short request
then waits behind at most one long prompt, and the short lane's cores do not idle while long prompts
queue (with two cores and long prompts holding most of the work, the strict lanes left one core idle
for most of a run).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, Hashable, Mapping, Optional, Sequence, TypeVar

from tokenmill.config import DATA_PARALLEL_ROUTING as ROUTING_POLICIES
from tokenmill.core.kv_cache_manager import hash_block_tokens
from tokenmill.core.kv_tier import TierView

Key = TypeVar("Key", bound=Hashable)


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as the prefix cache computes them (salt: the request's
    Request.cache_salt, its LoRA adapter's)."""
    hashes: list[bytes] = []
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, prompt_token_ids[start:start + block_size],
                                        b"" if hashes else salt))
    return hashes


class PrefixAffinity(Generic[Key]):
    """Which replica probably holds a prompt's prefix in its KV cache, from the prompts sent to each.

    The policy behind `--data-parallel-size` and behind the Ray Serve router (tokenmill.serve), keyed by
    whatever names a replica there (a core index, a Ray replica id). Replicas may come and go: a key
    unseen so far starts with an empty memory, `forget` drops a departed one's.
    """

    def __init__(self, block_size: int, capacity_blocks: int, max_imbalance: int = 4) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.max_imbalance = max_imbalance
        # Per replica, the block hashes it is believed to hold, least recently routed first.
        self.blocks: dict[Key, "OrderedDict[bytes, None]"] = {}

    def block_hashes(self, prompt_token_ids: Sequence[int], salt: bytes = b"") -> list[bytes]:
        return prompt_block_hashes(prompt_token_ids, self.block_size, salt)

    def matched_blocks(self, key: Key, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the prompt the replica is believed to hold."""
        blocks = self.blocks.get(key)
        matched = 0
        if blocks:
            for digest in hashes:
                if digest not in blocks:
                    break
                matched += 1
        return matched

    def choose(self, hashes: Sequence[bytes], loads: Mapping[Key, int], shared_blocks: int = 0) -> tuple[Key, bool]:
        """The replica for a prompt among `loads` (replica -> requests in flight), and whether it was
        picked for its cached prefix (True) or as the least loaded (False). shared_blocks: the prompt's
        leading blocks every replica can read from a tier they share (a replica is preferred only for
        a prefix longer than that)."""
        if not loads:
            raise ValueError("no replica to choose from")
        order = {key: i for i, key in enumerate(loads)}
        # Least loaded: fewest in flight, then the fewest remembered blocks (the most room for a new
        # prefix), so prompts arriving one at a time still spread over the replicas.
        least = min(loads, key=lambda k: (loads[k], len(self.blocks.get(k, ())), order[k]))
        best, best_len = least, 0
        for key in loads:
            matched = self.matched_blocks(key, hashes)
            if matched > best_len or (matched == best_len and matched and loads[key] < loads[best]):
                best, best_len = key, matched
        by_prefix = best_len > shared_blocks and loads[best] - loads[least] <= self.max_imbalance
        return (best if by_prefix else least), by_prefix

    def remember(self, key: Key, hashes: Sequence[bytes]) -> None:
        """The prompt went to `key`: its blocks are now the most recently used there."""
        blocks = self.blocks.setdefault(key, OrderedDict())
        for digest in hashes:
            blocks[digest] = None
            blocks.move_to_end(digest)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

    def forget(self, key: Key) -> None:
        self.blocks.pop(key, None)


def length_lane(is_long: bool, replicas: Sequence[Key], long_in_flight: Mapping[Key, int],
                long_lane_size: int = 1, borrowing: bool = True) -> list[Key]:
    """The replicas a prompt may go to when the last `long_lane_size` of `replicas` are the long prompts'
    lane (no lanes unless some replica is left for short prompts). A long prompt goes to a long-lane
    replica carrying no long prompt; when each carries one, to a short-lane replica carrying none (it
    would otherwise queue behind another long prompt; unless `borrowing` is off); when each of those does
    too, to its own lane."""
    if long_lane_size <= 0 or len(replicas) <= long_lane_size:
        return list(replicas)
    short, long = list(replicas[:-long_lane_size]), list(replicas[-long_lane_size:])
    if not is_long:
        return short
    free = [key for key in long if not long_in_flight.get(key, 0)]
    borrowed = [key for key in short if not long_in_flight.get(key, 0)] if borrowing else []
    return free or borrowed or long


@dataclass
class EngineLoad:
    in_flight: int = 0
    routed: int = 0  # requests sent here
    routed_by_prefix: int = 0  # of those, sent for a cached prefix
    routed_with_tier_prefix: int = 0  # of those, prompts whose prefix the shared KV offload tier holds
    long_in_flight: int = 0  # of the in flight, prompts above the long-prompt threshold


class DataParallelRouter:
    def __init__(self, num_engines: int, block_size: int, capacity_blocks: int, policy: str = "prefix",
                 max_imbalance: int = 4, long_prompt_threshold: Optional[int] = None,
                 long_prompt_borrowing: bool = True, shared_tier: Optional[TierView] = None) -> None:
        """shared_tier: the KV offload tier every core reads (--kv-offload-dir): a prefix found there is
        cheap on any core, so it draws a request to a core only as far as that core holds more of it."""
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}")
        # With two or more cores and a threshold: the last core is the long prompts' lane.
        self.long_prompt_threshold = long_prompt_threshold if num_engines > 1 else None
        self.long_prompt_borrowing = long_prompt_borrowing
        self._next_in_lane: dict[tuple[int, ...], int] = {}  # round robin: each lane's turn
        self._long_requests: set[Hashable] = set()  # the keys of long prompts in flight
        self.engines = [EngineLoad() for _ in range(num_engines)]
        self.affinity: PrefixAffinity[int] = PrefixAffinity(block_size, capacity_blocks, max_imbalance)
        self.policy = policy
        self.shared_tier = shared_tier

    @property
    def block_size(self) -> int:
        return self.affinity.block_size

    def block_hashes(self, prompt_token_ids: Sequence[int], salt: bytes = b"") -> list[bytes]:
        return self.affinity.block_hashes(prompt_token_ids, salt)

    def is_long(self, num_prompt_tokens: int) -> bool:
        return self.long_prompt_threshold is not None and num_prompt_tokens > self.long_prompt_threshold

    def lane(self, num_prompt_tokens: int) -> list[int]:
        """The engine indices a prompt of this length may go to (the last core is the long lane)."""
        indices = list(range(len(self.engines)))
        if self.long_prompt_threshold is None:
            return indices
        return length_lane(self.is_long(num_prompt_tokens), indices,
                           {i: e.long_in_flight for i, e in enumerate(self.engines)},
                           borrowing=self.long_prompt_borrowing)

    def choose(self, prompt_token_ids: Sequence[int], key: Optional[Hashable] = None, salt: bytes = b"") -> int:
        """The engine index for a new request (counted as in flight there until `finished`). key: the
        request's, to count it among the long prompts in flight until `finished(index, key)`; salt: its
        prefix-cache salt (its LoRA adapter's)."""
        lane = self.lane(len(prompt_token_ids))
        is_long = self.is_long(len(prompt_token_ids))
        if self.policy == "round_robin":
            turn = self._next_in_lane.get(tuple(lane), 0)
            index = lane[turn % len(lane)]
            self._next_in_lane[tuple(lane)] = turn + 1
            hashes: list[bytes] = []
            by_prefix = False
        else:
            hashes = self.affinity.block_hashes(prompt_token_ids, salt)
            shared = self.shared_tier.leading_blocks(hashes) if self.shared_tier is not None else 0
            index, by_prefix = self.affinity.choose(hashes, {i: self.engines[i].in_flight for i in lane}, shared)
            self.engines[index].routed_with_tier_prefix += shared > 0
        self._assign(index, hashes, by_prefix)
        if is_long and key is not None:
            self._long_requests.add(key)
            self.engines[index].long_in_flight += 1
        return index

    def _assign(self, index: int, hashes: list[bytes], by_prefix: bool) -> None:
        engine = self.engines[index]
        engine.in_flight += 1
        engine.routed += 1
        engine.routed_by_prefix += by_prefix
        self.affinity.remember(index, hashes)

    def finished(self, index: int, key: Optional[Hashable] = None) -> None:
        self.engines[index].in_flight -= 1
        if key is not None and key in self._long_requests:
            self._long_requests.discard(key)
            self.engines[index].long_in_flight -= 1

    def stats(self) -> list[dict[str, int]]:
        return [{"engine": i, "in_flight": e.in_flight, "routed": e.routed, "routed_by_prefix": e.routed_by_prefix,
                 "routed_with_tier_prefix": e.routed_with_tier_prefix} for i, e in enumerate(self.engines)]
