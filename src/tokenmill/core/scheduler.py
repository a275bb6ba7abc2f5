"""Continuous batching with chunked prefill under a token budget.

Each step:
  1. running requests, in policy order, get the tokens they need to catch up (a decode needs
     one); when the KV cache is full, the policy picks a victim to preempt (blocks freed, put
     back in the waiting queue, recomputed later) among the requests ranked below the one that
     needs room, or that request itself; a request preempted `max_preemptions` times is spared
     while any other victim remains, so preemption cannot thrash;
  2. waiting requests, in policy order, fill what is left of the token budget and of
     max_num_seqs; long prompts are cut into chunks, and prompts longer than
     long_prefill_token_threshold are capped per step (at most max_long_partial_prefills of them
     at once) so decodes and short prompts keep flowing; a prefix-cache hit starts a request's
     computed count ahead.
After the forward pass, update_from_output appends sampled tokens, applies stop conditions and
frees the blocks of finished requests in the same step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.policy import SchedulingPolicy, make_policy
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from tokenmill.core.scheduler_stats import SchedulerStats, lora_counts, tier_stats

QUEUE_TIMEOUT = "queue_timeout"
# stop_reason of a request refused at admission because max_num_queued_requests were waiting.
QUEUE_FULL = "queue_full"


@dataclass(slots=True)
class _Item:
    """A request picked for this step, before it is described to the runner."""

    request: Request
    start_position: int
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    draft_tokens: int = 0  # a draft model's proposals after this step (their slots are allocated)


class Scheduler:
    def __init__(self, config: EngineConfig, max_model_len: int, kv_cache: KVCacheManager,
                 policy: Optional[SchedulingPolicy] = None) -> None:
        """config: the engine's options under the names the user typed, with the device defaults resolved
        (EngineConfig.with_resolved_defaults: a step budget and a preemption mode); max_model_len: the
        engine's effective limit (the model's, capped by what the KV cache holds for one request)."""
        if config.max_num_batched_tokens is None or config.preemption_mode is None:
            raise ValueError("the scheduler needs max_num_batched_tokens and preemption_mode resolved: "
                             "pass EngineConfig.with_resolved_defaults(device_type, max_model_len)")
        self.config = config
        self.max_model_len = max_model_len
        self.kv_cache = kv_cache
        self.policy = policy or make_policy(config.scheduling_policy, config.lpm_max_wait)
        self.waiting: list[Request] = []  # preempted requests are put back at the front
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # swapped out, resumed first-in first-out before new work
        self._swapped_in_now: set[str] = set()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_queue_timeouts = 0
        self.num_draft_tokens = 0  # speculative decoding: drafts verified, and how many were kept
        self.num_accepted_tokens = 0
        self.num_drafts = 0
        self.accepted_per_position: list[int] = []
        self._finished_ids: list[str] = []
        # Requests finished inside schedule() (queue timeouts), reported by the next update.
        self._timed_out: list[Request] = []
        # What the model runner holds: request id -> how many of its block ids it has been sent.
        # A request missing here is described in full (NewRequestData) when it is next scheduled.
        self._runner_blocks: dict[str, int] = {}
        # The requests behind the last schedule()'s items, for update_from_output.
        self._step_requests: dict[str, Request] = {}
        # Prompt tokens the step being scheduled may still take (max_mixed_prefill_tokens when it decodes).
        self._prefill_left = config.max_num_batched_tokens
        # Speculative decoding with a draft model: no drafting in a step with more running requests than this
        # (set by the engine core from the speculative config; None: no limit).
        self.draft_batch_limit: Optional[int] = None

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
            elif request.status == RequestStatus.SWAPPED:
                self.swapped.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            done.append(request)
        return done

    def _free(self, request: Request) -> None:
        ttl = getattr(request.sampling_params, "cache_ttl_s", None)
        if ttl:
            self.kv_cache.pin_prompt(request, ttl, time.monotonic())
        self.kv_cache.free(request)
        self.requests.pop(request.request_id, None)
        self._forget(request)

    def _forget(self, request: Request) -> None:
        """The runner drops its state for the request at the next step."""
        if self._runner_blocks.pop(request.request_id, None) is not None:
            self._finished_ids.append(request.request_id)

    def step_request(self, request_id: str) -> Optional[Request]:
        """The request behind an item of the last schedule() (finished ones included)."""
        return self._step_requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._timed_out)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.kv_cache.pins:
            self.kv_cache.expire_pins(time.monotonic())
        self._fork_ready_parents()
        self._expire_waiting()
        self.policy.begin_step(self.running, self.waiting)
        output = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        scheduled: list[_Item] = []

        self._swap_in()
        self.running.sort(key=self.policy.rank)
        self._prefill_left = budget
        # Without chunked prefill a prompt runs whole or waits, so the cap would only hold it back.
        if self.config.max_mixed_prefill_tokens is not None and self.config.enable_chunked_prefill and any(
                r.num_tokens_to_compute - r.num_computed_tokens == 1 for r in self.running):
            self._prefill_left = self.config.max_mixed_prefill_tokens
        budget = self._schedule_running(scheduled, output, budget)
        if not output.preempted_ids and not self.swapped:
            # Admitting new work right after a preemption (or before swapped requests are back)
            # would only cause another one.
            self._schedule_waiting(scheduled, output, budget)

        if not scheduled and not self.running:
            self.kv_cache.wait_for_reads()  # only tier reads are left to wait for, if anything
        output.block_copies = self.kv_cache.take_pending_copies()
        output.swap_out, output.swap_in = self.kv_cache.take_pending_swaps()
        output.kv_loads, output.kv_stores = self.kv_cache.take_pending_tier_io()
        rewritten = self.kv_cache.take_rewritten_tables()
        if self.draft_batch_limit is not None and len(self.running) > self.draft_batch_limit:
            for item in scheduled:  # the step's batch is too large for drafts to pay: the draft model rests
                item.request.draft_behind |= item.draft_tokens > 0
                item.draft_tokens = 0
        now = time.monotonic()
        self._step_requests = {}
        for item in scheduled:
            request = item.request
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            output.scheduled.append(self._describe(item, output, rewritten))
            self._step_requests[request.request_id] = request
            # The tokens count as computed from now on; their KV is written by this step's forward pass.
            request.num_computed_tokens += item.num_new_tokens
        return output

    def _describe(self, item: "_Item", output: SchedulerOutput, rewritten: set[str]) -> ScheduledRequest:
        """The step's message for one request: its full description the first time the runner sees it
        (or after its block table was rewritten), then only what changed."""
        request = item.request
        rid = request.request_id
        if rid in rewritten:
            self._runner_blocks.pop(rid, None)
        num_sent = self._runner_blocks.get(rid)
        if num_sent is None:
            num_sent = 0
            output.new_requests.append(NewRequestData(
                request_id=rid, prompt_token_ids=request.prompt_token_ids, sampling_params=request.sampling_params,
                eos_token_id=request.eos_token_id, output_token_ids=list(request.output_token_ids),
                lora=request.lora))
        new_blocks = self.kv_cache.block_ids_from(rid, num_sent)
        more_groups = [self.kv_cache.block_ids_from(rid, num_sent, group)
                       for group in range(1, self.kv_cache.num_groups)]
        self._runner_blocks[rid] = num_sent + len(new_blocks)
        start, count, spec = item.start_position, item.num_new_tokens, item.spec_token_ids
        return ScheduledRequest(
            request_id=rid, start_position=start, num_new_tokens=count,
            token_ids=request.all_token_ids[start:start + count - len(spec)], new_block_ids=new_blocks,
            more_group_block_ids=more_groups,
            samples=start + count >= request.num_tokens and request.fork_children is None,
            spec_token_ids=spec, draft_tokens=item.draft_tokens)

    def _fork_ready_parents(self) -> None:
        """n > 1: once a parent's prompt is computed, its samples take over its blocks.
        Beam search parks a beam with an empty children list until it has picked the children."""
        for parent in [r for r in self.running if r.fork_children is not None]:
            if not parent.fork_children or parent.num_computed_tokens < parent.num_tokens_to_compute:
                continue
            index = self.running.index(parent)
            for child in parent.fork_children:
                self.kv_cache.fork(parent, child)
                child.num_computed_tokens = parent.num_computed_tokens
                child.num_cached_tokens = parent.num_cached_tokens
                child.first_scheduled_time = parent.first_scheduled_time
                child.status = RequestStatus.RUNNING
                self.requests[child.request_id] = child
            self.running[index:index + 1] = parent.fork_children
            self.kv_cache.free(parent)
            self.requests.pop(parent.request_id, None)
            self._forget(parent)
            parent.status = RequestStatus.FINISHED_STOPPED

    def _expire_waiting(self) -> None:
        limit = self.config.max_queue_time
        if limit is None:
            return
        now = time.monotonic()
        for request in [r for r in self.waiting if r.first_scheduled_time is None and now - r.arrival_time > limit]:
            self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            request.stop_reason = QUEUE_TIMEOUT
            self.num_queue_timeouts += 1
            self._free(request)
            self._timed_out.append(request)

    def _schedule_running(self, scheduled: list[_Item], output: SchedulerOutput, budget: int) -> int:
        index = 0
        first_waiting: Optional[Request] = None
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            budget, placed = self._schedule_one_running(index, scheduled, output, budget, can_wait=True)
            if placed is not False or request.status == RequestStatus.RUNNING:
                index += 1  # scheduled, nothing to compute, or it waits this step out, keeping its blocks
            if placed is False and request.status == RequestStatus.RUNNING and first_waiting is None:
                first_waiting = request
        if not scheduled and first_waiting is not None and budget > 0:
            # Every request waited on blocks held by requests at the preemption cap, so nothing would free
            # any: the first of them preempts past the cap rather than stall the engine.
            budget, _ = self._schedule_one_running(self.running.index(first_waiting), scheduled, output, budget,
                                                   can_wait=False)
        return budget

    def _schedule_one_running(self, index: int, scheduled: list[_Item], output: SchedulerOutput, budget: int,
                              can_wait: bool) -> tuple[int, Optional[bool]]:
        """Schedule running[index]'s next tokens if they fit (preempting as needed): the budget left and
        whether it was scheduled (None: it has nothing to compute in this step)."""
        request = self.running[index]
        num_new = self._cap_prefill(request, request.num_tokens_to_compute - request.num_computed_tokens, budget)
        if num_new <= 0:
            return budget, None
        spec = self._spec_tokens(request, budget) if num_new == 1 else []
        num_new += len(spec)
        start = request.num_computed_tokens
        lookahead = self._draft_lookahead(request, start + num_new)
        if not self._make_room(index, num_new + lookahead, output, can_wait):
            return budget, False
        scheduled.append(_Item(request, start, num_new, spec, lookahead))
        if not spec and num_new > 1:
            self._prefill_left -= num_new
        return budget - num_new, True

    def _spec_tokens(self, request: Request, budget: int) -> list[int]:
        """The drafts a decode verifies this step: as many as the budget, max_tokens and max_model_len
        leave room for (every accepted draft plus the token sampled after them is output)."""
        if not request.spec_token_ids:
            return []
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)
        spec = request.spec_token_ids[:max(0, room)]
        request.spec_token_ids = []
        return spec

    def _draft_lookahead(self, request: Request, end: int) -> int:
        """A draft model's proposals after a step computing up to `end`: only when the step samples, and
        no further than max_model_len. Their slots are allocated with the step's own (the draft model writes
        its KV there while drafting); they are not in the step's token budget, which counts the target's."""
        if not request.num_draft_lookahead or end < request.num_tokens or request.fork_children is not None:
            return 0
        return max(0, min(request.num_draft_lookahead, self.max_model_len - end))

    def _make_room(self, index: int, num_new: int, output: SchedulerOutput, can_wait: bool) -> bool:
        """Allocate num_new slots for running[index], preempting as needed. False when the request
        was preempted itself or has to wait a step."""
        request = self.running[index]
        while self.kv_cache.allocate_slots(request, num_new) is None:
            if self.kv_cache.release_pins():
                continue  # pins are a cache hint: they give way before any running request does
            victim = self._running_victim(index, can_wait)
            if victim is None:
                return False
            self._preempt(victim, output)
            if victim is request:
                return False
        return True

    def _running_victim(self, index: int, can_wait: bool) -> Optional[Request]:
        """Who gives way to running[index]: a lower-ranked request (the policy picks: lowest class,
        then cheapest recompute), else the request itself; one at the preemption cap is spared while
        any other remains. When only capped ones remain the request may wait (None, with can_wait):
        other work this step finishes and frees blocks, whereas preempting again could thrash."""
        request = self.running[index]
        limit = self.config.max_preemptions

        def spared(r: Request) -> bool:
            return limit is not None and r.num_preemptions >= limit

        lower = self.running[index + 1:]
        uncapped = [r for r in lower if not spared(r)]
        if uncapped:
            return self.policy.pick_victim(uncapped, None)
        if not spared(request):
            return request
        if can_wait:
            return None
        # The whole step would otherwise be empty, so nothing would free blocks: exceed the cap rather than stall.
        return self.policy.pick_victim(lower, None) if lower else request

    def _cap_prefill(self, request: Request, num_new: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold is not None and num_new > threshold:
            num_new = threshold  # long prompts advance at most `threshold` tokens per step
        if num_new > 1:  # a prompt chunk (or a catch-up), not a decode: within the mixed-step cap too
            num_new = min(num_new, max(self._prefill_left, 0))
        return min(num_new, budget)

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        output.preempted_ids.append(request.request_id)
        self._runner_blocks.pop(request.request_id, None)  # its blocks change: described anew when resumed
        if (self.config.preemption_mode == "swap" and request.request_id not in self._swapped_in_now
                and self.kv_cache.can_swap_out(request)):
            # Its KV survives in host memory, so nothing is recomputed when it comes back.
            self.kv_cache.swap_out(request)
            self.num_swap_outs += 1
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            return
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.insert(0, request)

    def _swap_in(self) -> None:
        """Bring swapped requests back, oldest first, while their blocks fit on the device.
        (Their copy back runs at the start of this step, so one of them preempted again in this
        same step is recomputed rather than swapped out of blocks not yet filled.)"""
        self._swapped_in_now = set()
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            # Keep a block of growth for every running request (itself included), or it would be
            # swapped right back out.
            if not self.kv_cache.can_swap_in(request, reserve=len(self.running) + 1):
                break
            self.swapped.pop(0)
            self.kv_cache.swap_in(request)
            self._swapped_in_now.add(request.request_id)
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _schedule_waiting(self, scheduled: list[_Item], output: SchedulerOutput, budget: int) -> None:
        threshold = self.config.long_prefill_token_threshold
        num_long = sum(1 for s in scheduled if threshold is not None and
                       s.request.num_tokens_to_compute - s.start_position > threshold)
        skipped: list[Request] = []
        candidates = list(self.waiting)
        # --max-loras: the adapters of running requests, which a step never exceeds.
        adapters = {r.lora for r in self.running if r.lora is not None}
        while (candidates and budget > 0 and self._prefill_left > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.policy.pick_next(candidates, self.kv_cache.peek_cached_tokens)
            candidates.remove(request)
            if request.lora is not None and request.lora not in adapters:
                if len(adapters) >= self.config.max_loras:
                    continue  # waits until a running adapter's requests are done
            if request.sampling_params.prompt_logprobs is None:
                hits, num_cached = self.kv_cache.get_computed_blocks(request)
                if self.kv_cache.is_reading(request):
                    continue  # its prefix is being read back from the offload tier: it waits a step
            else:  # every prompt position must be computed to be scored
                hits, num_cached = [], 0
            num_cached = min(num_cached, request.num_tokens_to_compute)
            hits = hits[: num_cached // self.kv_cache.block_size]
            remaining = request.num_tokens_to_compute - num_cached
            is_long = threshold is not None and remaining > threshold
            if is_long and num_long >= self.config.max_long_partial_prefills:
                skipped.append(request)  # isolation: let shorter prompts use this step
                continue
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            num_new = self._cap_prefill(request, remaining, budget)
            lookahead = self._draft_lookahead(request, num_cached + num_new)
            allocated = self.kv_cache.allocate_slots(request, num_new + lookahead, hits)
            # With nothing running, no block will come free but from pins: they give way.
            while allocated is None and not self.running and self.kv_cache.release_pins():
                allocated = self.kv_cache.allocate_slots(request, num_new + lookahead, hits)
            if allocated is None:
                self._preempt_for(request, output, scheduled)
                break
            self.waiting.remove(request)
            num_long += is_long
            if request.lora is not None:
                adapters.add(request.lora)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if num_new > 0:
                scheduled.append(_Item(request, num_cached, num_new, draft_tokens=lookahead))
                budget -= num_new
                self._prefill_left -= num_new

    def _preempt_for(self, request: Request, output: SchedulerOutput,
                     scheduled: list[_Item]) -> None:
        """Priority policy: make room for a waiting request by preempting a strictly lower-priority
        running one. The freed blocks are used from the next step on."""
        if not self.policy.preempts_for_waiting or not self.running:
            return
        victim = self.policy.pick_victim(self.running, self.config.max_preemptions)
        limit = self.config.max_preemptions
        if self.policy.victim_class(victim) <= self.policy.victim_class(request) or (
                limit is not None and victim.num_preemptions >= limit):
            return
        self._preempt(victim, output)
        scheduled[:] = [s for s in scheduled if s.request is not victim]

    # ---- results -------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int],
                           forced: Optional[dict[str, list[int]]] = None,
                           accepted: Optional[dict[str, list[int]]] = None) -> list[Request]:
        """Append sampled tokens and apply stop conditions; returns requests that finished.

        `forced`: tokens a request's grammar allows no alternative to after its sampled one (structured
        outputs' fast-forward). They are appended too, each checked like a sampled token, and computed
        with the request's next chunk: a catch-up of more than one token, like a prompt chunk.
        `accepted`: the leading drafts a speculative step verified; they come before the sampled token.
        The KV of rejected drafts is stale, so the computed count steps back over them and the next
        step overwrites their slots.
        """
        finished, self._timed_out = self._timed_out, []
        for item in output.scheduled:
            request = self._step_requests.get(item.request_id)
            if request is None:
                continue
            self.policy.on_tokens(request, item.num_new_tokens)
            token = sampled.get(request.request_id)
            if token is None or request.is_finished:
                continue
            kept: tuple[int, ...] = ()
            if item.spec_token_ids:
                kept = tuple((accepted or {}).get(request.request_id) or ())
                request.num_computed_tokens -= len(item.spec_token_ids) - len(kept)
                self.num_draft_tokens += len(item.spec_token_ids)
                self.num_accepted_tokens += len(kept)
                self.num_drafts += 1
                request.num_spec_accepted_tokens += len(kept)
                if len(self.accepted_per_position) < len(item.spec_token_ids):
                    self.accepted_per_position.extend([0] * (len(item.spec_token_ids)
                                                             - len(self.accepted_per_position)))
                for position in range(len(kept)):
                    self.accepted_per_position[position] += 1
            new_tokens = (*kept, token, *((forced or {}).get(request.request_id) or ()))
            for i, new_token in enumerate(new_tokens):
                request.append_output_token(new_token)
                # The grammar has already seen the whole run, so its end is checked after the last token.
                status = self._check_stop(request, new_token, last_of_run=i == len(new_tokens) - 1)
                if status is not None:
                    request.status = status
                    self.running.remove(request)
                    self._free(request)
                    finished.append(request)
                    break
            if request.park_after_sample and not request.is_finished:
                request.fork_children = []  # beam search: hold the blocks until the next beams are picked
        return finished

    def _check_stop(self, request: Request, token: int, last_of_run: bool = True) -> Optional[RequestStatus]:
        params = request.sampling_params
        num_out = request.num_output_tokens
        if last_of_run and request.structured_output is not None and request.structured_output.is_terminated():
            request.stop_reason = None  # the grammar is complete: nothing more may follow
            return RequestStatus.FINISHED_STOPPED
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token == request.eos_token_id:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_out >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def get_stats(self) -> SchedulerStats:
        stats = self.kv_cache.prefix_stats
        pool = self.kv_cache.pool
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            num_cached_blocks=len(pool.cached),
            num_evictions=pool.num_evictions,
            num_queue_timeouts=self.num_queue_timeouts,
            spec_num_draft_tokens=self.num_draft_tokens,
            spec_num_accepted_tokens=self.num_accepted_tokens,
            spec_num_drafts=self.num_drafts,
            spec_accepted_per_position=list(self.accepted_per_position),
            num_pinned_blocks=len(self.kv_cache.pins),
            num_pins_refused=self.kv_cache.pins.num_refused,
            kv_offload=tier_stats(self.kv_cache),
            lora_running=lora_counts(self.running) if self.config.enable_lora else None,
            lora_waiting=lora_counts(self.waiting) if self.config.enable_lora else None,
        )

