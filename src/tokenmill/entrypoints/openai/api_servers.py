"""`--api-server-count N`: N HTTP frontends on one port in front of one engine core (vLLM's flag).

API server 0 is the process `tokenmill serve` runs in: it binds the port, starts the engine core (which
connects to a pair of zmq sockets per API server) and then starts servers 1..N-1 as fresh interpreters
(`python -m tokenmill.entrypoints.openai.api_server_worker`), handing each the listening socket, its
socket pair, the core's pid and the core's ready message (with the tokenizer's files). The kernel spreads
connections over the N processes; each tokenizes, detokenizes and streams its own requests, so the
frontend's work (HTTP, JSON, detokenization) uses N CPU cores.

    clients ──► :port ──► API server 0 ─┐  (requests and aborts: PUSH ─► the core's one PULL)
                     ├──► API server 1 ─┼─► engine core ─► each request's outputs to the server that
                     └──► API server 2 ─┘                  sent it; the scheduler's stats to all

One set of metrics: servers 1..N-1 send each step's request statistics (and their admission refusals) to
server 0, whose Prometheus exporter and sliding-window stats count every server's requests; their
`/metrics` and `/stats` answer with server 0's, fetched over a private unix socket. API keys' rate limits
hold for the whole server: the N share one set of buckets (rate_limit.SharedBucketState).
"""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

import msgspec
import zmq

from tokenmill.entrypoints.openai.cli_args import ServerConfig
from tokenmill.entrypoints.openai.rate_limit import RateLimiter
from tokenmill.metrics.stats import IterationStats, SchedulerSnapshot

logger = logging.getLogger("tokenmill.server")

STOP_GRACE_S = 5.0  # after the drain: how long a server may take to exit before it is killed


class ForwardedStats(msgspec.Struct):
    """What an API server i > 0 sends server 0 after each step it saw."""

    frontend: int
    iteration: IterationStats
    num_rejected: dict[str, int]  # cumulative, per reason
    # cumulative HTTP answers, per 'handler method Nxx'
    num_responses: dict[str, int] = msgspec.field(default_factory=dict)


def listening_socket(host: str, port: int) -> socket.socket:
    """The port every API server accepts on (inherited by servers 1..N-1)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class StatsForwarder:
    """A stat logger of API server i > 0: each step's request statistics go to server 0."""

    def __init__(self, frontend: int, address: str, num_rejected: dict[str, int],
                 num_responses: Optional[dict[str, int]] = None) -> None:
        self.frontend = frontend
        self.num_rejected = num_rejected  # the engine's running totals (read at each send)
        self.num_responses = num_responses if num_responses is not None else {}
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 10_000)
        self._socket.connect(address)
        self._encoder = msgspec.msgpack.Encoder()

    def record(self, scheduler: SchedulerSnapshot, iteration: IterationStats) -> None:
        message = ForwardedStats(self.frontend, iteration, dict(self.num_rejected), dict(self.num_responses))
        try:
            self._socket.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError:  # server 0 is gone or far behind: statistics are not worth blocking for
            pass

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()


def _add_new(totals: dict[str, int], seen: dict[int, dict[str, int]], frontend: int,
             cumulative: dict[str, int]) -> None:
    """Adds to `totals` what a server's cumulative counts gained since its last message."""
    before = seen.get(frontend, {})
    for key, total in cumulative.items():
        added = total - before.get(key, 0)
        if added > 0:
            totals[key] = totals.get(key, 0) + added
    seen[frontend] = cumulative


class StatsCollector:
    """API server 0's side: servers 1..N-1's statistics, recorded by server 0's stat loggers on its
    event loop (with the core's latest scheduler snapshot), and their refusals added to its totals."""

    def __init__(self, directory: str, engine: Any) -> None:
        self.address = f"ipc://{directory}/api-stats"
        self.engine = engine
        self._rejected: dict[int, dict[str, int]] = {}  # per server: its cumulative refusals
        self._responses: dict[int, dict[str, int]] = {}  # per server: its cumulative HTTP answers
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address)
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._thread = threading.Thread(target=self._receive, args=(loop,), name="tokenmill-api-stats", daemon=True)
        self._thread.start()

    def _receive(self, loop: asyncio.AbstractEventLoop) -> None:
        decoder = msgspec.msgpack.Decoder(ForwardedStats)
        while not self._stopping.is_set():
            try:
                if not self._socket.poll(200):
                    continue
                message = decoder.decode(self._socket.recv())
            except (zmq.ZMQError, msgspec.DecodeError):
                return
            loop.call_soon_threadsafe(self._record, message)

    def _record(self, message: ForwardedStats) -> None:
        engine = self.engine
        _add_new(engine.num_rejected, self._rejected, message.frontend, message.num_rejected)
        _add_new(engine.num_responses, self._responses, message.frontend, message.num_responses)
        engine.record_iteration(message.iteration)

    def close(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self._socket.close(0)
        self._context.term()


class ApiServers:
    """API servers 1..N-1, each a fresh interpreter given its settings pickled on stdin."""

    def __init__(self, server: ServerConfig, config: Any, engine: Any, sock: socket.socket,
                 stats_address: str, relay_path: str, log_level: str, limiter: RateLimiter) -> None:
        client = engine.client
        ready = msgspec.msgpack.encode(engine.ready_for_api_servers)
        self.processes: list[subprocess.Popen] = []
        self._signalled = False
        for index in range(1, len(client.frontend_addresses)):
            input_address, output_address = client.frontend_addresses[index]
            payload = dict(server=server, config=config, frontend=index, input_address=input_address,
                           output_address=output_address, core_pid=client.process.pid, ready=ready,
                           stats_address=stats_address, relay_path=relay_path, socket_fd=sock.fileno(),
                           log_level=log_level, api_keys=limiter.policies, rate_limits_path=limiter.shared_path)
            process = subprocess.Popen([sys.executable, "-m", "tokenmill.entrypoints.openai.api_server_worker"],
                                       stdin=subprocess.PIPE, pass_fds=(sock.fileno(),))
            process.stdin.write(pickle.dumps(payload))
            process.stdin.close()
            self.processes.append(process)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def failure(self) -> Optional[str]:
        """Why the group cannot go on: an API server exited while nobody asked it to (its requests are
        lost and the port serves on with fewer processes; a supervisor should restart the whole server)."""
        if self._signalled:
            return None
        for index, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                return f"API server {index} (pid {process.pid}) exited with status {process.returncode}"
        return None

    def drain(self) -> None:
        """SIGTERM, once: each server refuses new requests and finishes its own (a second one would cut
        them off)."""
        if self._signalled:
            return
        self._signalled = True
        for process in self.processes:
            if process.poll() is None:
                try:
                    process.terminate()
                except ProcessLookupError:
                    pass

    def stop(self, timeout_s: float) -> None:
        """Drain (if not yet), wait for them to exit, kill those that do not."""
        self.drain()
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("API server %d did not stop in time; killing it", process.pid)
                process.kill()
                process.wait(5)


def watch_parent(parent: int, on_gone: Callable[[], None], interval_s: float = 1.0) -> threading.Thread:
    """API server i > 0 stops when server 0 (its parent) is gone."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        on_gone()

    thread = threading.Thread(target=watch, name="tokenmill-parent-watch", daemon=True)
    thread.start()
    return thread
