"""Which waiting request runs next, and which running request gives way under memory pressure.

- fcfs: arrival order (preempted requests go back to the front).
- priority: lower `priority` value first (vLLM's convention), then arrival; may preempt
  lower-priority running requests to admit a higher-priority one.
- fair: tenants (the `user` field or API key) share generated tokens by virtual-token counting:
  the next request comes from the tenant that has received the fewest tokens so far.
- lpm: longest cached prefix first (SGLang's longest-prefix-match), so shared prompts run while
  their blocks are still cached; a request that waited longer than `max_wait_s` goes first anyway.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Optional

from tokenmill.config import SCHEDULING_POLICIES
from tokenmill.core.request import Request


class SchedulingPolicy:
    name = "fcfs"
    # Whether a waiting request may preempt running ones that rank below it.
    preempts_for_waiting = False

    def pick_next(self, waiting: list[Request], cached_prefix: Callable[[Request], int]) -> Request:
        """The waiting request to consider next (fcfs: the head of the queue)."""
        return waiting[0]

    def rank(self, request: Request) -> tuple:
        """Sort key: a smaller rank runs first and is preempted last."""
        return (request.arrival_time,)

    def pick_victim(self, running: list[Request], max_preemptions: Optional[int]) -> Request:
        """The running request to preempt: lowest rank first; among equals, the cheapest to
        recompute; a request preempted max_preemptions times is spared while others remain."""
        candidates = [r for r in running if max_preemptions is None or r.num_preemptions < max_preemptions]
        pool = candidates or running
        return max(pool, key=lambda r: (self.victim_class(r), -r.num_computed_tokens, r.arrival_time))

    def victim_class(self, request: Request) -> tuple:
        return ()

    def on_tokens(self, request: Request, num_tokens: int) -> None:
        """Account generated/computed tokens to the request's tenant (fair share)."""

    def begin_step(self, running: list[Request], waiting: list[Request]) -> None:
        """Called at the start of every schedule() with the requests the scheduler holds."""


class FCFSPolicy(SchedulingPolicy):
    pass


class PriorityPolicy(SchedulingPolicy):
    name = "priority"
    preempts_for_waiting = True

    def pick_next(self, waiting, cached_prefix):
        return min(waiting, key=self.rank)

    def rank(self, request):
        return (request.priority, request.arrival_time)

    def victim_class(self, request):
        return (request.priority,)


class FairSharePolicy(SchedulingPolicy):
    """Virtual-token fair queuing between tenants."""

    name = "fair"

    def __init__(self) -> None:
        self.served: dict[str, float] = defaultdict(float)
        # Tenants with a request running or waiting at the last step.
        self.active: set[str] = set()

    @staticmethod
    def tenant(request: Request) -> str:
        return request.user or ""

    def begin_step(self, running, waiting):
        # A tenant that becomes active (new, or back from idle) starts no lower than the least-served
        # tenant that stayed active, so it cannot bank credit while away and then monopolize the
        # engine. With none staying (the engine was idle), the arrivals start level with each other.
        active = {self.tenant(r) for r in running} | {self.tenant(r) for r in waiting}
        arriving, staying = active - self.active, active & self.active
        if arriving:
            floor = min(self.served[t] for t in staying) if staying else max(self.served[t] for t in arriving)
            for tenant in arriving:
                self.served[tenant] = max(self.served[tenant], floor)
        self.active = active

    def pick_next(self, waiting, cached_prefix):
        return min(waiting, key=lambda r: (self.served[self.tenant(r)], r.arrival_time))

    def rank(self, request):
        return (self.served[self.tenant(request)], request.arrival_time)

    def victim_class(self, request):
        return (self.served[self.tenant(request)],)

    def on_tokens(self, request, num_tokens):
        self.served[self.tenant(request)] += num_tokens


class LongestPrefixMatchPolicy(SchedulingPolicy):
    name = "lpm"

    def __init__(self, max_wait_s: float = 5.0) -> None:
        self.max_wait_s = max_wait_s

    def pick_next(self, waiting, cached_prefix):
        now = time.monotonic()
        overdue = [r for r in waiting if now - r.arrival_time > self.max_wait_s]
        if overdue:  # the wait bound beats prefix matching, oldest first
            return min(overdue, key=lambda r: r.arrival_time)
        return max(waiting, key=lambda r: (cached_prefix(r), -r.arrival_time))


def make_policy(name: str, lpm_max_wait: float = 5.0) -> SchedulingPolicy:
    """The policy a --scheduling-policy name (config.SCHEDULING_POLICIES) stands for."""
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy()
    if name == "fair":
        return FairSharePolicy()
    if name == "lpm":
        return LongestPrefixMatchPolicy(lpm_max_wait)
    raise ValueError(f"unknown scheduling policy {name!r} (choose from {', '.join(SCHEDULING_POLICIES)})")
