"""The models one server serves: each an `AsyncLLM` with its own engine core process(es), its handlers and its
stat loggers (`ServedModel`), routed to by the request's `model` (a served name, an alias or a LoRA adapter).

Models load and unload at run time (`load`, `unload`): an unload drains (new requests for the model get 503
with Retry-After, requests in flight finish, up to --shutdown-timeout), stops its engine cores and then
answers 404. Loading runs in a worker thread, so requests to the other models keep streaming meanwhile.

With --models-memory-budget the loaded models' memory (`ServedModel.memory_bytes`) stays within the budget:
a load that does not fit first unloads the least recently used idle models (they stay known, and load
again on demand). With --load-on-demand a request for a known model that is not loaded waits for it to
load instead of failing.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional

from tokenmill.config import DEFAULT_CPU_KV_CACHE_BYTES
from tokenmill.entrypoints.openai.cli_args import ServerConfig, parse_lora_module
from tokenmill.entrypoints.openai.model_specs import ModelSpec, SpecReader, check_unique, with_lora_modules
from tokenmill.entrypoints.openai.protocol import ModelCard
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenmill.entrypoints.openai.serving_models import OpenAIServingModels
from tokenmill.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from tokenmill.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    ModelUnavailableError,
    ServiceUnavailableError,
    TokenmillError,
)
from tokenmill.metrics.loggers import LoggingStatLogger
from tokenmill.metrics.prometheus import PrometheusStatLogger
from tokenmill.metrics.stats import WindowStatLogger

if TYPE_CHECKING:
    from tokenmill.engine.async_llm import AsyncLLM

logger = logging.getLogger("tokenmill.server")

# What a client is told to wait before retrying a model that is draining or loading.
RETRY_AFTER_S = 5.0
DRAIN_POLL_S = 0.05
# An engine core's own memory beyond its weights and KV cache (the Python and torch runtime), for the
# estimate of a model that has not been loaded yet.
CORE_RUNTIME_BYTES = 400 * 1024**2


@dataclass
class ServedModel:
    """A loaded model: its engine, the handlers of the routes that serve it, its stat loggers and its use."""

    spec: ModelSpec
    engine: "AsyncLLM"
    models: OpenAIServingModels
    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization
    prometheus: PrometheusStatLogger
    window: WindowStatLogger
    load_seconds: float
    last_used: float = field(default_factory=time.monotonic)
    draining: bool = False
    pending: int = 0  # HTTP requests routed here whose engine requests are not submitted yet

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def in_flight(self) -> int:
        return self.pending + self.engine.num_in_flight

    def memory_bytes(self) -> int:
        """What the model holds, or may grow to: its engine cores' resident memory now, or what they reserved
        at start (weights, rotary tables, KV cache, a step's activations), whichever is larger."""
        memory = self.engine.memory_stats()
        reserved = sum(memory[key] for key in ("weights_bytes", "rotary_tables_bytes", "kv_cache_bytes",
                                                "activations_bytes"))
        return max(reserved, memory["engine_rss_bytes"] or 0)


def estimated_bytes(spec: ModelSpec) -> int:
    """A model's memory before its first load: its files, its KV cache budget and a core's runtime, per
    data-parallel core."""
    config = spec.config
    files = 0
    if config.model is not None:
        path = Path(config.model)
        paths = [path] if path.is_file() else (list(path.glob("*.safetensors")) if path.is_dir() else [])
        files = sum(p.stat().st_size for p in paths)
    kv = config.kv_cache_memory_bytes or (0 if config.device == "cuda" else DEFAULT_CPU_KV_CACHE_BYTES)
    return (files + kv + CORE_RUNTIME_BYTES) * config.data_parallel_size


class ModelPool:
    """start_engine(config, load_quietly) -> AsyncLLM: starts a model's engine cores (blocking; run in a worker
    thread; load_quietly: at the lowest CPU priority, while other models serve).
    spec_reader: reads an admin load request's options (None: models cannot be added at run time)."""

    def __init__(self, server: ServerConfig, specs: list[ModelSpec], start_engine: Callable[[Any, bool], "AsyncLLM"],
                 spec_reader: Optional[SpecReader] = None) -> None:
        self.server = server
        self.start_engine = start_engine
        self.spec_reader = spec_reader
        self.specs: dict[str, ModelSpec] = {}  # every model the server knows, loaded or not
        self.loaded: dict[str, ServedModel] = {}
        self._aliases: dict[str, str] = {}  # every name and alias -> the model's name
        self._loading: dict[str, asyncio.Task] = {}
        self._measured: dict[str, int] = {}  # a model's memory when it last ran
        self._lock = asyncio.Lock()  # loads one at a time: each checks the budget against the ones before
        self.default_name = specs[0].name
        self.num_responses: dict[str, int] = {}  # HTTP answers ('handler method Nxx' -> count), for metrics
        self.loads = 0
        self.unloads = 0
        for spec in specs:
            self.register(spec)

    @classmethod
    def of_engine(cls, server: ServerConfig, engine: "AsyncLLM") -> "ModelPool":
        """A pool of one engine already started (an API server of --api-server-count, a Ray Serve replica)."""
        spec = with_lora_modules([ModelSpec(engine.served_model_name, engine.config)], server.lora_modules)[0]
        pool = cls(server, [spec], lambda config, quietly: engine)
        pool.loaded[spec.name] = pool._attach(spec, engine, 0.0)
        pool.num_responses = engine.num_responses  # an API server i > 0 forwards these to server 0
        return pool

    # ---- what the server knows ---------------------------------------------------------------
    def register(self, spec: ModelSpec) -> None:
        check_unique([spec], tuple(self._aliases) + self._adapter_names())
        self.specs[spec.name] = spec
        for name in spec.names:
            self._aliases[name] = spec.name

    def _forget(self, name: str) -> None:
        spec = self.specs.pop(name, None)
        for alias in spec.names if spec is not None else ():
            self._aliases.pop(alias, None)

    def _adapter_names(self) -> tuple[str, ...]:
        return tuple(lora for served in self.loaded.values() for lora in served.models.loras)

    def _adapter_owner(self, name: str) -> Optional[ServedModel]:
        """The loaded model with a LoRA adapter of this name, if any."""
        return next((served for served in self.loaded.values() if name in served.models.loras), None)

    def used_bytes(self) -> int:
        """The loaded models' memory, as the budget counts it."""
        return sum(served.memory_bytes() for served in self.loaded.values())

    @property
    def default(self) -> Optional[ServedModel]:
        """The model a request without `model` goes to: the first one, else any loaded one."""
        served = self.loaded.get(self.default_name)
        return served if served is not None else next(iter(self.loaded.values()), None)

    @property
    def several(self) -> bool:
        return len(self.specs) > 1

    # ---- routing ------------------------------------------------------------------------------
    def _served(self, model: Optional[str]) -> ServedModel:
        """The loaded model a request's `model` names (by name, alias or adapter); 404 for a name the
        server lacks or a model that is not loaded (a known one loads first with --load-on-demand), 503 with
        Retry-After while it drains or loads."""
        if model in (None, ""):
            served = self.default
            if served is None:
                raise ModelNotFoundError("no model is loaded", "model", "model_not_found")
        else:
            name = self._aliases.get(model)
            if name is None:
                served = self._adapter_owner(model)
                if served is None:
                    raise ModelNotFoundError(f"The model `{model}` does not exist.", "model", "model_not_found")
            else:
                served = self.loaded.get(name)
                if served is None:
                    if name in self._loading:
                        raise ModelUnavailableError(f"The model `{model}` is loading; retry shortly.",
                                                    RETRY_AFTER_S, "model", "model_loading")
                    raise ModelNotFoundError(f"The model `{model}` is not loaded (an admin load, or a server "
                                             "started with --load-on-demand, loads it).", "model",
                                             "model_not_loaded")
        if served.draining:
            raise ModelUnavailableError(f"The model `{served.name}` is being unloaded.", RETRY_AFTER_S, "model",
                                        "model_unloading")
        return served

    @contextlib.asynccontextmanager
    async def use(self, model: Optional[str]) -> AsyncIterator[ServedModel]:
        """The model a request names, counted as in use until the handler has submitted its engine requests
        (from then on its engine counts them). With --load-on-demand a known model that is not loaded loads
        first; the request waits for it."""
        name = self._aliases.get(model) if model else None
        if self.server.load_on_demand and name is not None and name not in self.loaded:
            await self.load(name)
        served = self._served(model)
        served.pending += 1
        served.last_used = time.monotonic()
        try:
            yield served
        finally:
            served.pending -= 1
            served.last_used = time.monotonic()

    def name_of(self, model: str) -> str:
        """The model a name or alias names; 404 for one the server does not know."""
        name = self._aliases.get(model)
        if name is None:
            raise ModelNotFoundError(f"The model `{model}` does not exist.", "model", "model_not_found")
        return name

    def stats_model(self, model: Optional[str]) -> ServedModel:
        """The loaded model /stats reports (default: the default model)."""
        served = self.default if not model else self.loaded.get(self.name_of(model))
        if served is None:
            raise ModelNotFoundError(f"The model `{model or self.default_name}` is not loaded.", "model",
                                     "model_not_loaded")
        return served

    # ---- adapters -----------------------------------------------------------------------------
    def load_lora(self, name: str, path: str, base_model_name: Optional[str] = None) -> None:
        """vLLM's /v1/load_lora_adapter: an adapter of the model base_model_name names (default: the default
        model); its name must be new to the whole server."""
        served = self.loaded.get(self.name_of(base_model_name)) if base_model_name else self.default
        if served is None:
            raise ModelNotFoundError(f"The model `{base_model_name or self.default_name}` is not loaded.",
                                     "base_model_name", "model_not_loaded")
        if name in self._aliases or name in self._adapter_names():
            raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        served.models.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        served = self._adapter_owner(name)
        if served is None:
            raise ModelNotFoundError(f"The lora adapter '{name}' cannot be found.", "lora_name", "model_not_found")
        served.models.unload_lora(name)

    # ---- loading ------------------------------------------------------------------------------
    async def load(self, name: str, blocking: bool = False) -> ServedModel:
        """Loads a known model (requests for it while it loads wait here too); returns it once it serves.
        blocking: start its engine on the event loop's thread (at start-up, when nothing else is served, so
        that Ctrl-C stops a load)."""
        if name in self.loaded:
            return self.loaded[name]
        task = self._loading.get(name)
        if task is None:
            task = self._loading[name] = asyncio.ensure_future(self._load(self.specs[name], blocking))
            task.add_done_callback(lambda _: self._loading.pop(name, None))
        return await asyncio.shield(task)

    async def _load(self, spec: ModelSpec, blocking: bool = False) -> ServedModel:
        async with self._lock:
            if spec.name not in self.specs:
                raise ModelNotFoundError(f"The model `{spec.name}` was removed while it waited to load.", "model",
                                         "model_not_found")
            await self._make_room(spec, self._measured.get(spec.name) or estimated_bytes(spec))
            started = time.monotonic()
            logger.info("loading model %s", spec.name)
            # At start-up nothing else serves; later the new cores load at the lowest CPU priority.
            engine = self.start_engine(spec.config, False) if blocking else \
                await asyncio.to_thread(self.start_engine, spec.config, bool(self.loaded))
            try:
                served = self._attach(spec, engine, time.monotonic() - started)
            except BaseException:  # e.g. a bad adapter in its lora_modules: the engine must not outlive it
                await engine.shutdown()
                raise
            self.loaded[spec.name] = served
            self.loads += 1
            self._measured[spec.name] = served.memory_bytes()
            logger.info("model %s loaded in %.1f s (%.0f MiB)", spec.name, served.load_seconds,
                        self._measured[spec.name] / 2**20)
            # The estimate may have been low: what it really holds is now counted.
            await self._make_room(None, 0)
            return served

    def _attach(self, spec: ModelSpec, engine: "AsyncLLM", load_seconds: float) -> ServedModel:
        """The handlers and stat loggers of a freshly started engine."""
        lora = engine.frontend.lora_checks is not None
        models = OpenAIServingModels(spec.name, engine.max_model_len, root=spec.config.model,
                                     aliases=spec.aliases, check_lora=engine.frontend.check_lora if lora else None)
        served_names = tuple(self._aliases) + self._adapter_names()
        for entry in spec.lora_modules:
            lora_name, lora_path, _ = parse_lora_module(entry)
            if lora_name in served_names:
                raise InvalidRequestError(f"the adapter name {lora_name!r} is already a model's or adapter's",
                                          "lora_modules")
            models.load_lora(lora_name, lora_path)
        on_cuda = engine.ready.device.startswith("cuda")
        prometheus = PrometheusStatLogger(spec.name, device_memory=on_cuda,
                                          kv_offload=engine.ready.kv_offload_root is not None,
                                          max_loras=engine.config.max_loras if lora else None)
        window = WindowStatLogger()
        engine.stat_loggers.extend([prometheus, window])
        if not self.server.disable_log_stats:
            engine.stat_loggers.append(LoggingStatLogger(model_name=spec.name if self.several else None))
        return ServedModel(
            spec, engine, models,
            OpenAIServingCompletion(engine, spec.name, models),
            OpenAIServingChat(engine, spec.name, tool_call_parser=self.server.auto_tool_call_parser, models=models,
                              reasoning_parser=self.server.reasoning_parser),
            OpenAIServingTokenization(engine, spec.name, models),
            prometheus, window, load_seconds)

    async def add(self, spec: ModelSpec) -> ServedModel:
        """Registers a new model and loads it (an admin load of a model the server did not know); if it cannot
        load, the server forgets it again."""
        self.register(spec)
        try:
            return await self.load(spec.name)
        except BaseException:
            if spec.name not in self.loaded:
                self._forget(spec.name)
            raise

    async def _make_room(self, spec: Optional[ModelSpec], needed: int) -> None:
        """Unloads least recently used idle models until `needed` more bytes fit in the budget."""
        budget = self.server.models_memory_budget
        if budget is None:
            return
        if spec is not None and needed > budget:
            raise InvalidRequestError(f"the model {spec.name} needs about {needed / 2**20:.0f} MiB, more than "
                                      f"--models-memory-budget ({budget / 2**20:.0f} MiB)", "model")
        while self.used_bytes() + needed > budget:
            idle = [s for s in self.loaded.values() if s.in_flight == 0 and not s.draining]
            if not idle:
                if spec is None:
                    return  # over the budget by a busy model's growth; the next load frees room
                raise ModelUnavailableError(
                    f"the model {spec.name} does not fit in --models-memory-budget while every loaded model "
                    "has requests in flight; retry shortly", RETRY_AFTER_S, "model", "memory_budget")
            victim = min(idle, key=lambda s: s.last_used)
            logger.info("unloading idle model %s (least recently used) to make room", victim.name)
            await self.unload(victim.name, forget=False)

    # ---- unloading ----------------------------------------------------------------------------
    async def unload(self, name: str, forget: bool = True, timeout_s: Optional[float] = None) -> None:
        """Drains a model and stops its engine. forget: requests for it get 404 afterwards (an admin unload);
        else it stays known and can load again (an unload to make room)."""
        served = self.loaded.get(name)
        if served is None or served.draining:
            raise ModelNotFoundError(f"The model `{name}` is not loaded.", "model", "model_not_found")
        served.draining = True
        timeout_s = self.server.shutdown_timeout if timeout_s is None else timeout_s
        started = time.monotonic()
        logger.info("unloading model %s: waiting for %d requests in flight", name, served.in_flight)
        while served.in_flight and time.monotonic() - started < timeout_s:
            await asyncio.sleep(DRAIN_POLL_S)
        if served.in_flight:
            logger.warning("model %s: %d requests still running after %.0f s end with 503", name,
                           served.in_flight, timeout_s)
            served.engine.fail_all(ServiceUnavailableError(
                f"the model {name} was unloaded before this request finished", code="model_unloaded"))
            await asyncio.sleep(DRAIN_POLL_S)
        self._measured[name] = served.memory_bytes()
        self.loaded.pop(name, None)
        if forget:
            self._forget(name)
        await served.engine.shutdown()
        self.unloads += 1
        logger.info("model %s unloaded after %.1f s", name, time.monotonic() - started)

    # ---- the engine-like surface the server's lifecycle uses ------------------------------------
    def poll_cores(self) -> bool:
        return all(served.engine.poll_cores() for served in list(self.loaded.values()))

    @property
    def errored(self) -> bool:
        return any(served.engine.errored for served in self.loaded.values())

    def fail_all(self, error: TokenmillError) -> None:
        for served in list(self.loaded.values()):
            served.engine.fail_all(error)

    async def shutdown(self) -> None:
        for task in list(self._loading.values()):
            task.cancel()
        await asyncio.gather(*(served.engine.shutdown() for served in list(self.loaded.values())))

    # ---- listings ------------------------------------------------------------------------------
    def cards(self) -> list[ModelCard]:
        """/v1/models: every loaded model, its aliases and its adapters."""
        return [card for served in self.loaded.values() for card in served.models.cards()]

    def card(self, model_id: str) -> ModelCard:
        for served in self.loaded.values():
            card = served.models.find_card(model_id)
            if card is not None:
                return card
        raise ModelNotFoundError(f"The model `{model_id}` does not exist.", "model", "model_not_found")

    def status(self) -> list[dict[str, Any]]:
        """/admin/models and the dashboard: every known model, loaded or not."""
        rows = []
        for name, spec in self.specs.items():
            served = self.loaded.get(name)
            state = ("loading" if name in self._loading else "unloaded") if served is None else \
                ("draining" if served.draining else "loaded")
            row: dict[str, Any] = {"name": name, "aliases": list(spec.aliases), "model": spec.config.model,
                                   "state": state, "default": name == self.default_name}
            if served is not None:
                row.update(in_flight=served.in_flight, memory_bytes=served.memory_bytes(),
                           load_seconds=round(served.load_seconds, 3),
                           idle_seconds=round(time.monotonic() - served.last_used, 1),
                           adapters=sorted(served.models.loras))
            elif name in self._measured:
                row["memory_bytes"] = self._measured[name]
            rows.append(row)
        return rows

    def memory_budget(self) -> dict[str, Any]:
        return {"budget_bytes": self.server.models_memory_budget,
                "used_bytes": self.used_bytes(),
                "loads": self.loads, "unloads": self.unloads}

