"""tokenmill's OpenAI server as a Ray Serve application: engine replicas across a Ray cluster, one front.

    pip install -e '.[ray]'
    serve run tokenmill.serve.ray_app:build_app model=/path/to/model replicas=2

```
 HTTP ─► Ray Serve proxy ─► OpenAIFront (tokenize, hash blocks) ─► DeploymentHandle ─► TokenmillEngine × N
                                        PrefixAwareRequestRouter picks the replica ──┘  (AsyncLLM + tokenmill's
                                                                                         FastAPI app, in-process)
```
Each `TokenmillEngine` replica holds one `AsyncLLM` (its engine core in a child process, as with
`tokenmill serve`) and tokenmill's own FastAPI app, and answers a request by running it through that app
(`http_bridge.call_app`): the same routes, validation, errors, SSE streams, `/metrics` and `/stats`.
`OpenAIFront` takes every HTTP request, renders and tokenizes the prompt, hashes its full blocks as the
prefix cache does (`routing.py`), and calls the engine deployment; Ray Serve then asks
`PrefixAwareRequestRouter` (`prefix_router.py`, the policy of `--data-parallel-size`) which replica takes
it. The response streams back chunk by chunk with an `x-tokenmill-replica` header naming the replica
that served it. Per-replica endpoints (`/metrics`, `/stats`, `/health`) answer for whichever replica the
request reached; Ray Serve itself checks every replica's health.

Arguments (`key=value` after the import path; `build_app` gets them as a dict):
- `replicas` (1): engine replicas; the initial count when autoscaling.
- `min_replicas`, `max_replicas`: either one turns on Ray Serve's autoscaling between them (a missing
  bound defaults to `replicas`), steered by `target_ongoing_requests` per replica (default: half of
  `max_ongoing_requests`); requests beyond `max_ongoing_requests` (default: the engine's `max_num_seqs`)
  wait in the front's queue, where the autoscaler sees them.
- `replica_cpus` (1), `replica_gpus` (0): Ray resources of one engine replica; on a CPU the engine
  runs `replica_cpus` torch threads unless `num_threads` says otherwise.
- `max_imbalance` (4): how many more requests in flight than the least-loaded replica the replica
  holding a prompt's prefix may have and still take it.
- `long_prompt_threshold`, `long_prompt_replicas` (1): length-aware lanes, as
  `--data-parallel-long-prompt-threshold` gives engine cores: prompts of more tokens than the threshold
  go to the last `long_prompt_replicas` replicas (in replica-id order), shorter ones to the others, and a
  long prompt that would queue in its lane borrows a short-lane replica carrying none
  (`long_prompt_borrowing=false` keeps them in their lane). The replicas are one deployment, so with
  borrowing each caps a long prompt's step (256 tokens, unless `long_prefill_token_threshold` says
  otherwise) so that a borrowed one leaves room for short prompts in every step.
- `front_replicas` (1), `front_max_ongoing_requests` (1000): the front deployment.
- `max_replicas_per_node`: at most this many engine replicas, and front replicas, on one Ray node
  (Ray Serve's own option; default: no limit). `replicas=2 max_replicas_per_node=1` puts the two on two
  machines, so that losing one machine leaves a replica serving; a replacement for a lost one waits
  for a node with room.
- any `tokenmill serve` flag, by its name with `_` or `-` (`model=...`, `max_num_seqs=32`,
  `kv_cache_memory_bytes=1G`, `enable_prefix_caching=false`, `api_key=...`): parsed by the same parser.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any, AsyncIterator, Callable, Optional, Union

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tokenmill.entrypoints.openai.cli_args import add_serve_args, configure_logging, server_config_from_args
from tokenmill.serve.http_bridge import HttpRequest, ResponseStart, call_app
from tokenmill.serve.prefix_router import PrefixAwareRequestRouter
from tokenmill.serve.routing import RoutedRequest, routed_request

logger = logging.getLogger("tokenmill.serve")

REPLICA_HEADER = b"x-tokenmill-replica"
ENGINE_DEPLOYMENT = "TokenmillEngine"
FRONT_DEPLOYMENT = "OpenAIFront"
ENGINE_SHUTDOWN_TIMEOUT_S = 30.0


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


# The application's own arguments (the rest are tokenmill serve flags) and their readers.
APP_ARGS: dict[str, Callable[[Any], Any]] = {
    "replicas": int, "min_replicas": int, "max_replicas": int, "target_ongoing_requests": float,
    "max_ongoing_requests": int, "replica_cpus": float, "replica_gpus": float, "max_imbalance": int,
    "long_prompt_threshold": int, "long_prompt_replicas": int, "long_prompt_borrowing": boolean,
    "front_replicas": int, "front_max_ongoing_requests": int, "max_replicas_per_node": int, "log_level": str,
}


# ---- arguments ---------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # a bad argument is an exception here, never an exit
        raise ValueError(message)


def server_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tokenmill.serve.ray_app", add_help=False)
    add_engine_args(parser)
    add_serve_args(parser)
    return parser


def server_argv(options: dict[str, Any]) -> list[str]:
    """tokenmill serve flags from `key=value` arguments: `max_num_seqs=8` -> `--max-num-seqs 8`, a
    boolean flag `name=true|false` -> `--name` / `--no-name` (or nothing), a list -> the flag repeated."""
    actions = server_parser()._option_string_actions
    argv: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        action = actions.get(flag)
        if action is None:
            raise ValueError(f"unknown argument {key!r}: not a tokenmill serve flag nor one of {', '.join(APP_ARGS)}")
        if action.nargs == 0:  # store_true, or --flag/--no-flag
            if boolean(value):
                argv.append(flag)
            elif isinstance(action, argparse.BooleanOptionalAction):
                argv.append("--no-" + key.replace("_", "-"))
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            argv += [flag, str(item)]
    return argv


def parse_server_args(argv: list[str]) -> argparse.Namespace:
    return server_parser().parse_args(argv)


def split_args(args: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the application's own arguments, converted; the tokenmill serve flags as an argv)."""
    app: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in args.items():
        name = key.replace("-", "_")
        if name in APP_ARGS:
            try:
                app[name] = APP_ARGS[name](value)
            except ValueError:
                kind = getattr(APP_ARGS[name], "__name__", "a valid value")
                raise ValueError(f"{key} must be {kind}, got {value!r}") from None
        else:
            rest[name] = value
    return app, server_argv(rest)


# ---- the engine replica ------------------------------------------------------------------------
class EngineReplica:
    """One AsyncLLM and tokenmill's FastAPI app over it; requests come from the front as data."""

    def __init__(self, argv: list[str], log_level: str = "INFO") -> None:
        from tokenmill.engine.async_llm import AsyncLLM
        from tokenmill.entrypoints.openai.api_server import build_app

        args = parse_server_args(argv)
        server = server_config_from_args(args)
        configure_logging(log_level, not server.disable_log_requests)
        config = engine_config_from_args(args)
        # Loads the model (its engine core is a child process of this replica); blocks until ready.
        self.engine = AsyncLLM.from_config(config, log_level, request_timeout=server.request_timeout,
                                           stall_timeout=server.engine_stall_timeout)
        self.app = build_app(self.engine, server)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def info(self) -> dict[str, Any]:
        """What the front needs to hash prompts the way this replica's prefix cache does."""
        ready = self.engine.ready
        assert ready is not None, "the engine answers once its cores are ready"
        return {"block_size": ready.block_size, "num_kv_blocks": ready.num_kv_blocks,
                "replica": self.replica_id, "served_model_name": self.engine.served_model_name}

    async def handle_http(self, routed: RoutedRequest) -> AsyncIterator[Union[ResponseStart, bytes]]:
        async for item in call_app(self.app, routed.http):
            if isinstance(item, ResponseStart):
                item.headers.append((REPLICA_HEADER, self.replica_id.encode()))
            yield item

    async def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine core died."""
        await self.engine.check_health()

    async def __del__(self) -> None:
        # Ray Serve awaits this when it stops the replica: the engine core process exits with it.
        try:
            await asyncio.wait_for(self.engine.shutdown(), ENGINE_SHUTDOWN_TIMEOUT_S)
        except Exception:
            logger.exception("engine shutdown failed")


# ---- the front ---------------------------------------------------------------------------------
class OpenAIFront:
    """Every HTTP request of the application: prompt tokens hashed, then on to the engine replica the
    router picks, the answer streamed back as it comes."""

    def __init__(self, engine: DeploymentHandle, argv: list[str]) -> None:
        from tokenmill.engine.input_processor import InputProcessor
        from tokenmill.model.loader import load_model_source

        args = parse_server_args(argv)
        config = engine_config_from_args(args)
        source = load_model_source(config.model, config.tokenizer)  # the tokenizer and config, no weights
        max_len = config.max_model_len or 1 << 30  # the replica checks lengths; routing needs none
        self.processor = InputProcessor(source.tokenizer, max_len, source.hf_config.vocab_size)
        self.engine = engine
        self.max_body_bytes = server_config_from_args(args).max_request_body_bytes
        self._cache_shape: Optional[tuple[int, int]] = None  # (block size, KV blocks) of the replicas

    async def _shape(self) -> tuple[int, int]:
        if self._cache_shape is None:
            info = await self.engine.info.remote()
            self._cache_shape = (info["block_size"], info["num_kv_blocks"])
        return self._cache_shape

    async def __call__(self, request: Request) -> Response:
        http = HttpRequest(request.method, request.url.path, request.url.query.encode("latin-1"),
                           list(request.headers.raw), await request.body(),
                           (request.client.host, request.client.port) if request.client else None)
        block_size, capacity = await self._shape()
        routed = routed_request(http, self.processor, block_size, capacity, self.max_body_bytes)
        stream = self.engine.options(stream=True).handle_http.remote(routed)
        start = await stream.__anext__()
        assert isinstance(start, ResponseStart)
        response = StreamingResponse(_rest(stream), status_code=start.status)
        response.raw_headers = start.headers  # the replica's own headers, content-length included
        return response


async def _rest(stream: Any) -> AsyncIterator[bytes]:
    async for chunk in stream:
        yield chunk


# ---- the application ---------------------------------------------------------------------------
def autoscaling_config(app: dict[str, Any], replicas: int, max_ongoing: int) -> Optional[dict[str, Any]]:
    """Ray Serve's autoscaling_config when min_replicas or max_replicas is given (None otherwise): a
    missing bound is `replicas`, which is also the initial count (kept within the bounds)."""
    if "min_replicas" not in app and "max_replicas" not in app:
        return None
    low = app.get("min_replicas", min(replicas, app.get("max_replicas", replicas)))
    high = app.get("max_replicas", max(replicas, low))
    if not 0 <= low <= high or high < 1:
        raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got {low} and {high}")
    return {"min_replicas": low, "max_replicas": high, "initial_replicas": min(max(replicas, low), high),
            "target_ongoing_requests": app.get("target_ongoing_requests", max(1.0, max_ongoing / 2))}


def build_app(args: dict[str, Any]) -> Any:
    """The Ray Serve application (`serve run tokenmill.serve.ray_app:build_app key=value ...`)."""
    app, argv = split_args(dict(args))
    server_args = parse_server_args(argv)  # a bad flag fails here, before any replica starts
    server_config_from_args(server_args)
    config = engine_config_from_args(server_args)
    replicas = app.get("replicas", 1)
    replica_cpus = app.get("replica_cpus", 1.0)
    replica_gpus = app.get("replica_gpus", 0.0)
    if config.num_threads is None and not replica_gpus:
        # Replicas on one node share its cores: each uses the CPUs Ray reserved for it.
        argv += ["--num-threads", str(max(1, int(replica_cpus)))]
    threshold = app.get("long_prompt_threshold")
    if threshold is not None and threshold <= 0:
        raise ValueError(f"long_prompt_threshold must be a positive number of tokens, got {threshold}")
    borrowing = app.get("long_prompt_borrowing", True)
    cap = config.borrowed_prompt_step_cap(threshold, borrowing)  # one deployment: every replica may lend
    if cap is not None:
        argv += ["--long-prefill-token-threshold", str(cap)]
    max_ongoing = app.get("max_ongoing_requests", config.max_num_seqs)
    autoscaling = autoscaling_config(app, replicas, max_ongoing)
    scaling = {"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": replicas}
    log_level = app.get("log_level", "INFO").upper()
    placement = {"max_replicas_per_node": app["max_replicas_per_node"]} if "max_replicas_per_node" in app else {}
    engine = serve.deployment(EngineReplica).options(
        name=ENGINE_DEPLOYMENT, max_ongoing_requests=max_ongoing,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        request_router_config=RequestRouterConfig(
            # Ray's annotation says dict; its code (2.52) takes the router class as documented.
            request_router_class=PrefixAwareRequestRouter,  # type: ignore[arg-type]
            request_router_kwargs={"max_imbalance": app.get("max_imbalance", 4), "long_prompt_threshold": threshold,
                                   "long_prompt_replicas": app.get("long_prompt_replicas", 1),
                                   "long_prompt_borrowing": borrowing}),
        **scaling, **placement)
    front = serve.deployment(OpenAIFront).options(
        name=FRONT_DEPLOYMENT, num_replicas=app.get("front_replicas", 1),
        max_ongoing_requests=app.get("front_max_ongoing_requests", 1000), ray_actor_options={"num_cpus": 0},
        **placement)
    return front.bind(engine.bind(argv, log_level), argv)
