"""AsyncLLM: the server's asyncio façade over one continuous-batching engine loop.

The engine loop runs in a dedicated thread. The HTTP event loop only enqueues commands and awaits
per-request queues; torch releases the GIL during kernels, so tokenization and HTTP work proceed
while the model runs. (DESIGN.md's target is a separate engine-core process; the thread keeps one
copy of the weights and no serialization, and its cost is measured in docs/benchmarks.md.)

The engine is built on the thread that runs it. On CPU, torch's OpenMP runtime (libgomp) gives every
thread that enters a parallel region its own worker team, and once the process holds more OpenMP
threads than cores it stops spinning between regions and puts workers to sleep instead: a model
loaded on the main thread and run on another decoded 1.75x slower per token (docs/performance.md).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Union

from tokenmill.config import EngineConfig
from tokenmill.engine.input_processor import InputProcessor, ProcessedPrompt
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.core.scheduler import QUEUE_TIMEOUT
from tokenmill.errors import EngineDeadError, InvalidRequestError, RequestRejectedError, TokenmillError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    def __init__(self, engine: Union[LLMEngine, Callable[[], LLMEngine]]) -> None:
        """engine: a built LLMEngine, or a factory that the engine thread calls to build it (preferred:
        then one thread does all of the engine's torch work; see the module docstring)."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._stop = threading.Event()
        self._dead: Optional[BaseException] = None
        factory = (lambda: engine) if isinstance(engine, LLMEngine) else engine
        built: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(factory, built), name="tokenmill-engine",
                                        daemon=True)
        self._thread.start()
        error = built.get()
        if error is not None:
            self._thread.join()
            raise error
        self.tokenizer = self.engine.tokenizer
        self.input_processor: InputProcessor = self.engine.input_processor
        self.served_model_name = self.engine.served_model_name
        self.max_model_len = self.engine.max_model_len
        self.config = self.engine.config

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLM":
        return cls(lambda: LLMEngine(config))

    # ---- public API ----------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._dead is not None or not self._thread.is_alive()

    @property
    def is_running(self) -> bool:
        return not self.errored and not self._stop.is_set()

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError("the engine loop has stopped")

    async def generate(self, prompt: ProcessedPrompt, sampling_params: SamplingParams, request_id: str, *,
                       priority: int = 0, user: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; closing the iterator early aborts the request."""
        await self.check_health()
        params = self.input_processor.validate_lengths(prompt.prompt_token_ids, sampling_params)
        if params.structured_outputs is not None:  # a bad grammar is a 400 before any stream starts
            self.engine.structured_backend.validate(params.structured_outputs)
        self._admit()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
            self._streams[request_id] = stream
        self._send(("add", request_id, prompt, params, priority, user, time.monotonic()))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                # Outputs are cumulative: when the consumer lags, only the newest one matters.
                while not stream.queue.empty() and not _is_final(item):
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if finished and any(o.stop_reason == QUEUE_TIMEOUT for o in item.outputs):
                    self._count_rejection("queue_timeout")
                    raise RequestRejectedError(
                        f"the request waited longer than max_queue_time ({self.config.max_queue_time} s) "
                        "without being scheduled; retry later", retry_after_s=1.0, code="queue_timeout")
                yield item
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def _admit(self) -> None:
        """Admission control: refuse at once (429) when the waiting queue is full."""
        limit = self.config.max_num_queued_requests
        if limit is None:
            return
        waiting = len(self.engine.core.scheduler.waiting) + self._commands.qsize()
        if waiting >= limit:
            self._count_rejection("queue_full")
            raise RequestRejectedError(f"the server is busy: {limit} requests are already queued; retry later",
                                       retry_after_s=1.0, code="queue_full")

    def _count_rejection(self, reason: str) -> None:
        rejected = self.engine.num_rejected
        rejected[reason] = rejected.get(reason, 0) + 1

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def get_stats(self) -> dict[str, Any]:
        stats = self.engine.core.get_stats()
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
            "num_rejected": dict(self.engine.num_rejected),
        }

    async def shutdown(self) -> None:
        self._stop.set()
        self._wakeup.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30)

    # ---- the engine thread ---------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self, factory: Callable[[], LLMEngine], built: queue.SimpleQueue) -> None:
        try:
            self.engine: LLMEngine = factory()
        except BaseException as exc:  # reported to the constructor, which raises it
            built.put(exc)
            return
        built.put(None)
        self._loop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                for output in self.engine.step():
                    stream = self._streams.get(output.request_id)
                    if stream is not None:
                        stream.put(output)
        except BaseException as exc:  # the loop must never die silently
            logger.exception("engine loop died")
            self._dead = exc
            with self._streams_lock:
                for stream in self._streams.values():
                    stream.put(EngineDeadError("the engine failed while serving this request"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt, params, priority, user, arrival = command
                if request_id not in self._streams:
                    continue  # the client left before the request reached the engine
                try:
                    self.engine.add_request(request_id, prompt, params, priority=priority, user=user,
                                            arrival_time=arrival)
                except Exception as exc:  # a bad request fails alone
                    stream = self._streams.get(request_id)
                    if stream is not None:
                        stream.put(exc if isinstance(exc, TokenmillError) else InvalidRequestError(str(exc)))
            elif command[0] == "abort":
                self.engine.abort_request(command[1])


def _is_final(item: Any) -> bool:
    return isinstance(item, BaseException) or item.finished
