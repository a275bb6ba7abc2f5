"""AsyncLLM: the server's asyncio frontend over an engine core in its own process.

The API process keeps what is per request and cheap: validation, the core messages, and output
processing (detokenization, stop strings, logprobs, metrics). The engine core (scheduler, KV cache,
model) runs in a child process (`core_client.MPClient`); a receiver thread hands each step's outputs
to the event loop, where they become RequestOutputs on per-request queues. If the core process dies,
every request in flight fails at once with an error, `errored` turns true (so /health answers 503)
and the server exits non-zero for its supervisor to restart it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Optional

from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import MPClient
from tokenmill.engine.input_processor import InputProcessor, ProcessedPrompt, eos_token_ids
from tokenmill.engine.llm_engine import core_request, rejection, scheduler_snapshot
from tokenmill.engine.messages import EngineCoreAbort, EngineCoreFork, EngineCoreOutput, EngineCoreOutputs, \
    EngineCoreRequest
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.errors import EngineDeadError, EngineFailedError, InvalidRequestError, RequestTimeoutError, \
    TokenmillError
from tokenmill.metrics.stats import SchedulerSnapshot, StatLogger
from tokenmill.model.default_model import DEFAULT_MODEL_NAME
from tokenmill.model.loader import load_model_source
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.llguidance_backend import LLGuidanceBackend

logger = logging.getLogger("tokenmill")


class AsyncLLM:
    """request_timeout: seconds a request may run before it is aborted (RequestTimeoutError).
    stall_timeout: seconds a started request (it had output) may go without output from the core."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO", *, request_timeout: Optional[float] = None,
                 stall_timeout: Optional[float] = None) -> None:
        self.config = config
        self.request_timeout = request_timeout
        self.stall_timeout = stall_timeout
        # The core loads the model in its process; here only the tokenizer and the model's config.
        source = load_model_source(config.model, config.tokenizer)
        self.tokenizer = source.tokenizer
        hf_config = source.hf_config
        self.served_model_name = config.served_model_name or (
            DEFAULT_MODEL_NAME if config.model is None else source.served_model_name)
        self.eos_token_ids = eos_token_ids(self.tokenizer, hf_config)
        self.client = MPClient(config, log_level)
        self.ready = self.client.ready
        self.max_model_len = self.ready.max_model_len
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, hf_config.vocab_size,
                                              config.max_prompt_tokens,
                                              LLGuidanceBackend(self.tokenizer, hf_config.vocab_size,
                                                                self.eos_token_ids))
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.stat_loggers: list[StatLogger] = []
        self.num_rejected: dict[str, int] = {}  # reason -> count, for metrics
        self._latest: Optional[SchedulerSnapshot] = None
        self._dead: Optional[str] = None
        self._stopped = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        # Core ids whose raw outputs go to a listener (beam search) instead of the output processor.
        self._listeners: dict[str, asyncio.Queue] = {}
        self._watchdog: Optional[asyncio.Task] = None

    @classmethod
    def from_config(cls, config: EngineConfig, log_level: str = "INFO", **kwargs: Any) -> "AsyncLLM":
        return cls(config, log_level, **kwargs)

    # ---- state ---------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def is_running(self) -> bool:
        return not self.errored and not self._stopped

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(f"the engine has stopped: {self._dead}")

    def _ensure_receiving(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            loop = self._loop
            self.client.start_receiver(lambda outputs: loop.call_soon_threadsafe(self._on_outputs, outputs),
                                       lambda reason: loop.call_soon_threadsafe(self._on_dead, reason))
            limits = [t for t in (self.request_timeout, self.stall_timeout) if t is not None]
            if limits:
                self._watchdog = loop.create_task(self._watch(max(0.05, min(1.0, min(limits) / 4))))

    # ---- requests ------------------------------------------------------------------------
    async def generate(self, prompt: ProcessedPrompt, sampling_params: SamplingParams, request_id: str, *,
                       priority: int = 0, user: Optional[str] = None,
                       validated: bool = False) -> AsyncIterator[RequestOutput]:
        """The request's outputs (as its params' output_kind asks); closing the iterator early aborts it.
        validated: the caller already ran input_processor.validate on these parameters."""
        await self.check_health()
        self._ensure_receiving()
        params = sampling_params if validated else self.input_processor.validate(prompt.prompt_token_ids,
                                                                                   sampling_params)
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        message, params, core_ids = core_request(request_id, prompt, params, self.eos_token_ids,
                                                 priority=priority, user=user)
        queue: asyncio.Queue = asyncio.Queue()
        parent = message.request_id if message.fork_children else None
        self.output_processor.add_request(request_id, prompt.prompt, prompt.prompt_token_ids, params, core_ids,
                                          parent, message.arrival_time, queue=queue)
        self.client.add_request(message)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        state = self.output_processor.remove_request(request_id)
        if state is not None and self._dead is None:
            self.client.abort(EngineCoreAbort(state.core_ids))

    def fail_request(self, request_id: str, error: TokenmillError) -> None:
        """Ends a request in flight with `error` (its generate() raises it) and aborts it in the core."""
        state = self.output_processor.remove_request(request_id)
        if state is None:
            return
        if self._dead is None:
            self.client.abort(EngineCoreAbort(state.core_ids))
        state.queue.put_nowait(error)

    def fail_all(self, error: TokenmillError) -> None:
        """Ends every request in flight with `error` (the server's shutdown timeout ran out)."""
        for request_id in list(self.output_processor.requests):
            self.fail_request(request_id, error)
        if self._listeners and self._dead is None:
            self.client.abort(EngineCoreAbort(list(self._listeners)))
        for listener in set(self._listeners.values()):
            listener.put_nowait(error)
        self._listeners.clear()

    async def _watch(self, interval: float) -> None:
        """The request timeout and the stall watchdog: no request waits forever on the core."""
        while not self._stopped and self._dead is None:
            await asyncio.sleep(interval)
            self.check_deadlines(time.monotonic())

    def check_deadlines(self, now: float) -> None:
        for request_id, state in list(self.output_processor.requests.items()):
            if state.queue is None:
                continue
            if self.request_timeout is not None and now - state.added_time > self.request_timeout:
                self.fail_request(request_id, RequestTimeoutError(
                    f"the request ran longer than the server's request timeout of {self.request_timeout:g} s",
                    code="request_timeout"))
            elif (self.stall_timeout is not None and state.last_output_time is not None
                  and now - state.last_output_time > self.stall_timeout):
                # Waiting in the queue is --max-queue-time's business: only started requests are watched.
                logger.error("request %s got no output from the engine core for %.0f s; failing it",
                             request_id, now - state.last_output_time)
                self.fail_request(request_id, RequestTimeoutError(
                    f"the engine produced no output for this request for {self.stall_timeout:g} s",
                    code="engine_stalled"))

    # ---- raw core access (beam search) ---------------------------------------------------
    async def add_core_request(self, message: EngineCoreRequest, listener: asyncio.Queue) -> None:
        await self.check_health()
        self._ensure_receiving()
        self._listeners[message.request_id] = listener
        self.client.add_request(message)

    async def fork_core_request(self, message: EngineCoreFork, listener: asyncio.Queue) -> None:
        await self.check_health()
        for child in message.children:
            self._listeners[child.request_id] = listener
        self.client.fork(message)

    def release_core_requests(self, core_ids: list[str], abort: bool) -> None:
        for core_id in core_ids:
            self._listeners.pop(core_id, None)
        if abort and self._dead is None:
            self.client.abort(EngineCoreAbort(core_ids))

    # ---- outputs (on the event loop) -------------------------------------------------------
    def _on_outputs(self, core_outputs: EngineCoreOutputs) -> None:
        outputs: list[EngineCoreOutput] = core_outputs.outputs
        if self._listeners:
            mine = [o for o in outputs if o.request_id not in self._listeners]
            for out in outputs:
                listener = self._listeners.get(out.request_id)
                if listener is not None:
                    listener.put_nowait(out)
            outputs = mine
        delivered, stopped = self.output_processor.process_outputs(outputs)
        if stopped and self._dead is None:
            self.client.abort(EngineCoreAbort(stopped, stopped=True))
        for state, output in delivered:
            item: Any = output
            if state.finished:
                refused = rejection(state, self.config.max_queue_time)
                if refused is not None:
                    self.num_rejected[refused.code] = self.num_rejected.get(refused.code, 0) + 1
                    item = refused
                elif state.error is not None:
                    item = InvalidRequestError(state.error)
            state.queue.put_nowait(item)
        self._record_stats(core_outputs)

    def _record_stats(self, core_outputs: EngineCoreOutputs) -> None:
        iteration = self.output_processor.take_iteration_stats()
        if core_outputs.stats is None:
            return
        self._latest = scheduler_snapshot(core_outputs)
        iteration.timestamp = time.time()
        for stat_logger in self.stat_loggers:
            stat_logger.record(self._latest, iteration)

    def _on_dead(self, reason: str) -> None:
        self._dead = reason
        error = EngineFailedError("the engine failed while serving this request", code="engine_dead")
        for request_id, state in list(self.output_processor.requests.items()):
            self.output_processor.remove_request(request_id)
            state.queue.put_nowait(error)
        for listener in set(self._listeners.values()):
            listener.put_nowait(error)
        self._listeners.clear()

    # ---- stats and lifecycle ---------------------------------------------------------------
    def get_stats(self) -> dict[str, Any]:
        stats = self._latest or SchedulerSnapshot()
        return {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "num_requests_swapped": stats.num_swapped,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_preemptions": stats.num_preemptions,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "num_cached_blocks": stats.num_cached_blocks,
            "num_evictions": stats.num_evictions,
            "num_rejected": dict(self.num_rejected),
        }

    async def shutdown(self) -> None:
        self._stopped = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self.client.shutdown)
