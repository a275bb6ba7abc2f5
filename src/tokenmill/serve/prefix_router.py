"""A Ray Serve request router that sends a prompt to the engine replica holding its prefix.

Ray Serve calls `choose_replicas` in the process that holds the handle (tokenmill's front
deployment) for every request to the engine deployment. The request carries its prompt's block hashes
(`routing.RoutedRequest`); `PrefixAffinity` (the policy of `--data-parallel-size`, engine/dp_router.py)
picks the replica believed to hold the longest run of its leading blocks unless that replica has more
requests in flight than the least-loaded one by more than `max_imbalance`, else the least-loaded one.
A replica's load is the number of requests this front has sent it that have not finished yet (counted
here, exact and current, where Ray Serve's own queue-length cache can lag by seconds).

Replicas that come and go (autoscaling, a replica restarted after a failure) need no coordination: a
new replica starts with an empty memory and takes new prefixes while it is the least loaded; a removed
replica's memory is dropped, and its prefixes are then placed as new ones. Each front replica keeps its
own memory and counts, so with several front replicas a prefix may be cached once per front replica
and each balances only its own requests.

Length-aware lanes (the application's `long_prompt_threshold`): the last `long_prompt_replicas`
replicas in replica-id order take the prompts of more tokens than the threshold, the others the rest,
and a long prompt that would queue behind another borrows a short-lane replica carrying none
(`dp_router.length_lane`, as `--data-parallel-long-prompt-threshold` does for engine cores).

This module is pickled by value into the front's process by Ray Serve; it imports Ray, so only the
optional `ray` extra needs it.
"""
from __future__ import annotations

from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from tokenmill.engine.dp_router import PrefixAffinity, length_lane
from tokenmill.serve.routing import RoutedRequest

# Until a request tells the router the replicas' KV cache size, remember up to this many blocks each.
DEFAULT_CAPACITY_BLOCKS = 1 << 16


def _unique_id(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


def _routed(pending_request: Optional[PendingRequest]) -> Optional[RoutedRequest]:
    if pending_request is None:
        return None
    for arg in list(pending_request.args) + list(pending_request.kwargs.values()):
        if isinstance(arg, RoutedRequest):
            return arg
    return None


class PrefixAwareRequestRouter(RequestRouter):
    """Out-of-order routing (each request gets the replica chosen for it, not the oldest waiting one's)."""

    def initialize_state(self, max_imbalance: int = 4, long_prompt_threshold: Optional[int] = None,
                         long_prompt_replicas: int = 1, long_prompt_borrowing: bool = True, **_: Any) -> None:
        # Requests arrive with their block hashes computed (by the front, which knows the block size).
        self.affinity: PrefixAffinity[ReplicaID] = PrefixAffinity(1, DEFAULT_CAPACITY_BLOCKS, max_imbalance)
        # Requests this front has sent each replica and not yet seen finish.
        self.in_flight: dict[ReplicaID, int] = {}
        self.long_prompt_threshold = long_prompt_threshold
        self.long_prompt_replicas = long_prompt_replicas if long_prompt_threshold is not None else 0
        self.long_in_flight: dict[ReplicaID, int] = {}  # of those, prompts above the threshold
        self.long_prompt_borrowing = long_prompt_borrowing

    def _is_long(self, routed: Optional[RoutedRequest]) -> bool:
        threshold = self.long_prompt_threshold
        return routed is not None and threshold is not None and routed.num_prompt_tokens > threshold

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        routed = _routed(pending_request)
        if self.long_prompt_replicas:
            # Ray Serve offers every running replica; ordered by id, a replica keeps its lane from one
            # request to the next.
            ordered = sorted((r.replica_id for r in candidate_replicas), key=_unique_id)
            lane = set(length_lane(self._is_long(routed), ordered, self.long_in_flight, self.long_prompt_replicas,
                                   self.long_prompt_borrowing))
            candidate_replicas = [r for r in candidate_replicas if r.replica_id in lane]
        loads = {r.replica_id: self.in_flight.get(r.replica_id, 0) for r in candidate_replicas}
        by_load = sorted(candidate_replicas, key=lambda r: (loads[r.replica_id], r.replica_id.unique_id))
        # A replica with a full queue is left out here; Ray Serve itself turns away a request it
        # cannot take and tries the next rank.
        open_loads = {r.replica_id: loads[r.replica_id] for r in by_load
                      if loads[r.replica_id] < r.max_ongoing_requests}
        if routed is None or not open_loads:
            return [by_load]
        if routed.capacity_blocks is not None:
            self.affinity.capacity_blocks = routed.capacity_blocks
        chosen_id, _ = self.affinity.choose(routed.block_hashes, open_loads)
        chosen = next(r for r in candidate_replicas if r.replica_id == chosen_id)
        return [[chosen], [r for r in by_load if r is not chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        # Ray Serve calls this once the replica has accepted the request (with strict
        # max_ongoing_requests, its default for a handle inside the cluster, as the front's is).
        routed = _routed(pending_request)
        if routed is not None and routed.block_hashes:
            self.affinity.remember(replica_id, routed.block_hashes)
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        is_long = self._is_long(routed)
        if is_long:
            self.long_in_flight[replica_id] = self.long_in_flight.get(replica_id, 0) + 1
        loop = self._event_loop
        # The callback comes on one of Ray's threads; the count changes on the router's loop.
        result.add_done_callback(lambda *_: loop.call_soon_threadsafe(self._finished, replica_id, is_long))

    def _finished(self, replica_id: ReplicaID, is_long: bool = False) -> None:
        if self.in_flight.get(replica_id, 0) > 0:
            self.in_flight[replica_id] -= 1
        if is_long and self.long_in_flight.get(replica_id, 0) > 0:
            self.long_in_flight[replica_id] -= 1

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id for r in replicas}
        for replica_id in [key for key in self.affinity.blocks if key not in current]:
            self.affinity.forget(replica_id)
        for replica_id in [key for key in self.in_flight if key not in current]:
            del self.in_flight[replica_id]
        for replica_id in [key for key in self.long_in_flight if key not in current]:
            del self.long_in_flight[replica_id]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id)
        self.in_flight.pop(replica_id, None)
        self.long_in_flight.pop(replica_id, None)
