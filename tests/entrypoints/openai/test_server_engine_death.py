"""The engine core process killed under load: requests in flight end with errors (never hang),
/health turns 503 at once, and the server exits non-zero for its supervisor to restart it."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from proc_util import child_pids


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the engine core process")
def test_killed_engine_core_fails_requests_in_flight_and_exits_non_zero(start_server, tiny_llama_dir):
    server = start_server(["--model", str(tiny_llama_dir), "--max-model-len", "1024", "--num-kv-blocks", "128"])
    url = server.url
    (core_pid,) = child_pids(server.proc.pid)
    results: dict = {}

    def non_streaming() -> None:
        response = httpx.post(url + "/v1/completions", timeout=60,
                              json={"prompt": "Hello", "max_tokens": 900, "ignore_eos": True})
        results["full"] = (response.status_code, response.json())

    worker = threading.Thread(target=non_streaming)
    worker.start()
    body = {"prompt": "Hi", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = []
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if len(events) == 5:
                    os.kill(core_pid, signal.SIGKILL)
                    killed_at = time.monotonic()
    worker.join(60)
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 503 and time.monotonic() - killed_at < 2.0
    assert health.json()["error"]["code"] == "engine_dead"
    # The stream ends with an error event, then [DONE].
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead" and error["message"]
    status, payload = results["full"]
    assert status == 500 and payload["error"]["code"] == "engine_dead"
    assert server.proc.wait(timeout=30) == 1
