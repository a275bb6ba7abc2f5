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
from tokenmill.engine.core_client import InprocClient
from tokenmill.engine.frontend import Frontend, rejection, scheduler_snapshot
from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.engine.messages import EngineCoreAbort, EngineCoreOutputs
from tokenmill.lora_request import LoRARequest
from tokenmill.metrics.stats import IterationStats, StatLogger
from tokenmill.model.loader import load_model_source
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


class LLMEngine:
    def __init__(self, config: EngineConfig, message_roundtrip: bool = False) -> None:
        """message_roundtrip: every message between the frontend, the core and the runner is encoded and
        decoded as a process boundary would (tests)."""
        self.config = config
        source = load_model_source(config.model, config.tokenizer)
        self.tokenizer = source.tokenizer
        self.hf_config = source.hf_config
        self.core = InprocClient(config, source, message_roundtrip)
        self.max_model_len = self.core.ready.max_model_len
        # The numerics chosen at start-up: option -> {"value", "reason"} (runner.numerics).
        self.numerics = self.core.ready.numerics
        # In one process the frontend shares the source's tokenizer; the rest comes as the server's does.
        self.frontend = Frontend.build(config, self.core.ready.model_info, source.tokenizer, self.max_model_len)
        self.served_model_name = self.frontend.served_model_name
        self.eos_token_ids = self.frontend.eos_token_ids
        self.input_processor = self.frontend.input_processor
        self.output_processor = self.frontend.output_processor
        self.num_rejected: dict[str, int] = {}  # reason -> count, for metrics
        # Stat loggers (Prometheus, log line, dashboard window) see every step.
        self.stat_loggers: list[StatLogger] = []

    def shutdown(self) -> None:
        """Stops the engine's worker processes (tensor parallelism); they also stop when this process exits."""
        self.core.shutdown()

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, *,
                    priority: int = 0, user: Optional[str] = None, arrival_time: Optional[float] = None,
                    lora_request: Optional[LoRARequest] = None) -> None:
        self.core.add_request(self.frontend.admit(request_id, prompt, params, priority=priority, user=user,
                                                 arrival_time=arrival_time, lora=lora_request))

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
