"""API server i > 0 of `--api-server-count N` (see api_servers.py): started by API server 0 as
`python -m tokenmill.entrypoints.openai.api_server_worker` with its settings pickled on stdin; serves the
shared port against the engine core API server 0 started, and exits when that server or the core is gone.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import sys

import msgspec


async def _serve(settings: dict) -> int:
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.engine.core_client import AttachedClient
    from tokenmill.engine.messages import EngineCoreReady
    from tokenmill.entrypoints.openai.api_server import build_app, serve_app
    from tokenmill.entrypoints.openai.api_servers import StatsForwarder, watch_parent
    from tokenmill.entrypoints.openai.rate_limit import RateLimiter
    from tokenmill.runner.host_memory import freeze_startup_heap

    server, frontend = settings["server"], settings["frontend"]
    ready = msgspec.msgpack.decode(settings["ready"], type=EngineCoreReady)
    client = AttachedClient(frontend, settings["input_address"], settings["output_address"], settings["core_pid"],
                            ready)
    engine = AsyncLLM(settings["config"], settings["log_level"], request_timeout=server.request_timeout,
                      stall_timeout=server.engine_stall_timeout, clients=[client])
    forwarder = StatsForwarder(frontend, settings["stats_address"], engine.num_rejected, engine.num_responses)
    engine.stat_loggers.append(forwarder)
    # Server 0's keys, attached to the buckets it shares (its keys file is not read again).
    limiter = RateLimiter(settings["api_keys"], shared_path=settings["rate_limits_path"])
    app = build_app(engine, server, relay_path=settings["relay_path"], limiter=limiter)
    freeze_startup_heap()
    sock = socket.socket(fileno=settings["socket_fd"])
    # Server 0 gone (killed without passing the drain on): drain too, as after SIGTERM.
    watch_parent(os.getppid(), lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        await serve_app(app, server, [sock], ignore_sigint=True)
    finally:
        await engine.shutdown()
        forwarder.close()
        limiter.close()
    return 1 if engine.errored else 0


def main() -> int:
    settings = pickle.loads(sys.stdin.buffer.read())
    from tokenmill.entrypoints.openai.cli_args import configure_logging

    configure_logging(settings["log_level"], not settings["server"].disable_log_requests)
    from tokenmill.entrypoints.openai import event_loop

    return event_loop.run(_serve(settings))


if __name__ == "__main__":
    sys.exit(main())
