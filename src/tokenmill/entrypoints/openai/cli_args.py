"""Flags of `tokenmill serve` (the engine's own flags come from entrypoints/engine_args.py), the API keys
they resolve to, and the server's logging setup. The server itself (`run_server`) lives in api_server.py,
which imports this module; nothing here imports the server back.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

from tokenmill.config import parse_memory_size
from tokenmill.entrypoints.openai.rate_limit import KeyPolicy, RateLimiter, load_api_keys_file
from tokenmill.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS

API_KEY_ENV = "TOKENMILL_API_KEY"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_STALL_TIMEOUT_S = 60.0

def _size(value: str) -> int:
    try:
        return parse_memory_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port(value: str) -> int:
    if not value.isdigit() or not 0 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {value!r}")
    return int(value)


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return int(value)


def _non_negative(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number of seconds, got {value!r}")
    return number


def _optional_seconds(value: str) -> Optional[float]:
    """A positive number of seconds, or 'none' for no limit."""
    if value.strip().lower() == "none":
        return None
    number = _non_negative(value)
    if number == 0:
        raise argparse.ArgumentTypeError("expected a positive number of seconds, or 'none'")
    return number


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=_port, default=8000)
    group.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help=f"require 'Authorization: Bearer KEY' on /v1/* (repeatable; default: ${API_KEY_ENV})")
    group.add_argument("--api-keys-file", default=None, metavar="PATH",
                       help="JSON object: API key -> {tenant, requests_per_minute, tokens_per_minute} (all optional); "
                       "over a limit: 429 with Retry-After; the tenant is the request's user for --scheduling-policy "
                       "fair (adds to --api-key)")
    group.add_argument("--api-server-count", type=_positive_int, default=1, metavar="N",
                       help="HTTP frontend processes sharing the port and one engine core (tokenization, "
                       "detokenization and streaming spread over N CPU cores); metrics count every server's requests")
    group.add_argument("--shutdown-timeout", type=_non_negative, default=30.0,
                       help="seconds in-flight requests may take to finish after SIGTERM/SIGINT")
    group.add_argument("--request-timeout", type=_optional_seconds, default=None, metavar="SECONDS",
                       help="a request running longer is aborted and answered 504 (type 'timeout'); default: none")
    group.add_argument("--engine-stall-timeout", type=_optional_seconds, default=DEFAULT_STALL_TIMEOUT_S,
                       metavar="SECONDS", help="a started request that gets no output from the engine core for this "
                       "long fails with 504 (type 'timeout', code 'engine_stalled'); 'none' turns the watchdog off")
    group.add_argument("--max-request-body-bytes", type=_size, default=DEFAULT_MAX_BODY_BYTES,
                       help="larger request bodies get 413 (e.g. 16MiB)")
    # Not --log-level: the `tokenmill` command already has that flag (upper-case levels) for all subcommands.
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=["trace", "debug", "info", "warning", "error", "critical"])
    group.add_argument("--disable-access-log", action="store_true", help="no uvicorn access log lines")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="no JSON line per finished request on the tokenmill.requests logger")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic throughput/queue/KV-cache log line (Prometheus /metrics and /stats stay)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="with tools and tool_choice 'auto', parse the model's tool calls out of its reply "
                       "(needs --tool-call-parser); named and 'required' tool choices work without it")
    group.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS),
                       help="the model's tool-call format: hermes (<tool_call>{json}</tool_call>: Qwen2.5/3, Hermes)")


def resolve_api_keys(args: Optional[argparse.Namespace]) -> list[str]:
    """--api-key values win; otherwise $TOKENMILL_API_KEY; otherwise no authentication."""
    keys = [key for key in (getattr(args, "api_key", None) or []) if key]
    if not keys and os.environ.get(API_KEY_ENV):
        keys = [os.environ[API_KEY_ENV]]
    return keys


def resolve_rate_limiter(args: Optional[argparse.Namespace]) -> RateLimiter:
    """Every key the server accepts: --api-key / $TOKENMILL_API_KEY (no limits) and --api-keys-file.
    Raises ValueError for an unreadable or malformed keys file."""
    keys = {key: KeyPolicy() for key in resolve_api_keys(args)}
    path = getattr(args, "api_keys_file", None)
    if path:
        keys.update(load_api_keys_file(path))
    return RateLimiter(keys)


def configure_logging(level: str = "INFO", log_requests: bool = True) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=str(level).upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    requests = logging.getLogger("tokenmill.requests")
    if not requests.handlers:
        # The request log is one JSON object per line, so it gets no prefix.
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        requests.addHandler(handler)
        requests.propagate = False
    requests.setLevel(logging.INFO if log_requests else logging.WARNING)
