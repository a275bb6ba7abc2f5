"""The synchronous engine (the offline LLM's): input processing, an in-process engine core, and the
frontend's output processing, stepped by the caller.

A request with n > 1 becomes one core request computing the prompt and n samples forking from it
("{id}#{i}"); they share the prompt's KV blocks.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from tokenmill.config import EngineConfig
from tokenmill.core.scheduler import QUEUE_FULL, QUEUE_TIMEOUT
from tokenmill.engine.core_client import InprocClient
from tokenmill.engine.input_processor import InputProcessor, ProcessedPrompt, eos_token_ids
from tokenmill.engine.messages import EngineCoreAbort, EngineCoreOutputs, EngineCoreRequest, ForkChild
from tokenmill.engine.output_processor import OutputProcessor, RequestState
from tokenmill.errors import InvalidRequestError, RequestRejectedError
from tokenmill.metrics.stats import IterationStats, SchedulerSnapshot, StatLogger
from tokenmill.model.default_model import DEFAULT_MODEL_NAME
from tokenmill.model.loader import load_model_source
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.llguidance_backend import LLGuidanceBackend

logger = logging.getLogger("tokenmill")


def core_request(request_id: str, prompt: ProcessedPrompt, params: SamplingParams, eos_ids: list[int], *,
                 priority: int = 0, user: Optional[str] = None,
                 arrival_time: Optional[float] = None) -> tuple[EngineCoreRequest, SamplingParams, list[str]]:
    """The core's message for a validated request, the parameters the frontend keeps for it, and the
    core ids of its samples."""
    # Extra EOS ids of the model (e.g. Llama 3's <|eot_id|>) stop generation like EOS does.
    if len(eos_ids) > 1 and not params.ignore_eos:
        extra = [t for t in eos_ids[1:] if t not in (params.stop_token_ids or [])]
        if extra:
            params = params.clone(stop_token_ids=list(params.stop_token_ids or []) + extra)
    children = None
    core_ids = [request_id]
    if params.n > 1:
        # Samples of one request get distinct seeds so they differ, yet stay reproducible.
        children = [ForkChild(f"{request_id}#{i}", None if params.seed is None or i == 0 else params.seed + i)
                    for i in range(params.n)]
        core_ids = [child.request_id for child in children]
    message = EngineCoreRequest(
        request_id=f"{request_id}#prompt" if children else request_id,
        prompt_token_ids=prompt.prompt_token_ids, sampling_params=params,
        eos_token_id=eos_ids[0] if eos_ids else None,
        arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        priority=priority, user=user, fork_children=children)
    return message, params, core_ids


def rejection(state: RequestState, max_queue_time: Optional[float]) -> Optional[RequestRejectedError]:
    """The 429 for a request the core refused for load (queue full, waited too long), if it was."""
    reasons = {seq.stop_reason for seq in state.sequences if seq.finish_reason == "abort"}
    if QUEUE_FULL in reasons:
        return RequestRejectedError("the server is busy: too many requests are already queued; retry later",
                                    retry_after_s=1.0, code=QUEUE_FULL)
    if QUEUE_TIMEOUT in reasons:
        return RequestRejectedError(f"the request waited longer than max_queue_time ({max_queue_time} s) without "
                                    "being scheduled; retry later", retry_after_s=1.0, code=QUEUE_TIMEOUT)
    return None


def scheduler_snapshot(outputs: EngineCoreOutputs) -> SchedulerSnapshot:
    stats = outputs.stats
    return SchedulerSnapshot(
        num_running=stats.num_running, num_waiting=stats.num_waiting, num_swapped=stats.num_swapped,
        kv_cache_usage=stats.kv_cache_usage,
        num_preemptions=stats.num_preemptions, prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits, num_cached_blocks=stats.num_cached_blocks,
        num_evictions=stats.num_evictions, spec_num_draft_tokens=stats.spec_num_draft_tokens,
        spec_num_accepted_tokens=stats.spec_num_accepted_tokens, device_memory_bytes=stats.device_memory_bytes)


class LLMEngine:
    def __init__(self, config: EngineConfig, message_roundtrip: bool = False) -> None:
        """message_roundtrip: every message between the frontend, the core and the runner is encoded and
        decoded as a process boundary would (tests)."""
        self.config = config
        source = load_model_source(config.model, config.tokenizer)
        self.tokenizer = source.tokenizer
        self.hf_config = source.hf_config
        self.served_model_name = config.served_model_name or (
            DEFAULT_MODEL_NAME if config.model is None else source.served_model_name)
        self.core = InprocClient(config, source, message_roundtrip)
        self.max_model_len = self.core.ready.max_model_len
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.hf_config)
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, self.hf_config.vocab_size,
                                              config.max_prompt_tokens,
                                              LLGuidanceBackend(self.tokenizer, self.hf_config.vocab_size,
                                                                self.eos_token_ids))
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.num_rejected: dict[str, int] = {}  # reason -> count, for metrics
        # Stat loggers (Prometheus, log line, dashboard window) see every step.
        self.stat_loggers: list[StatLogger] = []

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, *,
                    priority: int = 0, user: Optional[str] = None, arrival_time: Optional[float] = None) -> None:
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        params = self.input_processor.validate(prompt.prompt_token_ids, params)
        message, params, core_ids = core_request(request_id, prompt, params, self.eos_token_ids,
                                                 priority=priority, user=user, arrival_time=arrival_time)
        parent = message.request_id if message.fork_children else None
        self.output_processor.add_request(request_id, prompt.prompt, prompt.prompt_token_ids, params, core_ids,
                                          parent, message.arrival_time)
        self.core.add_request(message)

    def abort_request(self, request_ids: list[str] | str) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        core_ids = []
        for request_id in request_ids:
            state = self.output_processor.remove_request(request_id)
            if state is not None:
                core_ids.extend(state.core_ids)
        self.core.abort(EngineCoreAbort(core_ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.get_output()
        delivered, stopped = self.output_processor.process_outputs(core_outputs.outputs)
        if stopped:
            self.core.abort(EngineCoreAbort(stopped, stopped=True))
        results = []
        for state, output in delivered:
            # Offline, a request the core refused (queue full or timed out) ends with finish_reason
            # "abort" and the reason in stop_reason; the server turns it into a 429.
            refused = rejection(state, self.config.max_queue_time) if state.finished else None
            if refused is not None:
                self.num_rejected[refused.code] = self.num_rejected.get(refused.code, 0) + 1
            results.append(output)
        self._record_stats(core_outputs)
        return results

    def _record_stats(self, core_outputs: EngineCoreOutputs) -> None:
        iteration: IterationStats = self.output_processor.take_iteration_stats()
        if not self.stat_loggers or core_outputs.stats is None:
            return
        iteration.timestamp = time.time()  # when the step ended, not when the (possibly idle) step began
        snapshot = scheduler_snapshot(core_outputs)
        for stat_logger in self.stat_loggers:
            stat_logger.record(snapshot, iteration)
