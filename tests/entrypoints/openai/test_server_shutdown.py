"""SIGTERM drains: new requests get 503, in-flight ones finish, the process exits 0 leaving no children.

Runs its own server on the tiny random Llama (output does not matter here), which also checks
--served-model-name and the TOKENMILL_API_KEY environment variable.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from proc_util import child_pids, is_alive

ENV_KEY = "tm-env-key"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find child processes")
def test_sigterm_drains_in_flight_requests_and_exits_zero(start_server, tiny_llama_dir):
    server = start_server(["--model", str(tiny_llama_dir), "--served-model-name", "tiny-test",
                           "--max-model-len", "512", "--num-kv-blocks", "64", "--shutdown-timeout", "60"],
                          env={"TOKENMILL_API_KEY": ENV_KEY}, api_key=ENV_KEY)
    url, headers = server.url, server.headers
    assert httpx.get(url + "/v1/models").status_code == 401
    models = httpx.get(url + "/v1/models", headers=headers).json()
    assert [m["id"] for m in models["data"]] == ["tiny-test"]
    wrong = httpx.post(url + "/v1/completions", headers=headers, json={"prompt": "a", "model": "other"})
    assert wrong.status_code == 404
    children = child_pids(server.proc.pid)

    body = {"model": "tiny-test", "prompt": "Hello", "max_tokens": 96, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", url + "/v1/completions", headers=headers, json=body) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            events = [next(lines)]
            server.proc.send_signal(signal.SIGTERM)
            refused = httpx.post(url + "/v1/completions", headers=headers, json={"prompt": "a", "max_tokens": 1})
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
            assert httpx.get(url + "/health").status_code == 503
            events.extend(lines)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event[len("data: "):]) for event in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 96
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and
            c["choices"][0].get("finish_reason")] == ["length"]

    assert server.proc.wait(timeout=60) == 0
    assert not [pid for pid in children if is_alive(pid)]
    log = server.log_text()
    assert "Traceback" not in log
    assert os.path.exists(server.log_path)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the engine core process")
def test_requests_left_at_the_shutdown_timeout_end_with_503(start_server, tiny_llama_dir):
    import threading
    import time

    server = start_server(["--model", str(tiny_llama_dir), "--max-model-len", "1024", "--num-kv-blocks", "128",
                           "--shutdown-timeout", "1"])
    url = server.url
    (core_pid,) = child_pids(server.proc.pid)
    body = {"prompt": "Hello", "max_tokens": 900, "ignore_eos": True}
    results: dict = {}

    def non_streaming() -> None:
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        results["full"] = (response.status_code, response.json())

    worker = threading.Thread(target=non_streaming)
    events = []
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if len(events) == 2:
                    worker.start()
                    time.sleep(0.3)
                    # A frozen core: nothing in flight can finish before the shutdown timeout.
                    os.kill(core_pid, signal.SIGSTOP)
                    server.proc.send_signal(signal.SIGTERM)
                    assert httpx.get(url + "/health", timeout=5).status_code == 503
    worker.join(30)
    os.kill(core_pid, signal.SIGCONT)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "shutting_down"
    status, payload = results["full"]
    assert status == 503 and payload["error"]["type"] == "service_unavailable"
    assert payload["error"]["code"] == "shutting_down"
    assert server.proc.wait(timeout=60) == 0
    assert "Traceback" not in server.log_text()
