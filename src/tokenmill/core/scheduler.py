"""Continuous batching with chunked prefill under a token budget.

Each step:
  1. running requests, oldest first, get the tokens they need to catch up (a decode needs one);
     when the KV cache is full, the newest running request is preempted (blocks freed, put back
     at the front of the waiting queue, recomputed later);
  2. waiting requests fill what is left of the token budget and of max_num_seqs, long prompts
     cut into chunks; a prefix-cache hit starts a request's computed count ahead.
After the forward pass, update_from_output appends sampled tokens, applies stop conditions and
frees the blocks of finished requests in the same step.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []

    # ---- queue management ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort/finish requests from outside (client gone, stop string found by the detokenizer)."""
        done = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            done.append(request)
        return done

    def _free(self, request: Request) -> None:
        self.kv_cache.free(request)
        self.requests.pop(request.request_id, None)
        self._finished_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []

        budget = self._schedule_running(scheduled, output, budget)
        if not output.preempted_ids:
            # Admitting new work right after a preemption would only cause another one.
            self._schedule_waiting(scheduled, budget)

        # Decodes first, prefill chunks after (the attention backend groups them that way).
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        output.scheduled = scheduled
        now = time.monotonic()
        for item in scheduled:
            if item.request.first_scheduled_time is None:
                item.request.first_scheduled_time = now
            # The tokens count as computed from now on; their KV is written by this step's forward pass.
            item.request.num_computed_tokens += item.num_new_tokens
        return output

    def _schedule_running(self, scheduled: list[ScheduledRequest], output: SchedulerOutput,
                          budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            start = request.num_computed_tokens
            while self.kv_cache.allocate_slots(request, num_new) is None:
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                output.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, start, num_new, self.kv_cache.block_ids(request.request_id)))
                budget -= num_new
                index += 1
                continue
            break  # the request itself was preempted: everything after it is gone too
        # A preemption may have removed requests already scheduled in this loop.
        live = {id(r) for r in self.running}
        scheduled[:] = [s for s in scheduled if id(s.request) in live]
        return budget

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.sampling_params.prompt_logprobs is None:
                hits, num_cached = self.kv_cache.get_computed_blocks(request)
            else:  # every prompt position must be computed to be scored
                hits, num_cached = [], 0
            num_new = request.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if self.kv_cache.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.popleft()
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_cached, num_new, self.kv_cache.block_ids(request.request_id)))
            budget -= num_new

    # ---- results -------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append sampled tokens and apply stop conditions; returns requests that finished."""
        finished = []
        for item in output.scheduled:
            request = item.request
            token = sampled.get(request.request_id)
            if token is None or request.is_finished:
                continue
            request.append_output_token(token)
            status = self._check_stop(request, token)
            if status is not None:
                request.status = status
                self.running.remove(request)
                self._free(request)
                finished.append(request)
        return finished

    def _check_stop(self, request: Request, token: int) -> Optional[RequestStatus]:
        params = request.sampling_params
        num_out = request.num_output_tokens
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token == request.eos_token_id:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_out >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def get_stats(self) -> SchedulerStats:
        stats = self.kv_cache.prefix_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
        )
