"""Admission control through the real server on the tiny random Llama: a full queue answers 429 at
once with Retry-After and an OpenAI error body while accepted requests complete; a request that
waits longer than --max-queue-time gets a clear 429 of its own."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

COMPLETIONS = "/v1/completions"


def _post(url: str, body: dict) -> tuple[int, dict, dict, float]:
    """(status, headers, JSON body or the parsed stream, seconds until the status line arrived)."""
    started = time.monotonic()
    with httpx.Client(timeout=120) as client:
        if not body.get("stream"):
            response = client.post(url + COMPLETIONS, json=body)
            return response.status_code, dict(response.headers), response.json(), time.monotonic() - started
        with client.stream("POST", url + COMPLETIONS, json=body) as response:
            elapsed = time.monotonic() - started
            if response.status_code != 200:
                response.read()
                return response.status_code, dict(response.headers), response.json(), elapsed
            events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    return 200, {}, {"chunks": chunks}, elapsed


def _completion_tokens(result: dict) -> int:
    if "chunks" in result:
        return result["chunks"][-1]["usage"]["completion_tokens"]
    return result["usage"]["completion_tokens"]


def _assert_rejected(status: int, headers: dict, body: dict, code: str) -> None:
    assert status == 429, body
    assert int(headers["retry-after"]) >= 1
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("rate_limit_error", code)
    assert error["message"]


@pytest.mark.slow
def test_full_queue_answers_429_at_once_and_accepted_requests_complete(start_server, tiny_llama_dir):
    server = start_server(["--model", str(tiny_llama_dir), "--max-model-len", "512", "--num-kv-blocks", "64",
                           "--max-num-seqs", "1", "--max-num-queued-requests", "1", "--disable-access-log"])
    max_tokens = 300  # the running request lasts well beyond the time all ten take to arrive
    bodies = [{"prompt": f"request {i}", "max_tokens": max_tokens, "ignore_eos": True, "stream": i % 2 == 1,
               **({"stream_options": {"include_usage": True}} if i % 2 else {})} for i in range(10)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(lambda b: _post(server.url, b), bodies))

    accepted = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] != 200]
    # One request runs, at most one waits (a second may be refused while the first is still in the
    # engine's inbox); every other one is refused.
    assert 1 <= len(accepted) <= 2 and len(rejected) >= 8, [r[0] for r in results]
    for status, headers, body, elapsed in rejected:
        _assert_rejected(status, headers, body, "queue_full")
        assert elapsed < 2.0  # refused at once, not after waiting for the running request
    for _, _, body, _ in accepted:
        assert _completion_tokens(body) == max_tokens
    assert server.stats()["num_rejected"].get("queue_full") == len(rejected)
    # Once the queue drains, requests are accepted again.
    status, _, body, _ = _post(server.url, {"prompt": "again", "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and _completion_tokens(body) == 4


@pytest.mark.slow
def test_queue_timeout_is_a_clear_429(start_server, tiny_llama_dir):
    server = start_server(["--model", str(tiny_llama_dir), "--max-model-len", "1024", "--num-kv-blocks", "128",
                           "--max-num-seqs", "1", "--max-queue-time", "0.5", "--disable-access-log"])
    long_body = {"prompt": "long", "max_tokens": 1000, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}}
    first_token = threading.Event()
    long_result: dict = {}

    def run_long() -> None:
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", server.url + COMPLETIONS, json=long_body) as response:
                events = []
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        first_token.set()
                long_result["status"], long_result["events"] = response.status_code, events
        long_result["done"] = time.monotonic()

    thread = threading.Thread(target=run_long)
    thread.start()
    try:
        assert first_token.wait(60), "the long request never started"
        # The engine is saturated (max_num_seqs 1): both wait past 0.5 s and are refused.
        with ThreadPoolExecutor(2) as pool:
            waits = list(pool.map(lambda b: _post(server.url, b), [
                {"prompt": "short", "max_tokens": 4},
                {"prompt": "short stream", "max_tokens": 4, "stream": True}]))
        refused_at = time.monotonic()
    finally:
        thread.join(120)
    for status, headers, body, elapsed in waits:
        _assert_rejected(status, headers, body, "queue_timeout")
        assert "max_queue_time" in body["error"]["message"]
        assert 0.5 <= elapsed < 5.0
    assert long_result["done"] > refused_at, "the long request ended before the others timed out"
    assert long_result["status"] == 200 and long_result["events"][-1] == "[DONE]"
    assert json.loads(long_result["events"][-2])["usage"]["completion_tokens"] == 1000
    assert server.stats()["num_rejected"].get("queue_timeout") == 2
