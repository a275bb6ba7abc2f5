"""The frontend's side of outputs: engine-core token deltas -> RequestOutputs.

Runs where the requests arrived (the API process, or the offline LLM's), never in the engine core:
incremental detokenization, stop strings (a match is reported back so the core stops the
sequence), logprobs assembly, n > 1 samples gathered under their request, request metrics and the
iteration statistics the stat loggers record. Per token the work is constant: token ids and
logprobs are appended, text is decoded over a small window, and a DELTA output carries only what
is new; the whole text is joined once, when a FINAL_ONLY (or CUMULATIVE) output needs it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.messages import EngineCoreOutput
from tokenmill.metrics.stats import FinishedRequestStats, IterationStats
from tokenmill.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class SequenceState:
    index: int
    core_id: str
    detokenizer: Optional[IncrementalDetokenizer]
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    last_token_time: Optional[float] = None
    # Where the last DELTA output ended (token_ids / logprobs indices); -1: nothing new to report.
    num_reported: int = 0
    reported_finish: bool = False
    num_spec_accepted_tokens: int = 0  # the core's running count for this sequence


@dataclass
class RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: Optional[PromptLogprobs] = None
    parent_core_id: Optional[str] = None  # n > 1: the core request computing the shared prompt
    # Set by the async frontend: where this request's outputs go.
    queue: Any = None
    # The core refused or could not serve the request.
    error: Optional[str] = None
    # Monotonic times, for the async frontend's request timeout and stall watchdog.
    added_time: float = field(default_factory=time.monotonic)
    last_output_time: Optional[float] = None
    tenant: Optional[str] = None  # who the request is for (the fair policy's tenant), for per-tenant metrics

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finish_reason is not None for s in self.sequences)

    @property
    def core_ids(self) -> list[str]:
        ids = [seq.core_id for seq in self.sequences]
        return ids + [self.parent_core_id] if self.parent_core_id is not None else ids


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, RequestState] = {}
        self._by_core_id: dict[str, tuple[RequestState, Optional[SequenceState]]] = {}
        self.iteration = IterationStats()

    # ---- registration --------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams, core_ids: list[str], parent_core_id: Optional[str],
                    arrival_time: float, queue: Any = None, tenant: Optional[str] = None) -> RequestState:
        state = RequestState(request_id, prompt, prompt_token_ids, params, [], RequestMetrics(arrival_time),
                             parent_core_id=parent_core_id, queue=queue, tenant=tenant)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_token_ids)
        for index, core_id in enumerate(core_ids):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) if params.detokenize else None
            seq = SequenceState(index, core_id, detok, logprobs=[] if params.logprobs is not None else None,
                                cumulative_logprob=0.0 if params.logprobs is not None else None)
            state.sequences.append(seq)
            self._by_core_id[core_id] = (state, seq)
        if parent_core_id is not None:
            self._by_core_id[parent_core_id] = (state, None)
        self.requests[request_id] = state
        return state

    def remove_request(self, request_id: str, aborted: bool = True) -> Optional[RequestState]:
        """Forget a request (finished, or aborted by its client); returns its state."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for core_id in state.core_ids:
            self._by_core_id.pop(core_id, None)
        if aborted:
            self.iteration.finished.append(self._finished_stats(state, "abort"))
        return state

    # ---- outputs -------------------------------------------------------------------------
    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[tuple[RequestState, RequestOutput]],
                                                                         list[str]]:
        """Fold one step's core outputs in. Returns (request, output) pairs to deliver, and the core ids
        whose detokenizer found a stop string (the core must stop them)."""
        changed: dict[str, RequestState] = {}
        stopped: list[str] = []
        now = time.monotonic()
        for out in outputs:
            entry = self._by_core_id.get(out.request_id)
            if entry is None:
                continue
            state, seq = entry
            state.last_output_time = now
            if out.error is not None:
                state.error = out.error
            elif self._apply(state, seq, out, now):
                stopped.append(seq.core_id)
            changed[state.request_id] = state
        delivered = []
        for state in changed.values():
            output = self._make_output(state)
            if output is not None:
                delivered.append((state, output))
            if state.finished:
                self.remove_request(state.request_id, aborted=False)
                if state.error is None:
                    self.iteration.finished.append(self._finished_stats(state))
        return delivered, stopped

    def take_iteration_stats(self) -> IterationStats:
        iteration, self.iteration = self.iteration, IterationStats()
        return iteration

    def _apply(self, state: RequestState, seq: Optional[SequenceState], out: EngineCoreOutput, now: float) -> bool:
        """Fold one core output into the sequence; True when a stop string ended it."""
        metrics = state.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = out.first_scheduled_time
        metrics.num_cached_tokens = max(metrics.num_cached_tokens, out.num_cached_tokens)
        metrics.num_preemptions = max(metrics.num_preemptions, out.num_preemptions)
        if seq is not None and out.num_spec_accepted_tokens > seq.num_spec_accepted_tokens:
            metrics.num_spec_accepted_tokens += out.num_spec_accepted_tokens - seq.num_spec_accepted_tokens
            seq.num_spec_accepted_tokens = out.num_spec_accepted_tokens
        if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
            start, entries = out.prompt_logprobs
            state.prompt_logprobs[start:start + len(entries)] = entries
        if seq is None:  # the n > 1 prompt parent reports only prompt logprobs
            return False
        if out.finish_reason is not None and not out.new_token_ids and seq.finish_reason is None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason  # e.g. queue timeout
            if seq.detokenizer is not None:
                seq.detokenizer.update([], True)
            if state.finished:
                metrics.finished_time = now
            return False
        if not out.new_token_ids or seq.finish_reason is not None:
            return False
        iteration = self.iteration
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            iteration.ttfts.append(now - metrics.arrival_time)
            iteration.num_prompt_tokens += len(state.prompt_token_ids)
        elif seq.last_token_time is not None:
            iteration.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = now
        metrics.last_token_time = now
        iteration.num_generation_tokens += len(out.new_token_ids)
        seq.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and seq.logprobs is not None:
            for token, entry in zip(out.new_token_ids, out.new_logprobs):
                seq.logprobs.append(entry)
                seq.cumulative_logprob += entry[token].logprob
        stop_string = None
        if seq.detokenizer is not None:
            text_ids = out.new_token_ids
            params = state.params
            if out.finish_reason == "stop" and not params.include_stop_str_in_output and text_ids and (
                    text_ids[-1] in self.eos_token_ids or text_ids[-1] in (params.stop_token_ids or ())):
                # The EOS / stop token ends the text without joining it (as vLLM). A sequence whose
                # grammar completed stops on an ordinary token, which stays.
                text_ids = text_ids[:-1]
            stop_string = seq.detokenizer.update(text_ids, out.finish_reason is not None)
        if stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_string
        elif out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        if seq.finish_reason is not None and state.finished:
            metrics.finished_time = now
        return stop_string is not None and out.finish_reason is None

    def _make_output(self, state: RequestState) -> Optional[RequestOutput]:
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        if kind == RequestOutputKind.DELTA:
            outputs = [self._delta(seq) for seq in state.sequences]
            outputs = [o for o in outputs if o is not None]
        else:
            outputs = [self._cumulative(seq) for seq in state.sequences]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            prompt_logprobs=list(state.prompt_logprobs) if state.prompt_logprobs is not None else None,
            metrics=state.metrics,
            num_cached_tokens=state.metrics.num_cached_tokens,
        )

    @staticmethod
    def _cumulative(seq: SequenceState) -> CompletionOutput:
        return CompletionOutput(
            index=seq.index,
            text=seq.detokenizer.output_text if seq.detokenizer is not None else "",
            token_ids=list(seq.token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    @staticmethod
    def _delta(seq: SequenceState) -> Optional[CompletionOutput]:
        start = seq.num_reported
        text = seq.detokenizer.get_delta() if seq.detokenizer is not None else ""
        newly_finished = seq.finish_reason is not None and not seq.reported_finish
        if start == len(seq.token_ids) and not text and not newly_finished:
            return None
        seq.num_reported = len(seq.token_ids)
        seq.reported_finish = seq.finish_reason is not None
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=seq.token_ids[start:],
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs[start:] if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    # ---- statistics ----------------------------------------------------------------------
    def _finished_stats(self, state: RequestState, reason: Optional[str] = None) -> FinishedRequestStats:
        m = state.metrics
        end = m.finished_time or time.monotonic()
        scheduled = m.first_scheduled_time if m.first_scheduled_time is not None else end
        first = m.first_token_time
        num_generated = sum(len(seq.token_ids) for seq in state.sequences)
        decode_time = (m.last_token_time - first) if first is not None and m.last_token_time else 0.0
        longest = max((len(seq.token_ids) for seq in state.sequences), default=0)
        reasons = [seq.finish_reason for seq in state.sequences if seq.finish_reason]
        return FinishedRequestStats(
            finish_reason=reason or (reasons[0] if reasons else "abort"),
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=num_generated,
            e2e_latency=end - m.arrival_time,
            queue_time=scheduled - m.arrival_time,
            prefill_time=(first - scheduled) if first is not None else 0.0,
            decode_time=decode_time,
            ttft=(first - m.arrival_time) if first is not None else None,
            tpot=decode_time / (longest - 1) if longest > 1 else None,
            num_preemptions=m.num_preemptions,
            num_cached_tokens=m.num_cached_tokens,
            tenant=state.tenant,
        )
