"""Flags of `tokenmill serve` as a dataclass, ServerConfig (the engine's own flags are EngineConfig's; both
become argparse flags through entrypoints/engine_args.py), the API keys they resolve to, and the server's
logging setup. The server itself (`run_server`) lives in api_server.py,
which imports this module; nothing here imports the server back.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

from tokenmill.config import option, parse_memory_size, validate_options
from tokenmill.entrypoints.engine_args import add_option_args, options_from_args
from tokenmill.entrypoints.openai.rate_limit import KeyPolicy, RateLimiter, load_api_keys_file
from tokenmill.entrypoints.openai.reasoning import REASONING_PARSERS
from tokenmill.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS
from tokenmill.errors import InvalidRequestError

API_KEY_ENV = "TOKENMILL_API_KEY"
ADMIN_KEY_ENV = "TOKENMILL_ADMIN_KEY"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_STALL_TIMEOUT_S = 60.0

def _optional_seconds(value: str) -> Optional[float]:
    """A positive number of seconds, or 'none' for no limit."""
    if value.strip().lower() == "none":
        return None
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds or 'none', got {value!r}") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds or 'none', got {value!r}")
    return number


def _tuple(values: Any) -> tuple:
    return tuple(values)


@dataclass(frozen=True)
class ServerConfig:
    """`tokenmill serve`'s own flags (the engine's are EngineConfig's): each declared once here, with its
    default and help, and turned into argparse flags by entrypoints/engine_args.add_option_args."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on", bound="port")
    api_key: Optional[tuple[str, ...]] = option(
        None, f"require 'Authorization: Bearer KEY' on /v1/* (repeatable; default: ${API_KEY_ENV})", repeat=True,
        convert=_tuple, metavar="KEY")
    api_keys_file: Optional[str] = option(
        None, "JSON object: API key -> {tenant, requests_per_minute, tokens_per_minute} (all optional); over a "
        "limit: 429 with Retry-After; the tenant is the request's user for --scheduling-policy fair (adds to "
        "--api-key)", metavar="PATH")
    api_server_count: int = option(
        1, "HTTP frontend processes sharing the port and one engine core (tokenization, detokenization and "
        "streaming spread over N CPU cores); metrics count every server's requests", bound="positive", metavar="N")
    shutdown_timeout: float = option(30.0, "seconds in-flight requests may take to finish after SIGTERM/SIGINT",
                                     bound="non_negative")
    request_timeout: Optional[float] = option(
        None, "a request running longer is aborted and answered 504 (type 'timeout'); default: none",
        bound="positive", parse=_optional_seconds, metavar="SECONDS")
    engine_stall_timeout: Optional[float] = option(
        DEFAULT_STALL_TIMEOUT_S, "a started request that gets no output from the engine core for this long fails "
        "with 504 (type 'timeout', code 'engine_stalled'); 'none' turns the watchdog off", bound="positive",
        parse=_optional_seconds, metavar="SECONDS")
    max_request_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES, "larger request bodies get 413 (e.g. 16MiB)",
                                         convert=parse_memory_size)
    # Not --log-level: the `tokenmill` command already has that flag (upper-case levels) for all subcommands.
    uvicorn_log_level: str = option("info", "uvicorn's log level",
                                    choices=("trace", "debug", "info", "warning", "error", "critical"))
    disable_access_log: bool = option(False, "no uvicorn access log lines")
    disable_log_requests: bool = option(False, "no JSON line per finished request on the tokenmill.requests logger")
    disable_log_stats: bool = option(
        False, "no periodic throughput/queue/KV-cache log line (Prometheus /metrics and /stats stay)")
    enable_auto_tool_choice: bool = option(
        False, "with tools and tool_choice 'auto', parse the model's tool calls out of its reply (needs "
        "--tool-call-parser); named and 'required' tool choices work without it")
    tool_call_parser: Optional[str] = option(
        None, "the model's tool-call format: hermes (<tool_call>{json}</tool_call>: Qwen2.5/3, Hermes)",
        choices=tuple(TOOL_CALL_PARSERS))
    reasoning_parser: Optional[str] = option(
        None, "split a thinking model's replies into reasoning_content (<think>...</think>) and content: "
        "deepseek_r1 (reasoning until </think>, the template opens it) or qwen3 (reasoning when the reply "
        "opens <think>)", choices=tuple(REASONING_PARSERS))

    lora_modules: Optional[tuple[str, ...]] = option(
        None, "with --enable-lora: adapters served from the start, each as name=path or vLLM's JSON "
        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' (default base: the first model); a request "
        "names one in its `model`", repeat="many", convert=_tuple, metavar="NAME=PATH")

    # Several models: repeat --model, or list them in a models file.
    models_config: Optional[str] = option(
        None, "YAML or JSON file listing models to serve, each with its own engine options (model, "
        "served_model_name (a name or a list: the first answers, the others are aliases), aliases, load: false to "
        "load only on demand, lora_modules, any engine flag by its field name); the command line's engine flags "
        "are every model's defaults", metavar="PATH")
    admin_key: Optional[str] = option(
        None, f"enable /admin/models (load, unload, list models at run time) for 'Authorization: Bearer KEY' "
        f"(default: ${ADMIN_KEY_ENV}); without a key those routes do not exist", metavar="KEY")
    models_memory_budget: Optional[int] = option(
        None, "memory the loaded models may hold together (e.g. 8GiB); a load that does not fit first unloads "
        "the least recently used idle models", convert=parse_memory_size, metavar="SIZE")
    load_on_demand: bool = option(
        False, "a request for a known model that is not loaded (load: false, or unloaded for the memory budget) "
        "waits while it loads instead of getting 404")

    def __post_init__(self) -> None:
        validate_options(self)
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise InvalidRequestError(f"--enable-auto-tool-choice needs --tool-call-parser (one of: "
                                      f"{', '.join(TOOL_CALL_PARSERS)})", "tool_call_parser")

    @property
    def auto_tool_call_parser(self) -> Optional[str]:
        """The parser of tool calls in replies to tool_choice 'auto', when that is enabled."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None


def parse_lora_module(entry: str) -> tuple[str, str, Optional[str]]:
    """(name, path, base model or None) of a --lora-modules entry: name=path, or vLLM's JSON object
    {"name", "path", "base_model_name"}."""
    if entry.lstrip().startswith("{"):
        try:
            value = json.loads(entry)
            base = value.get("base_model_name")
            return str(value["name"]), str(value["path"]), None if base is None else str(base)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise InvalidRequestError(f"--lora-modules {entry!r}: a JSON entry needs \"name\" and \"path\"",
                                      "lora_modules") from None
    name, sep, path = entry.partition("=")
    if not sep or not name or not path:
        raise InvalidRequestError(f"--lora-modules {entry!r}: expected name=path", "lora_modules")
    return name, path, None


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_option_args(parser, ServerConfig, "server")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return options_from_args(ServerConfig, args)


def resolve_api_keys(server: ServerConfig) -> list[str]:
    """--api-key values win; otherwise $TOKENMILL_API_KEY; otherwise no authentication."""
    keys = [key for key in (server.api_key or ()) if key]
    if not keys and os.environ.get(API_KEY_ENV):
        keys = [os.environ[API_KEY_ENV]]
    return keys


def resolve_admin_key(server: ServerConfig) -> Optional[str]:
    """--admin-key, else $TOKENMILL_ADMIN_KEY, else none (no admin routes)."""
    return server.admin_key or os.environ.get(ADMIN_KEY_ENV) or None


def resolve_rate_limiter(server: ServerConfig) -> RateLimiter:
    """Every key the server accepts: --api-key / $TOKENMILL_API_KEY (no limits) and --api-keys-file.
    Raises ValueError for an unreadable or malformed keys file."""
    keys = {key: KeyPolicy() for key in resolve_api_keys(server)}
    if server.api_keys_file:
        keys.update(load_api_keys_file(server.api_keys_file))
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
