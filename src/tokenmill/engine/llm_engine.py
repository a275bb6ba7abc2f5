"""The synchronous engine: input processing, the engine core, detokenization and output assembly.

A request with n > 1 becomes n sequences in the core ("{id}#{i}"); they share the prompt's KV
blocks through the prefix cache. Outputs are cumulative per request.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from tokenmill.config import EngineConfig
from tokenmill.core.request import Request
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.input_processor import InputProcessor, ProcessedPrompt
from tokenmill.engine.messages import EngineCoreOutput
from tokenmill.errors import InvalidRequestError, RequestRejectedError
from tokenmill.metrics.stats import FinishedRequestStats, IterationStats, SchedulerSnapshot, StatLogger
from tokenmill.model.default_model import DEFAULT_MODEL_NAME
from tokenmill.model.loader import load_model_source
from tokenmill.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.llguidance_backend import LLGuidanceBackend

logger = logging.getLogger("tokenmill")


@dataclass
class SequenceState:
    index: int
    core_id: str
    detokenizer: Optional[IncrementalDetokenizer]
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    last_token_time: Optional[float] = None


@dataclass
class RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: Optional[PromptLogprobs] = None
    parent_core_id: Optional[str] = None  # n > 1: the request computing the shared prompt

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


def eos_token_ids(tokenizer, hf_config) -> list[int]:
    ids: list[int] = []
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(hf_config, "eos_token_id", None)):
        for token in source if isinstance(source, (list, tuple)) else [source]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return ids


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = load_model_source(config.model, config.tokenizer)
        self.tokenizer = source.tokenizer
        self.hf_config = source.hf_config
        self.served_model_name = config.served_model_name or (
            DEFAULT_MODEL_NAME if config.model is None else source.served_model_name)
        self.core = EngineCore(config, source)
        self.max_model_len = self.core.max_model_len
        vocab_size = self.hf_config.vocab_size
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, vocab_size,
                                              config.max_prompt_tokens)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.hf_config)
        # Structured outputs: grammars compiled against the tokenizer, masks sized to the model's logits.
        self.structured_backend = LLGuidanceBackend(self.tokenizer, vocab_size, self.eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        self.num_rejected: dict[str, int] = {}  # reason -> count, for metrics
        self.core_to_request: dict[str, tuple[RequestState, Optional[SequenceState]]] = {}
        # Stat loggers (Prometheus, log line, dashboard window) see every step.
        self.stat_loggers: list[StatLogger] = []
        self._iteration = IterationStats()

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, *,
                    priority: int = 0, user: Optional[str] = None, arrival_time: Optional[float] = None) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        limit = self.config.max_num_queued_requests
        if limit is not None and len(self.core.scheduler.waiting) >= limit:
            self.num_rejected["queue_full"] = self.num_rejected.get("queue_full", 0) + 1
            raise RequestRejectedError(f"the server is busy: {limit} requests are already queued; retry later",
                                       retry_after_s=1.0, code="queue_full")
        params = self.input_processor.validate_lengths(prompt.prompt_token_ids, params)
        # Extra EOS ids of the model (e.g. Llama 3's <|eot_id|>) stop generation like EOS does.
        primary_eos = self.eos_token_ids[0] if self.eos_token_ids else None
        if len(self.eos_token_ids) > 1 and not params.ignore_eos:
            extra = [t for t in self.eos_token_ids[1:] if t not in (params.stop_token_ids or [])]
            params = params.clone(stop_token_ids=list(params.stop_token_ids or []) + extra)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        state = RequestState(request_id, prompt.prompt, prompt.prompt_token_ids, params, [],
                             RequestMetrics(arrival_time=arrival))
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt.prompt_token_ids)
        # One grammar state per sample, compiled before anything is registered so a bad grammar fails alone.
        grammars = [self.structured_backend.compile(params.structured_outputs) for _ in range(params.n)] \
            if params.structured_outputs is not None else None
        children = []
        for index in range(params.n):
            core_id = request_id if params.n == 1 else f"{request_id}#{index}"
            # Samples of one request get distinct seeds so they differ, yet stay reproducible.
            seq_params = params if params.seed is None or index == 0 else params.clone(seed=params.seed + index)
            detok = IncrementalDetokenizer(self.tokenizer, prompt.prompt_token_ids, seq_params) \
                if params.detokenize else None
            seq = SequenceState(index, core_id, detok,
                                logprobs=[] if params.logprobs is not None else None,
                                cumulative_logprob=0.0 if params.logprobs is not None else None)
            state.sequences.append(seq)
            self.core_to_request[core_id] = (state, seq)
            children.append(Request(core_id, list(prompt.prompt_token_ids), seq_params, primary_eos,
                                    arrival_time=arrival, priority=priority, user=user,
                                    structured_output=grammars[index] if grammars else None))
        if params.n == 1:
            self.core.add_request(children[0])
        else:
            # The prompt is computed once by a parent; the n samples fork from it and share its
            # blocks, copying the partially filled last block when they diverge.
            parent_id = f"{request_id}#prompt"
            state.parent_core_id = parent_id
            self.core_to_request[parent_id] = (state, None)
            self.core.add_request(Request(parent_id, list(prompt.prompt_token_ids), params, primary_eos,
                                          arrival_time=arrival, priority=priority, user=user,
                                          fork_children=children))
        self.requests[request_id] = state

    def abort_request(self, request_ids: list[str] | str) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        core_ids = []
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            if self.stat_loggers:
                self._iteration.finished.append(self._finished_stats(state, "abort"))
            for seq in state.sequences:
                core_ids.append(seq.core_id)
                self.core_to_request.pop(seq.core_id, None)
            if state.parent_core_id is not None:
                core_ids.append(state.parent_core_id)
                self.core_to_request.pop(state.parent_core_id, None)
        self.core.abort_requests(core_ids)
        if not self.requests:
            # An idle engine takes no further step, so report the abort and the freed blocks now
            # (otherwise the gauges would show the aborted request running until the next request).
            self._record_stats()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        changed: dict[str, RequestState] = {}
        stopped: list[str] = []
        for out in self.core.step():
            entry = self.core_to_request.get(out.request_id)
            if entry is None:
                continue
            state, seq = entry
            if self._apply(state, seq, out):
                stopped.append(seq.core_id)
            changed[state.request_id] = state
        if stopped:
            self.core.finish_requests(stopped)
        results = []
        for state in changed.values():
            results.append(self._make_output(state))
            if state.finished:
                self._iteration.finished.append(self._finished_stats(state))
                self.requests.pop(state.request_id, None)
                for seq in state.sequences:
                    self.core_to_request.pop(seq.core_id, None)
                self.core_to_request.pop(state.parent_core_id, None)
        self._record_stats()
        return results

    # ---- statistics ----------------------------------------------------------------------
    def _record_stats(self) -> None:
        iteration, self._iteration = self._iteration, IterationStats()
        if not self.stat_loggers:
            return
        iteration.timestamp = time.time()  # when the step ended, not when the (possibly idle) step began
        stats = self.core.get_stats()
        snapshot = SchedulerSnapshot(
            num_running=stats.num_running, num_waiting=stats.num_waiting, num_swapped=stats.num_swapped,
            kv_cache_usage=stats.kv_cache_usage,
            num_preemptions=stats.num_preemptions, prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits, num_cached_blocks=stats.num_cached_blocks,
            num_evictions=stats.num_evictions, spec_num_draft_tokens=stats.spec_num_draft_tokens,
            spec_num_accepted_tokens=stats.spec_num_accepted_tokens)
        for stat_logger in self.stat_loggers:
            stat_logger.record(snapshot, iteration)

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
        )

    def _apply(self, state: RequestState, seq: SequenceState, out: EngineCoreOutput) -> bool:
        """Fold one core output into the sequence; True when a stop string ended it."""
        now = time.monotonic()
        metrics = state.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = out.first_scheduled_time
        metrics.num_cached_tokens = max(metrics.num_cached_tokens, out.num_cached_tokens)
        metrics.num_preemptions = max(metrics.num_preemptions, out.num_preemptions)
        if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
            start, entries = out.prompt_logprobs
            state.prompt_logprobs[start:start + len(entries)] = entries
        if seq is None:  # the n > 1 prompt parent reports only prompt logprobs
            return False
        if out.finish_reason is not None and not out.new_token_ids and seq.finish_reason is None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason  # e.g. queue timeout
            if state.finished:
                metrics.finished_time = now
            return False
        if not out.new_token_ids or seq.finish_reason is not None:
            return False
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            self._iteration.ttfts.append(now - metrics.arrival_time)
            self._iteration.num_prompt_tokens += len(state.prompt_token_ids)
        elif seq.last_token_time is not None:
            self._iteration.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = now
        metrics.last_token_time = now
        self._iteration.num_generation_tokens += len(out.new_token_ids)
        seq.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and seq.logprobs is not None:
            for token, entry in zip(out.new_token_ids, out.new_logprobs):
                seq.logprobs.append(entry)
                seq.cumulative_logprob += entry[token].logprob
        stop_string = None
        if seq.detokenizer is not None:
            text_ids = out.new_token_ids
            if out.finish_reason == "stop" and not state.params.include_stop_str_in_output and text_ids and (
                    text_ids[-1] in self.eos_token_ids or text_ids[-1] in (state.params.stop_token_ids or ())):
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

    def _make_output(self, state: RequestState) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.output_text if seq.detokenizer is not None else "",
                token_ids=list(seq.token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in state.sequences
        ]
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
