"""No request can hang: --request-timeout aborts a request that runs too long (504, type 'timeout'), and
the stall watchdog fails a started request that stops getting output from the engine core.

The engine core process is frozen with SIGSTOP to stand in for a core that hangs; after SIGCONT the
core must hold no trace of the failed requests (they were aborted there) and the server serves on.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from proc_util import child_pids


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the engine core process")
def test_request_timeout_and_stall_watchdog(start_server, tiny_llama_dir):
    server = start_server(["--model", str(tiny_llama_dir), "--max-model-len", "1024", "--num-kv-blocks", "128",
                           "--request-timeout", "2", "--engine-stall-timeout", "1"])
    url = server.url
    (core_pid,) = child_pids(server.proc.pid)
    body = {"prompt": "Hello", "max_tokens": 900, "ignore_eos": True}

    # A request the core never answers: the request timeout ends it (the watchdog only watches
    # requests that have started producing output).
    os.kill(core_pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        response = httpx.post(url + "/v1/completions", json=body, timeout=30)
        elapsed = time.monotonic() - started
    finally:
        os.kill(core_pid, signal.SIGCONT)
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["type"] == "timeout" and error["code"] == "request_timeout" and error["message"]
    assert 1.9 <= elapsed < 6
    assert server.wait_idle()["num_requests_running"] == 0

    # A stream whose core goes silent after it started: an error event, then [DONE].
    events = []
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 2:
                        os.kill(core_pid, signal.SIGSTOP)
                        stopped_at = time.monotonic()
    waited = time.monotonic() - stopped_at
    os.kill(core_pid, signal.SIGCONT)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "timeout" and error["code"] == "engine_stalled"
    assert 0.9 <= waited < 6
    stats = server.wait_idle()
    assert stats["num_requests_running"] == 0 and stats["kv_cache_usage"] == 0

    # The server still serves, within the timeout.
    ok = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(url + "/health").status_code == 200
    assert "Traceback" not in server.log_text()
