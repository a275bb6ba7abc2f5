"""--api-server-count 2: two HTTP frontends on one port in front of one engine core."""
from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from proc_util import child_pids, still_alive

MODEL = "tiny"


def _start_two(start_server, tiny_llama_dir, *extra: str):
    return start_server(["--model", str(tiny_llama_dir), "--served-model-name", MODEL, "--api-server-count", "2",
                         "--max-model-len", "256", "--num-kv-blocks", "256", "--disable-access-log",
                         "--disable-log-stats", *extra])


def _processes(server) -> tuple[int, int]:
    """(the second API server's pid, the engine core's pid): children of API server 0."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        worker = core = None
        for pid in child_pids(server.proc.pid):
            try:
                command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
            except OSError:
                continue
            if b"api_server_worker" in command:
                worker = pid
            elif b"core_proc" in command:
                core = pid
        if worker and core:
            return worker, core
        time.sleep(0.2)
    raise AssertionError(f"no worker/core among the children:\n{server.log_tail()}")


# Every request of these tests presents a key; "sk-limited" has limits the two servers must share.
KEYS = {"sk-all": {}, "sk-limited": {"requests_per_minute": 4, "tokens_per_minute": 300}}
AUTH = {"Authorization": "Bearer sk-all"}


def _complete(url: str, prompt: str, stream: bool = False, **extra) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream, **extra}
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=120, headers=AUTH)
        return response.status_code, (response.json()["choices"][0]["text"] if response.status_code == 200
                                      else response.text)
    text = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120, headers=AUTH) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.extend(choice["text"] for choice in json.loads(line[6:])["choices"])
        return response.status_code, "".join(text)


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"tokenmill:{name}{{") and 'finished_reason="length"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} series")


def _limited(url: str, path: str, body: dict) -> str:
    """"200", or which limit refused the request."""
    response = httpx.post(url + path, json={"model": MODEL, **body}, timeout=120,
                          headers={"Authorization": "Bearer sk-limited"})
    if response.status_code == 429:
        return "requests" if "requests per minute" in response.json()["error"]["message"] else "tokens"
    assert response.status_code == 200, response.text
    return "200"


@pytest.mark.slow
def test_two_api_servers_share_one_core_and_one_set_of_metrics_and_limits(start_server, tiny_llama_dir, tmp_path):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    server = _start_two(start_server, tiny_llama_dir, "--shutdown-timeout", "10", "--api-keys-file", str(keys_file))
    worker, core = _processes(server)
    prompts = [f"Request number {i} says" for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _complete(server.url, prompts[i], stream=i % 2 == 1), range(8)))
    assert all(status == 200 for status, _ in answers), answers
    # Greedy: the same prompt answers the same through either server, streamed or not.
    assert _complete(server.url, prompts[0], stream=True)[1] == answers[0][1]

    # API server 0 stopped: every connection goes to the second server, whose requests reach the core and
    # whose outputs come back to it (n = 2 forks included).
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        only_worker = [_complete(server.url, prompts[1]), _complete(server.url, prompts[2], stream=True),
                       _complete(server.url, "Two samples", n=2)]
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert [status for status, _ in only_worker] == [200, 200, 200], only_worker
    assert only_worker[0][1] == answers[1][1] and only_worker[1][1] == answers[2][1]

    # One set of metrics, whichever server answers the scrape: 8 + 1 requests, then the second server's 3
    # (the n = 2 request counts once), which it forwarded to server 0.
    deadline = time.monotonic() + 10
    while _metric(server.url, "request_success_total") < 12 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(server.url, "request_success_total") == 12
    assert httpx.get(server.url + "/stats", timeout=10).json()["num_requests_running"] == 0

    # A key's limits hold for the whole server, not per process: 4 requests a minute and 300 tokens
    # (prompt + max_tokens) a minute, spent partly through each server (either alone would accept every
    # request below).
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    os.kill(worker, signal.SIGSTOP)  # every connection to server 0
    try:
        through_server_0 = [_limited(server.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                            _limited(server.url, "/v1/chat/completions", chat)]
    finally:
        os.kill(worker, signal.SIGCONT)
    os.kill(server.proc.pid, signal.SIGSTOP)  # every connection to the second server
    try:
        through_server_1 = [_limited(server.url, "/v1/chat/completions", chat) for _ in range(2)]
        through_server_1.append(_limited(server.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}))
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    # Tokens: ~4 + ~130 through server 0, ~130 more fit, a third chat does not. Requests: that refused
    # chat was the 4th (counted on arrival), so the 5th is refused before its tokens are counted.
    assert through_server_0 == ["200", "200"], through_server_0
    assert through_server_1 == ["200", "tokens", "requests"], through_server_1

    # SIGTERM to API server 0 drains and stops both servers and the core.
    assert server.stop() == 0
    assert still_alive([worker, core], 10) == [], "processes outlived the server"


@pytest.mark.slow
def test_a_dead_core_fails_both_api_servers(start_server, tiny_llama_dir):
    server = _start_two(start_server, tiny_llama_dir)
    worker, core = _processes(server)
    os.kill(core, signal.SIGKILL)
    # The servers see it within a second or so: /health answers 503 until they exit, non-zero.
    seen = None
    deadline = time.monotonic() + 5
    while seen is None and time.monotonic() < deadline:
        try:
            response = httpx.get(server.url + "/health", timeout=2)
            seen = response if response.status_code == 503 else None
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    assert seen is not None and seen.json()["error"]["code"] == "engine_dead"
    assert server.proc.wait(30) == 1
    assert still_alive([worker], 15) == []


@pytest.mark.slow
def test_a_dead_api_server_stops_the_server_for_its_supervisor(start_server, tiny_llama_dir):
    server = _start_two(start_server, tiny_llama_dir)
    worker, core = _processes(server)
    os.kill(worker, signal.SIGKILL)
    assert server.proc.wait(30) == 1
    assert "API server 1" in server.log_text() and "exited with status -9" in server.log_text()
    assert still_alive([core], 15) == []
