"""A client that goes away aborts its request at once and frees its KV blocks; each request logs one JSON line."""
from __future__ import annotations

import time

import httpx
import pytest

# Far more tokens than could be generated in the few seconds the tests allow, so an idle engine
# afterwards can only mean the request was aborted.
LONG = {"prompt": "Write a very long story about a dragon.", "max_tokens": 900, "ignore_eos": True}


def _log_record(server, request_id: str, timeout_s: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for record in server.request_log():
            if record["request_id"] == request_id:
                return record
        time.sleep(0.05)
    raise AssertionError(f"no request log line for {request_id}:\n{server.log_tail()}")


def test_streaming_disconnect_aborts_and_frees_kv(smollm2_server):
    headers = {**smollm2_server.headers, "X-Request-Id": "disconnect-stream"}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", smollm2_server.url + "/v1/completions", headers=headers,
                           json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            busy = smollm2_server.stats()
            assert busy["num_requests_running"] + busy["num_requests_waiting"] >= 1
            assert busy["kv_cache_usage"] > 0
    closed = time.monotonic()
    stats = smollm2_server.wait_idle(timeout_s=10)
    assert stats["num_requests_running"] == 0 and stats["kv_cache_usage"] == 0, stats
    assert time.monotonic() - closed < 10
    record = _log_record(smollm2_server, "disconnect-stream")
    assert record["status"] == "client_disconnected"
    assert record["output_tokens"] < LONG["max_tokens"]


def test_non_streaming_disconnect_aborts_and_frees_kv(smollm2_server):
    headers = {**smollm2_server.headers, "X-Request-Id": "disconnect-plain"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(smollm2_server.url + "/v1/completions", headers=headers, json=LONG, timeout=2.0)
    stats = smollm2_server.wait_idle(timeout_s=10)
    assert stats["num_requests_running"] == 0 and stats["kv_cache_usage"] == 0, stats
    assert _log_record(smollm2_server, "disconnect-plain")["status"] == "client_disconnected"


def test_finished_request_logs_one_json_line(smollm2_server, http):
    response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "ignore_eos": True},
                         headers={"X-Request-Id": "logged-once"})
    assert response.status_code == 200
    record = _log_record(smollm2_server, "logged-once")
    usage = response.json()["usage"]
    assert record["status"] == "finished" and record["finish_reason"] == "length"
    assert record["prompt_tokens"] == usage["prompt_tokens"] and record["output_tokens"] == 2
    assert 0 <= record["ttft_s"] <= record["total_s"]
    assert [r["request_id"] for r in smollm2_server.request_log()].count("logged-once") == 1
