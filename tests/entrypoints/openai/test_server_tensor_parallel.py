"""A server with --tensor-parallel-size 2: a worker killed under load fails the requests in flight (never a
hang), /health turns 503, the server exits non-zero, and no worker is left; SIGTERM leaves none either."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from proc_util import child_pids, descendants, is_alive, kill_under_load

TP_ARGS = ["--max-model-len", "1024", "--num-kv-blocks", "128", "--tensor-parallel-size", "2"]


def _workers(server) -> tuple[int, list[int], list[int]]:
    """The core, its two workers (forked by the core's forkserver: the core's grandchildren, rank 0 first) and
    every process below the core (the forkserver and multiprocessing's resource tracker too)."""
    (core_pid,) = child_pids(server.proc.pid)
    workers = sorted(pid for child in child_pids(core_pid) for pid in child_pids(child))
    assert len(workers) == 2
    return core_pid, workers, sorted(descendants(core_pid))


def _wait_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(is_alive(pid) for pid in pids):
        time.sleep(0.1)
    return [pid for pid in pids if is_alive(pid)]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the worker processes")
def test_killed_worker_fails_requests_in_flight_and_the_server_exits(start_server, tiny_llama_dir):
    server = start_server(["--model", str(tiny_llama_dir), *TP_ARGS])
    url = server.url
    core_pid, workers, below = _workers(server)
    killed_at, events, (status, payload) = kill_under_load(url, workers[1])
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 503 and time.monotonic() - killed_at < 5.0
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead" and error["message"]
    assert status == 500 and payload["error"]["code"] == "engine_dead"
    assert server.proc.wait(timeout=30) == 1
    assert "tensor-parallel worker 1" in server.log_text()  # the log says which worker failed
    assert not _wait_gone([core_pid, *below])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the worker processes")
def test_sigterm_and_a_killed_core_leave_no_worker(start_server, tiny_llama_dir):
    server = start_server(["--model", str(tiny_llama_dir), *TP_ARGS, "--shutdown-timeout", "2"])
    reply = httpx.post(server.url + "/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 4})
    assert reply.status_code == 200
    core_pid, workers, below = _workers(server)
    assert server.stop() == 0
    assert not _wait_gone([core_pid, *below])

    # The core killed outright: its workers die with it (their lifeline pipes close), the server exits 1.
    server = start_server(["--model", str(tiny_llama_dir), *TP_ARGS])
    # The server watches its core from its first request on.
    assert httpx.post(server.url + "/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 2}).is_success
    core_pid, workers, below = _workers(server)
    os.kill(core_pid, signal.SIGKILL)
    assert server.proc.wait(timeout=30) == 1
    assert not _wait_gone(below)
