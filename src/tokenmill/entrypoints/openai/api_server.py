"""The OpenAI-compatible HTTP server: FastAPI routes over one `AsyncLLM`, run by uvicorn.

`build_app(engine, server)` makes the app; `serve_app(app, server)` runs it and drains on SIGTERM/SIGINT:
new requests get 503 while in-flight ones finish (up to --shutdown-timeout), then the server exits.
`run_server(args)` loads the engine, serves and shuts it down: `tokenmill serve [flags]`, or
`python -m tokenmill.entrypoints.openai.api_server [flags]`.

Observability: the engine's stat loggers (Prometheus exporter, sliding-window stats, periodic log line)
are attached here; `/metrics`, `/stats`, the web dashboard `/` and its `/static/*` files need no API key
(the key guards `/v1/*` only).
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import math
import os
import signal
import socket
import sys
import time
from importlib import metadata, resources
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Optional

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.staticfiles import StaticFiles

from tokenmill.entrypoints.engine_args import add_engine_args
from tokenmill.entrypoints.openai import event_loop
from tokenmill.entrypoints.openai.api_servers import STOP_GRACE_S, ApiServers, StatsCollector, listening_socket
from tokenmill.entrypoints.openai.cli_args import (
    ServerConfig,
    add_serve_args,
    configure_logging,
    resolve_admin_key,
    resolve_rate_limiter,
    server_config_from_args,
)
from tokenmill.entrypoints.openai.errors import error_response, install_exception_handlers
from tokenmill.entrypoints.openai.middleware import GatewayMiddleware, ServerLifecycle, bearer_token
from tokenmill.entrypoints.openai.model_pool import ModelPool
from tokenmill.entrypoints.openai.model_specs import SpecReader, model_specs, with_lora_modules
from tokenmill.entrypoints.openai.protocol import (
    AdminUnloadModelRequest,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)
from tokenmill.entrypoints.openai.rate_limit import RateLimiter
from tokenmill.errors import (
    AdminAuthError,
    InvalidRequestError,
    ModelLoadError,
    ServiceUnavailableError,
    TokenmillError,
)
from tokenmill.metrics.prometheus import ServerMetrics, http_response_key, render_together
from tokenmill.runner.host_memory import freeze_startup_heap

if TYPE_CHECKING:
    from tokenmill.engine.async_llm import AsyncLLM

logger = logging.getLogger("tokenmill.server")

# How long a server whose engine core died keeps answering (503 on /health) before it exits.
ENGINE_DEAD_EXIT_DELAY_S = 2.0
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)}
# The dashboard ships as package data of tokenmill.web (pyproject package-data), found wherever installed.
STATIC_DIR = Path(str(resources.files("tokenmill.web") / "static"))
_NO_CACHE = {"Cache-Control": "no-cache"}
ENGINE_SHUTDOWN_TIMEOUT_S = 30.0
# After the shutdown timeout, how long requests failed with 503 get to write their answers.
SHUTDOWN_ANSWER_GRACE_S = 2.0
_STREAMING = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE chunks with stream=true"}}


def _version() -> str:
    try:
        return metadata.version("tokenmill")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def build_app(engine: "AsyncLLM | ModelPool", server: Optional[ServerConfig] = None,
              relay_path: Optional[str] = None, limiter: Optional[RateLimiter] = None) -> FastAPI:
    """engine: the server's models (a ModelPool), or one engine already started. server: the server's flags
    (default: every default). relay_path: API server i > 0 of --api-server-count, whose /metrics and /stats are
    server 0's, fetched over this unix socket (its own request statistics are forwarded there,
    api_servers.StatsForwarder). limiter: the API keys and their buckets (default: read from the flags; with
    several API servers, the buckets they share)."""
    server = server if server is not None else ServerConfig()
    pool = engine if isinstance(engine, ModelPool) else ModelPool.of_engine(server, engine)
    lifecycle = ServerLifecycle()
    app = FastAPI(title="tokenmill", version=_version(),
                  description="OpenAI-compatible API of the tokenmill inference engine")
    app.state.engine = pool  # the draining server polls its engine cores and fails what is left at shutdown
    app.state.lifecycle = lifecycle
    install_exception_handlers(app)
    _add_openai_routes(app, pool)
    _add_server_routes(app, pool, lifecycle)
    admin_key = resolve_admin_key(server)
    if admin_key and pool.spec_reader is not None:
        _add_admin_routes(app, pool, admin_key)
    if relay_path is None:
        _add_observability(app, pool)
    else:
        _add_relayed_observability(app, relay_path)
    limiter = limiter if limiter is not None else resolve_rate_limiter(server)
    app.state.rate_limiter = limiter  # the token limits are charged by the serving layer

    def rejected(reason: str) -> None:
        # Refused before a model is chosen: counted under the default model.
        served = pool.default
        if served is not None:
            served.engine.num_rejected[reason] = served.engine.num_rejected.get(reason, 0) + 1

    # Responses counted per route, method and status class (vLLM's http_requests_total); paths that are no
    # route of this app count as one handler, so a scan of random URLs cannot grow the series.
    handlers = {route.path for route in app.routes if "{" not in getattr(route, "path", "{")}

    def responded(path: str, method: str, status: int) -> None:
        key = http_response_key(path if path in handlers else "other", method, status)
        pool.num_responses[key] = pool.num_responses.get(key, 0) + 1

    app.add_middleware(GatewayMiddleware, lifecycle=lifecycle, limiter=limiter,
                       max_body_bytes=server.max_request_body_bytes, on_rejected=rejected, on_response=responded)
    return app


def _add_openai_routes(app: FastAPI, pool: ModelPool) -> None:
    """The /v1 routes: each request goes to the model (or adapter) its `model` names."""

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_STREAMING, **_ERRORS})
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        async with pool.use(body.model) as served:
            return await served.completions.create_completion(body, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**_STREAMING, **_ERRORS})
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        async with pool.use(body.model) as served:
            return await served.chat.create_chat_completion(body, raw_request)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models() -> ModelList:
        return ModelList(data=pool.cards())

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model_id: str) -> ModelCard:
        return pool.card(model_id)

    if any(spec.config.enable_lora for spec in pool.specs.values()):
        # vLLM's endpoints and answers (plain text); with --api-key they need a key, like every /v1 route.
        @app.post("/v1/load_lora_adapter", responses=_ERRORS)
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            pool.load_lora(body.lora_name, body.lora_path, body.base_model_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter", responses=_ERRORS)
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            pool.unload_lora(body.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _add_server_routes(app: FastAPI, pool: ModelPool, lifecycle: ServerLifecycle) -> None:
    version = _version()

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        async with pool.use(body.model) as served:
            return served.tokenization.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        async with pool.use(body.model) as served:
            return served.tokenization.detokenize(body)

    @app.get("/health", responses={200: {"description": "the engine can serve"}, 503: {"model": ErrorResponse}})
    async def health() -> Response:
        if not pool.poll_cores():
            return error_response(503, "the engine has stopped", "service_unavailable", code="engine_dead")
        if lifecycle.draining:
            return error_response(503, "the server is shutting down", "service_unavailable", code="shutting_down")
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse)
    async def get_version() -> VersionResponse:
        return VersionResponse(version=version)


def _add_admin_routes(app: FastAPI, pool: ModelPool, admin_key: str) -> None:
    """/admin/models: list, load and unload models at run time, for 'Authorization: Bearer <admin key>' only."""

    def authorize(request: Request) -> None:
        token = bearer_token(request.headers.get("authorization", "").encode())
        if token is None or not hmac.compare_digest(token, admin_key.encode()):
            raise AdminAuthError("Incorrect or missing admin key; send 'Authorization: Bearer <admin key>'.",
                                 code="invalid_admin_key")

    @app.get("/admin/models", responses=_ERRORS)
    async def list_all_models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse(_jsonable({"models": pool.status(), "memory": pool.memory_budget()}))

    @app.post("/admin/models/load", responses=_ERRORS)
    async def load_model(request: Request) -> JSONResponse:
        """Body: {"model": a known model's name} loads it again; {"model": PATH, "served_model_name": ...,
        any engine option...} adds a model (the command line's engine flags are its defaults)."""
        authorize(request)
        try:
            body = await request.json()
        except ValueError:
            raise InvalidRequestError("the body must be a JSON object", "model") from None
        if not isinstance(body, dict) or not isinstance(body.get("model"), str) or not body["model"]:
            raise InvalidRequestError("the body must be a JSON object with a \"model\" (a path or a known "
                                      "model's name)", "model")
        try:
            if set(body) == {"model"} and body["model"] in pool.specs:
                served = await pool.load(body["model"])
            else:
                served = await pool.add(pool.spec_reader.spec(body))
        except ModelLoadError as exc:  # a bad path or an unsupported model: the admin's input, said plainly
            raise InvalidRequestError(exc.message, "model") from None
        return JSONResponse(_jsonable({"model": served.name, "load_seconds": round(served.load_seconds, 3),
                                       "memory_bytes": served.memory_bytes()}))

    @app.post("/admin/models/unload", responses=_ERRORS)
    async def unload_model(request: Request, body: AdminUnloadModelRequest) -> JSONResponse:
        """Drains the model (new requests for it: 503 with Retry-After) and stops it; then requests for it get 404
        (`model_not_found`, or `model_not_loaded` with "forget": false)."""
        authorize(request)
        started = time.monotonic()
        await pool.unload(pool.name_of(body.model), forget=body.forget, timeout_s=body.timeout)
        return JSONResponse({"model": body.model, "unloaded": True,
                             "unload_seconds": round(time.monotonic() - started, 3)})


def _add_observability(app: FastAPI, pool: ModelPool) -> None:
    """Serves what each model's stat loggers (attached by the pool) collect."""
    server_metrics = ServerMetrics()

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def metrics() -> Response:
        server_metrics.record_responses(pool.num_responses)
        registries = [server_metrics.registry]
        for served in list(pool.loaded.values()):
            served.prometheus.record_rejections(served.engine.num_rejected)
            if served.engine.router is not None:
                served.prometheus.record_replicas(served.engine.replica_stats())
            registries.append(served.prometheus.registry)
        return Response(render_together(registries), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats", responses={200: {"description": "engine statistics of one model (?model=NAME, default: the "
                                                       "first): running, waiting, kv_cache_usage, latency "
                                                       "percentiles over a sliding window, history; and `models`, "
                                                       "every model the server knows"}})
    async def stats(model: Optional[str] = None) -> JSONResponse:
        served = pool.stats_model(model)
        body = served.window.snapshot()
        live = served.engine.get_stats()  # read now, not at the last step
        body.update(live)
        queries, hits = live["prefix_cache_queries"], live["prefix_cache_hits"]
        body["prefix_cache_hit_rate"] = hits / queries if queries else None
        body["model"] = served.name
        body["max_model_len"] = served.engine.max_model_len
        body["models"] = pool.status()
        return JSONResponse(_jsonable(body), headers=_NO_CACHE)

    _add_dashboard(app)


def _add_dashboard(app: FastAPI) -> None:
    """The web dashboard `/` and its `/static/*` files (it reads /stats)."""

    @app.get("/", include_in_schema=False)
    async def dashboard() -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers=_NO_CACHE)

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


def _add_relayed_observability(app: FastAPI, relay_path: str) -> None:
    """API server i > 0: /metrics and /stats answered with API server 0's (which counts every server's
    requests), the dashboard served here."""
    import httpx

    client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=relay_path), base_url="http://api-server-0",
                               timeout=10.0)

    async def relay(path: str) -> Response:
        try:
            answer = await client.get(path)
        except httpx.HTTPError as exc:
            return error_response(503, f"API server 0 did not answer: {exc}", "service_unavailable",
                                  code="api_server_unavailable")
        return Response(answer.content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type"), headers=_NO_CACHE)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def metrics() -> Response:
        return await relay("/metrics")

    @app.get("/stats", responses={200: {"description": "engine statistics (API server 0's, every server's requests)"}})
    async def stats() -> Response:
        return await relay("/stats")

    _add_dashboard(app)


def _jsonable(value: Any) -> Any:
    """JSON has no NaN or Infinity; a stats gauge that is not finite reads as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


# ---- running -----------------------------------------------------------------------------------
class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains instead of exiting at once; a second one forces exit.

    uvicorn's own handling closes the listening socket first (new clients see a refused connection) and
    re-raises the signal afterwards (the exit status would be -SIGTERM); draining here keeps answering
    503 until in-flight requests are done and then exits normally with status 0.
    """

    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle, shutdown_timeout_s: float,
                 on_drain: Optional[Callable[[], None]] = None,
                 failure: Optional[Callable[[], Optional[str]]] = None, ignore_sigint: bool = False) -> None:
        """on_drain: called once when the drain starts (API server 0 passes SIGTERM on to the others).
        failure: polled every tick; a reason it returns starts a drain, and the server then exits non-zero
        (API server 0: another API server died). ignore_sigint: API servers 1..N-1 of --api-server-count
        leave Ctrl-C (sent to the whole process group) to server 0, which passes the drain on as SIGTERM;
        taking both would count as the second, forcing signal."""
        super().__init__(config)
        self.lifecycle = lifecycle
        self.shutdown_timeout_s = shutdown_timeout_s
        self.on_drain = on_drain
        self.failure = failure
        self.failed: Optional[str] = None
        self.ignore_sigint = ignore_sigint
        self._drain_deadline: Optional[float] = None
        self._drain_logged = False
        self._dead_since: Optional[float] = None
        self._failed_at: Optional[float] = None

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        # Runs as a signal handler: only set flags here (no logging, no awaiting).
        if sig == signal.SIGINT and self.ignore_sigint:
            return
        if self.lifecycle.draining:
            self.force_exit = True
            self.should_exit = True
            return
        self.lifecycle.draining = True
        self._drain_deadline = time.monotonic() + self.shutdown_timeout_s

    async def on_tick(self, counter: int) -> bool:
        engine = getattr(getattr(self.config.app, "state", None), "engine", None)
        if self.failure is not None and self.failed is None and not self.should_exit:
            self.failed = self.failure()
            if self.failed is not None:
                logger.error("%s; the server drains and exits", self.failed)
                self.handle_exit(signal.SIGTERM, None)
        if engine is not None and not engine.poll_cores() and not self.should_exit:
            # The engine core died: requests in flight have already failed. Keep answering (503 on
            # /health, errors on requests) for a moment, so load balancers and clients see why, then
            # exit non-zero (run_server) for a supervisor to restart the server.
            if self._dead_since is None:
                logger.error("the engine core died; the server exits in %.0f s", ENGINE_DEAD_EXIT_DELAY_S)
                self._dead_since = time.monotonic()
                self.lifecycle.draining = True
            elif time.monotonic() - self._dead_since >= ENGINE_DEAD_EXIT_DELAY_S:
                self.config.timeout_graceful_shutdown = 1
                self.should_exit = True
            return await super().on_tick(counter)
        if self.lifecycle.draining and not self.should_exit:
            inflight = self.lifecycle.inflight
            if not self._drain_logged:
                self._drain_logged = True
                logger.info("shutting down: refusing new requests, waiting for %d in flight (up to %.0f s)",
                            inflight, self.shutdown_timeout_s)
                if self.on_drain is not None:
                    self.on_drain()
            now = time.monotonic()
            if inflight and self._failed_at is None and now >= (self._drain_deadline or 0.0):
                # Requests still running end with a 503 (a stream: an error event, then [DONE]) rather
                # than being cut off; they get a moment to write that answer.
                logger.warning("shutdown timeout reached; ending %d requests with 503", inflight)
                self._failed_at = now
                if engine is not None:
                    engine.fail_all(ServiceUnavailableError(
                        "the server shut down before this request finished", code="shutting_down"))
            if inflight == 0 or (self._failed_at is not None and now - self._failed_at >= SHUTDOWN_ANSWER_GRACE_S):
                # Whatever still runs gets a moment more and is then cancelled (which aborts it).
                self.config.timeout_graceful_shutdown = 1
                self.should_exit = True
        return await super().on_tick(counter)


async def serve_app(app: FastAPI, server: ServerConfig, sockets: Optional[list[socket.socket]] = None,
                    on_drain: Optional[Callable[[], None]] = None, ignore_sigint: bool = False,
                    failure: Optional[Callable[[], Optional[str]]] = None) -> DrainingServer:
    """sockets: already bound (--api-server-count: the shared port, and server 0's private relay socket).
    Returns the server once it has stopped."""
    config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_level=server.uvicorn_log_level,
        access_log=not server.disable_access_log,
        lifespan="off",
    )
    draining = DrainingServer(config, app.state.lifecycle, server.shutdown_timeout, on_drain, failure, ignore_sigint)
    await draining.serve(sockets=sockets)
    return draining


def run_server(args: argparse.Namespace) -> int:
    """Loads the models, serves until SIGTERM/SIGINT, drains, shuts the engines down. Returns the exit code."""
    # --log-level belongs to the `tokenmill` command, not to `serve`'s flags.
    log_level = getattr(args, "log_level", None) or "INFO"
    try:
        server = server_config_from_args(args)
    except TokenmillError as exc:
        configure_logging(log_level)
        logger.error("invalid server settings: %s", exc.message)
        return 2
    configure_logging(log_level, not server.disable_log_requests)
    try:
        resolve_rate_limiter(server)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    try:
        reader = SpecReader(args)
        specs = with_lora_modules(model_specs(args, server.models_config, reader), server.lora_modules)
        if len(specs) > 1 and server.api_server_count > 1:
            raise InvalidRequestError("--api-server-count > 1 serves one model", "api_server_count")
    except TokenmillError as exc:
        logger.error("invalid engine settings: %s", exc.message)
        return 2
    try:
        return event_loop.run(_serve(server, specs, reader, log_level))
    except KeyboardInterrupt:  # Ctrl-C while the model was still loading
        return 130


async def _serve(server: ServerConfig, specs: list, reader: SpecReader, log_level: str) -> int:
    from tokenmill.engine.async_llm import AsyncLLM

    count = server.api_server_count

    def start_engine(config, load_quietly: bool) -> AsyncLLM:
        # The engine core starts in its own process; this returns once it has loaded the model.
        return AsyncLLM.from_config(config, log_level, request_timeout=server.request_timeout,
                                    stall_timeout=server.engine_stall_timeout, api_server_count=count,
                                    load_quietly=load_quietly)

    pool = ModelPool(server, specs, start_engine, spec_reader=reader)
    try:
        for spec in specs:
            if spec.load_at_start:
                await pool.load(spec.name, blocking=True)
    except TokenmillError as exc:
        logger.error("cannot start the engine: %s", exc.message)
        await pool.shutdown()
        return 1
    engine = pool.default.engine
    servers: Optional[ApiServers] = None
    collector = None
    failed = False
    sockets = None
    try:
        limiter = resolve_rate_limiter(server)
        if count > 1:
            # One set of buckets for every API server: a key's limit holds for the whole server. API servers
            # 1..N-1 forward their HTTP answers into the engine's counts.
            limiter.share(os.path.join(engine.client.run_directory, "rate-limits"))
            pool.num_responses = engine.num_responses
        app = build_app(pool, server, limiter=limiter)
        freeze_startup_heap()
        if count > 1:
            # Bound once the model is loaded, as uvicorn binds for a single server: until then connections
            # are refused rather than left waiting.
            host, port = server.host, server.port
            try:
                sock = listening_socket(host, port)
            except OSError as exc:
                logger.error("cannot listen on %s:%s: %s", host, port, exc)
                return 1
            directory = engine.client.run_directory
            relay_path = os.path.join(directory, "api-server-0.sock")
            relay = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            relay.bind(relay_path)
            relay.listen(64)
            sockets = [sock, relay]
            collector = StatsCollector(directory, engine)
            collector.start(asyncio.get_running_loop())
            servers = ApiServers(server, specs[0].config, engine, sock, collector.address, relay_path, log_level,
                                 limiter)
            engine.ready_for_api_servers = None
            logger.info("%d API servers on port %s (pids %s and this one)", count, server.port,
                        ", ".join(str(pid) for pid in servers.pids))
        draining = await serve_app(app, server, sockets, on_drain=servers.drain if servers is not None else None,
                                   failure=servers.failure if servers is not None else None)
        failed = draining.failed is not None
    finally:
        if servers is not None:  # they drain their own requests, which the core still serves
            servers.stop(server.shutdown_timeout + STOP_GRACE_S)
        if collector is not None:
            collector.close()
        try:
            await asyncio.wait_for(pool.shutdown(), ENGINE_SHUTDOWN_TIMEOUT_S)
        except Exception:
            logger.exception("engine shutdown failed")
    # A dead engine core (or API server) ends the server with a failure, so a supervisor restarts it.
    return 1 if pool.errored or failed else 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenmill.entrypoints.openai.api_server",
                                     description="Serve a model over an OpenAI-compatible HTTP API.")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="tokenmill's own log level")
    add_engine_args(parser, repeatable=("model",))
    add_serve_args(parser)
    return run_server(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
