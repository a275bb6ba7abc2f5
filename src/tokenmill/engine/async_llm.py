"""AsyncLLM: the server's asyncio frontend over an engine core in its own process.

The API process keeps what is per request and cheap: validation, the core messages, and output
processing (detokenization, stop strings, logprobs, metrics). It never loads the model: the core's
ready message carries the tokenizer (as files, see tokenizer_handover) and the few model values the
frontend reads (`FrontendModelInfo`), so this process imports no torch. The engine core (scheduler, KV cache,
model) runs in a child process (`core_client.MPClient`); a receiver thread hands each step's outputs
to the event loop, where they become RequestOutputs handed to each request's sink (a queue for
`generate`, the HTTP request's group for the server). If the core process dies,
every request in flight fails at once with an error, `errored` turns true (so /health answers 503)
and the server exits non-zero for its supervisor to restart it.

With --data-parallel-size N there are N cores, each with its own KV cache; `dp_router` picks the core
for each request (the one most likely to hold its prefix), and the stats the loggers see are the
cores' summed.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Any, AsyncIterator, Optional

import msgspec

from tokenmill.config import EngineConfig, usable_cpu_count
from tokenmill.core.kv_tier import TierView
from tokenmill.engine.core_client import MPClient
from tokenmill.engine.core_proc import LOAD_QUIETLY_ENV
from tokenmill.engine.dp_router import DataParallelRouter
from tokenmill.engine.frontend import Frontend, rejection, scheduler_snapshot
from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.engine.messages import (
    EngineCoreAbort,
    EngineCoreFork,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FrontendModelInfo,
)
from tokenmill.engine.tokenizer_handover import tokenizer_from_files
from tokenmill.errors import (
    EngineDeadError,
    EngineFailedError,
    InvalidRequestError,
    RequestTimeoutError,
    TokenmillError,
)
from tokenmill.lora_request import LoRARequest
from tokenmill.metrics.stats import IterationStats, SchedulerSnapshot, StatLogger
from tokenmill.outputs import RequestOutput
from tokenmill.runner.host_memory import process_rss_bytes, release_freed_memory
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


class AsyncLLM:
    """request_timeout: seconds a request may run before it is aborted (RequestTimeoutError).
    stall_timeout: seconds a started request (it had output) may go without output from the core."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO", *, request_timeout: Optional[float] = None,
                 stall_timeout: Optional[float] = None, api_server_count: int = 1,
                 clients: Optional[list[MPClient]] = None, load_quietly: bool = False) -> None:
        """api_server_count: API servers (this one and api_server_count - 1 started by the caller with
        `ready_for_api_servers` and the core client's frontend_addresses) that share one engine core.
        clients: an API server i > 0's AttachedClient, instead of starting cores. load_quietly: the cores load
        at the lowest CPU priority (other models serve meanwhile; core_proc._load_quietly)."""
        self.config = config
        self.request_timeout = request_timeout
        self.stall_timeout = stall_timeout
        if api_server_count > 1 and config.data_parallel_size > 1:
            raise InvalidRequestError("--api-server-count > 1 serves one engine core; it cannot be combined with "
                                      "--data-parallel-size > 1", "api_server_count")
        # The core loads the model in its process (a bad model path fails there, as a ModelLoadError
        # here); the tokenizer and the model's values come with its ready message (core 0's).
        self.clients = clients if clients is not None else _start_cores(config, log_level, api_server_count,
                                                                         load_quietly)
        # The ready message with the tokenizer's files, for the other API servers (dropped once they start).
        self.ready_for_api_servers = self.clients[0].ready if api_server_count > 1 else None
        try:
            info, self.tokenizer = _take_model_info(self.clients)
        except BaseException:
            for client in self.clients:
                client.shutdown(timeout_s=0.0)
            raise
        release_freed_memory()  # the tokenizer files, decoded and parsed
        self.ready = self.clients[0].ready
        self.max_model_len = self.ready.max_model_len
        self.router = DataParallelRouter(len(self.clients), self.ready.block_size, self.ready.num_kv_blocks,
                                         config.data_parallel_routing,
                                         long_prompt_threshold=config.data_parallel_long_prompt_threshold,
                                         long_prompt_borrowing=config.data_parallel_long_prompt_borrowing,
                                         shared_tier=_shared_tier(self.clients)) \
            if len(self.clients) > 1 else None
        self.frontend = Frontend.build(config, info, self.tokenizer, self.max_model_len)
        self.served_model_name = self.frontend.served_model_name
        self.eos_token_ids = self.frontend.eos_token_ids
        self.input_processor = self.frontend.input_processor
        self.output_processor = self.frontend.output_processor
        self.stat_loggers: list[StatLogger] = []
        self.num_rejected: dict[str, int] = {}  # reason -> count, for metrics
        # HTTP answers of the server in front ('handler method Nxx' -> count), for metrics.
        self.num_responses: dict[str, int] = {}
        self._snapshots: list[Optional[SchedulerSnapshot]] = [None] * len(self.clients)
        self._dead: Optional[str] = None
        self._stopped = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        # Core ids whose raw outputs go to a listener (beam search) instead of the output processor.
        self._listeners: dict[str, asyncio.Queue] = {}
        # Which core serves a request (by request id) or a raw core request (by core id).
        self._engine_of: dict[str, int] = {}
        self._watchdog: Optional[asyncio.Task] = None

    @property
    def client(self) -> MPClient:
        """The first engine core's client (the only one without data parallelism)."""
        return self.clients[0]

    @classmethod
    def from_config(cls, config: EngineConfig, log_level: str = "INFO", **kwargs: Any) -> "AsyncLLM":
        return cls(config, log_level, **kwargs)

    # ---- state ---------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self._dead is not None

    def poll_cores(self) -> bool:
        """Whether every engine core process still runs; notices a core that died while no request was in
        flight (the receivers, which otherwise notice, start with the first request)."""
        if self._dead is None:
            for client in self.clients:
                if client.check_alive(self._on_dead) is not None:
                    break
        return self._dead is None

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet finished or aborted (beam search's core requests included)."""
        return len(self.output_processor.requests) + len(self._listeners)

    @property
    def is_running(self) -> bool:
        return not self.errored and not self._stopped

    async def check_health(self) -> None:
        self._raise_if_dead()

    def _raise_if_dead(self) -> None:
        if self.errored:
            raise EngineDeadError(f"the engine has stopped: {self._dead}")

    def _ensure_receiving(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            loop = self._loop
            for index, client in enumerate(self.clients):
                client.start_receiver(
                    lambda outputs, i=index: loop.call_soon_threadsafe(self._on_outputs, outputs, i),
                    lambda reason: loop.call_soon_threadsafe(self._on_dead, reason))
            limits = [t for t in (self.request_timeout, self.stall_timeout) if t is not None]
            if limits:
                self._watchdog = loop.create_task(self._watch(max(0.05, min(1.0, min(limits) / 4))))

    def _route(self, prompt_token_ids: list[int], key: str, lora: Optional[LoRARequest] = None) -> int:
        if self.router is None:
            return 0
        return self.router.choose(prompt_token_ids, key, lora.cache_salt if lora is not None else b"")

    def _release(self, key: str) -> None:
        index = self._engine_of.pop(key, None)
        if index is not None and self.router is not None:
            self.router.finished(index, key)

    # ---- requests ------------------------------------------------------------------------
    def submit(self, prompt: ProcessedPrompt, sampling_params: SamplingParams, request_id: str, sink: Any, *,
               priority: int = 0, user: Optional[str] = None, validated: bool = False,
               lora: Optional[LoRARequest] = None) -> None:
        """Sends a request to its core; its outputs (as its params' output_kind asks), or the exception
        that ends it, go to `sink.put_nowait` on the event loop, straight from the step's callback.
        The caller aborts it (`abort`) if it stops listening before a finished output.
        validated: the caller already ran input_processor.validate on these parameters."""
        self._raise_if_dead()
        self._ensure_receiving()
        message = self.frontend.admit(request_id, prompt, sampling_params, priority=priority, user=user,
                                      queue=sink, validated=validated, lora=lora)
        index = self._engine_of[request_id] = self._route(prompt.prompt_token_ids, request_id, lora)
        self.clients[index].add_request(message)

    async def generate(self, prompt: ProcessedPrompt, sampling_params: SamplingParams, request_id: str, *,
                       priority: int = 0, user: Optional[str] = None, validated: bool = False,
                       lora_request: Optional[LoRARequest] = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs (as its params' output_kind asks); closing the iterator early aborts it.
        validated: the caller already ran input_processor.validate on these parameters."""
        queue: asyncio.Queue = asyncio.Queue()
        self.submit(prompt, sampling_params, request_id, queue, priority=priority, user=user, validated=validated,
                    lora=lora_request)
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
            self._release(request_id)

    async def abort(self, request_id: str) -> None:
        state = self.output_processor.remove_request(request_id)
        index = self._engine_of.get(request_id, 0)
        if state is not None and self._dead is None:
            self.clients[index].abort(EngineCoreAbort(state.core_ids))
        self._release(request_id)

    def fail_request(self, request_id: str, error: TokenmillError) -> None:
        """Ends a request in flight with `error` (its generate() raises it) and aborts it in the core."""
        state = self.output_processor.remove_request(request_id)
        if state is None:
            return
        if self._dead is None:
            self.clients[self._engine_of.get(request_id, 0)].abort(EngineCoreAbort(state.core_ids))
        state.queue.put_nowait(error)

    def fail_all(self, error: TokenmillError) -> None:
        """Ends every request in flight with `error` (the server's shutdown timeout ran out)."""
        for request_id in list(self.output_processor.requests):
            self.fail_request(request_id, error)
        listeners = list(self._listeners.values())
        self.release_core_requests(list(self._listeners), abort=True)
        for listener in set(listeners):
            listener.put_nowait(error)

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
        index = self._engine_of[message.request_id] = self._route(message.prompt_token_ids, message.request_id)
        self.clients[index].add_request(message)

    async def fork_core_request(self, message: EngineCoreFork, listener: asyncio.Queue) -> None:
        """Children fork on their parent's core."""
        await self.check_health()
        index = self._engine_of.get(message.parent_id, 0)
        for child in message.children:
            self._listeners[child.request_id] = listener
            self._engine_of[child.request_id] = index
            if self.router is not None:
                self.router.engines[index].in_flight += 1
        self.clients[index].fork(message)

    def release_core_requests(self, core_ids: list[str], abort: bool) -> None:
        by_engine: dict[int, list[str]] = {}
        for core_id in core_ids:
            self._listeners.pop(core_id, None)
            index = self._engine_of.get(core_id)
            if index is not None:
                by_engine.setdefault(index, []).append(core_id)
                self._release(core_id)
        if abort and self._dead is None:
            for index, ids in by_engine.items():
                self.clients[index].abort(EngineCoreAbort(ids))

    # ---- outputs (on the event loop) -------------------------------------------------------
    def _on_outputs(self, core_outputs: EngineCoreOutputs, index: int = 0) -> None:
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
            self.clients[index].abort(EngineCoreAbort(stopped, stopped=True))
        for state, output in delivered:
            item: Any = output
            if state.finished:
                refused = rejection(state, self.config.max_queue_time)
                if refused is not None:
                    self.num_rejected[refused.code] = self.num_rejected.get(refused.code, 0) + 1
                    item = refused
                elif state.error is not None:
                    item = InvalidRequestError(state.error)
            if state.finished:
                self._release(state.request_id)
            state.queue.put_nowait(item)
        self._record_stats(core_outputs, index)

    def _record_stats(self, core_outputs: EngineCoreOutputs, index: int) -> None:
        iteration = self.output_processor.take_iteration_stats()
        if core_outputs.stats is None:
            return
        self._snapshots[index] = scheduler_snapshot(core_outputs)
        self.record_iteration(iteration)

    def record_iteration(self, iteration: IterationStats) -> None:
        """One step's request statistics (this server's, or another API server's forwarded to this one)
        to the stat loggers, with the cores' latest scheduler stats."""
        iteration.timestamp = time.time()
        snapshot = self._snapshot()
        for stat_logger in self.stat_loggers:
            stat_logger.record(snapshot, iteration)

    def _snapshot(self) -> SchedulerSnapshot:
        """The cores' stats summed (KV usage averaged)."""
        known = [s for s in self._snapshots if s is not None]
        if len(known) <= 1:
            return known[0] if known else SchedulerSnapshot()
        total = SchedulerSnapshot()
        for name in SchedulerSnapshot.__dataclass_fields__:
            values = [getattr(s, name) for s in known]
            if isinstance(values[0], list):  # per-position counts: summed position by position
                setattr(total, name, [sum(column) for column in itertools.zip_longest(*values, fillvalue=0)])
            elif all(value is None or isinstance(value, dict) for value in values):
                # named counts (kv_offload, lora_running), None where a core has none: key by key
                merged: dict[str, float] = {}
                for value in values:
                    for key, count in (value or {}).items():
                        merged[key] = merged.get(key, 0) + count
                setattr(total, name, None if all(value is None for value in values) else merged)
            else:
                setattr(total, name, sum(values))
        total.kv_cache_usage = sum(s.kv_cache_usage for s in self._snapshots if s is not None) / len(self.clients)
        total.spec_step_draft_limit = max(s.spec_step_draft_limit for s in known)  # a decision, not a count
        return total

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
        stats = self._snapshot()
        body = {
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
        if self.router is not None:
            body["data_parallel"] = self.replica_stats()
        body["memory"] = self.memory_stats()
        body["device"] = {"value": self.ready.device, "reason": self.ready.device_reason}
        body["numerics"] = self.ready.numerics
        body["config"] = self.ready.config
        return body

    def memory_stats(self) -> dict[str, Any]:
        """What the engine cores reported once ready (weights, rotary tables, KV cache, a step's activations, their RSS
        then; summed over data-parallel cores), and the resident memory of this process and the cores now."""
        readies = [client.ready for client in self.clients]
        cores_now = [process_rss_bytes(client.process.pid) for client in self.clients]
        return {
            "weights_bytes": sum(ready.weights_bytes for ready in readies),
            "rotary_tables_bytes": sum(ready.buffers_bytes for ready in readies),
            "kv_cache_bytes": sum(ready.kv_cache_bytes for ready in readies),
            "activations_bytes": sum(ready.activations_bytes for ready in readies),
            "engine_rss_at_start_bytes": _sum_known(ready.rss_bytes for ready in readies),
            "engine_rss_bytes": _sum_known(cores_now),
            "api_rss_bytes": process_rss_bytes(),
        }

    def replica_stats(self) -> list[dict[str, Any]]:
        """Per engine core: its scheduler's gauges and counters, and what the router sent it."""
        replicas = []
        for routed, snapshot in zip(self.router.stats(), self._snapshots):
            snapshot = snapshot or SchedulerSnapshot()
            routed.update(num_requests_running=snapshot.num_running, num_requests_waiting=snapshot.num_waiting,
                          kv_cache_usage=snapshot.kv_cache_usage, prefix_cache_queries=snapshot.prefix_cache_queries,
                          prefix_cache_hits=snapshot.prefix_cache_hits)
            replicas.append(routed)
        return replicas

    async def shutdown(self) -> None:
        self._stopped = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, client.shutdown) for client in self.clients))


def _core_environment(config: EngineConfig, index: int) -> Optional[dict[str, str]]:
    """On a machine with several GPUs, data-parallel core i sees only its own visible GPUs: the i-th one,
    or the i-th run of --tensor-parallel-size of them (its workers take one each)."""
    if config.data_parallel_size == 1 or config.device == "cpu":
        return None
    import torch

    per_core = config.tensor_parallel_size
    if not torch.cuda.is_available() or torch.cuda.device_count() < config.data_parallel_size * per_core:
        return None  # the devices are shared by every core
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(devices[index * per_core:(index + 1) * per_core])}


def _start_cores(config: EngineConfig, log_level: str, api_server_count: int = 1,
                 load_quietly: bool = False) -> list[MPClient]:
    """Start every engine core (they load their models at the same time), then wait for each."""
    size = config.data_parallel_size
    clients: list[MPClient] = []
    try:
        for index in range(size):
            core_config = config.for_data_parallel_core(index, usable_cpu_count()) if size > 1 else config
            env = _core_environment(config, index)
            if load_quietly:
                env = {**(env or os.environ), LOAD_QUIETLY_ENV: "1"}
            clients.append(MPClient(core_config, log_level, wait=False, env=env,
                                    api_server_count=api_server_count))
        for client in clients:
            client.wait_until_ready()
    except BaseException:
        for client in clients:
            client.shutdown(timeout_s=0.0)
        raise
    return clients


def _take_model_info(clients: list[MPClient]) -> tuple[FrontendModelInfo, Any]:
    """Core 0's model info and the tokenizer its files describe. Every client's ready message keeps the
    info without the files (megabytes a long-lived process has no use for)."""
    info = clients[0].ready.model_info
    if info is None or not info.tokenizer_files:
        raise EngineDeadError("the engine core's ready message carries no model info")
    tokenizer = tokenizer_from_files(info.tokenizer_files)
    for client in clients:
        stripped = client.ready.model_info
        if stripped is not None:
            stripped = msgspec.structs.replace(stripped, tokenizer_files={})
        client.ready = msgspec.structs.replace(client.ready, model_info=stripped)
    return msgspec.structs.replace(info, tokenizer_files={}), tokenizer


def _sum_known(values) -> Optional[int]:
    """The sum, or None when any value is unknown (no /proc)."""
    values = list(values)
    return None if not values or any(v is None for v in values) else sum(values)


def _shared_tier(clients) -> Optional[TierView]:
    """The KV offload tier every engine core reads (the same directory and fingerprint), if any."""
    roots = {(client.ready.kv_offload_root, client.ready.kv_offload_file_bytes) for client in clients}
    if len(roots) != 1:
        return None
    root, file_bytes = roots.pop()
    return TierView(root, file_bytes) if root is not None else None
