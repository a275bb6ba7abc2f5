"""/metrics and /stats of a live server hold the right numbers, not just the right names.

Each test starts its own server on the tiny random Llama (ignore_eos makes output lengths exact):
  - counters equal the sums of the responses' usage, histogram counts equal the request count,
    finished_reason labels split stop from length, KV usage is back to 0 when idle, and a burst beyond
    --max-num-queued-requests moves request_rejected_total by exactly the number of 429s;
  - a KV cache of 8 blocks with 3 concurrent requests must preempt: the preemption counter moves and the
    token counters still equal the usage sums; a client that disconnects from an otherwise idle server
    shows up as an abort and its blocks are released in the gauges at once.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "tm-metrics-key"
MODEL = "tiny-metrics"


def scrape(server) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}; fetched without the API key on purpose."""
    response = httpx.get(server.url + "/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if family.name.startswith("tokenmill:"):
                assert sample.labels["model_name"] == MODEL, sample
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def metric(samples: dict, name: str, **labels) -> float:
    return samples[("tokenmill:" + name, tuple(sorted(labels.items())))]


def wait_metrics_idle(server, timeout_s: float = 10.0) -> dict:
    """Scrapes until the gauges show an idle engine (the HTTP response can beat the last step's stats)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(server)
        idle = (metric(samples, "num_requests_running") == 0 and metric(samples, "num_requests_waiting") == 0
                and metric(samples, "kv_cache_usage_perc") == 0)
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def stream_usage(client: httpx.Client, body: dict) -> dict:
    """Streams a completion and returns the usage of its final chunk."""
    usage = None
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                usage = chunk.get("usage") or usage
    assert usage is not None
    return usage


@pytest.mark.slow
def test_metrics_equal_usage_of_known_requests_and_count_rejections(start_server, tiny_llama_dir):
    server = start_server(["--model", str(tiny_llama_dir), "--served-model-name", MODEL, "--max-model-len", "512",
                           "--num-kv-blocks", "64", "--max-num-seqs", "1", "--max-num-queued-requests", "2",
                           "--api-key", API_KEY, "--disable-access-log"], api_key=API_KEY)
    # The observability endpoints need no key; the API does.
    assert httpx.get(server.url + "/v1/models").status_code == 401
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="chat-input"' in page.text and "/static/app.js" in page.text
    for asset in ("app.js", "charts.js", "style.css"):
        assert httpx.get(f"{server.url}/static/{asset}").status_code == 200, asset
    before = scrape(server)
    assert metric(before, "prompt_tokens_total") == 0
    assert metric(before, "request_success_total", finished_reason="length") == 0
    assert before[("process_cpu_seconds_total", ())] > 0

    usages, reasons = [], []
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as client:
        def complete(body: dict) -> dict:
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            usages.append(response.json()["usage"])
            reasons.append(response.json()["choices"][0]["finish_reason"])
            return response.json()

        complete({"prompt": "Hello world", "max_tokens": 7, "ignore_eos": True, "user": "alice"})
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi!"}],
                                                         "max_tokens": 5, "ignore_eos": True})
        assert chat.status_code == 200
        usages.append(chat.json()["usage"])
        reasons.append(chat.json()["choices"][0]["finish_reason"])
        usages.append(stream_usage(client, {"prompt": "Once upon a time", "max_tokens": 9, "ignore_eos": True}))
        reasons.append("length")
        # Greedy output is reproducible: a stop string taken from it ends the same request early ("stop").
        greedy = {"prompt": "The weather today", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        text = complete(greedy)["choices"][0]["text"]
        stop = text.strip()[:3]
        assert stop, f"the greedy output has no text to stop on: {text!r}"
        stopped = complete({**greedy, "stop": [stop]})
        assert stopped["choices"][0]["finish_reason"] == "stop"
    n = len(usages)
    assert reasons.count("stop") == 1 and reasons.count("length") == n - 1

    samples = wait_metrics_idle(server)
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    completion_tokens = sum(u["completion_tokens"] for u in usages)
    assert metric(samples, "prompt_tokens_total") == prompt_tokens
    assert metric(samples, "generation_tokens_total") == completion_tokens
    assert metric(samples, "request_prompt_tokens_sum") == prompt_tokens
    assert metric(samples, "request_generation_tokens_sum") == completion_tokens
    assert metric(samples, "time_to_first_token_seconds_count") == n
    assert metric(samples, "e2e_request_latency_seconds_count") == n
    assert metric(samples, "request_queue_time_seconds_count") == n
    # every token after a request's first is one inter-token gap
    assert metric(samples, "inter_token_latency_seconds_count") == completion_tokens - n
    assert metric(samples, "request_success_total", finished_reason="length") == n - 1
    assert metric(samples, "request_success_total", finished_reason="stop") == 1
    assert metric(samples, "request_success_total", finished_reason="abort") == 0
    assert metric(samples, "kv_cache_usage_perc") == 0
    assert metric(samples, "num_requests_running") == 0
    assert metric(samples, "num_preemptions_total") == 0
    assert metric(samples, "prefix_cache_queries_total") >= prompt_tokens - n
    # Per tenant (the request's `user`; none for the others): the same tokens, split.
    assert metric(samples, "tenant_generation_tokens_total", tenant="alice") == usages[0]["completion_tokens"] == 7
    assert metric(samples, "tenant_prompt_tokens_total", tenant="alice") == usages[0]["prompt_tokens"]
    assert metric(samples, "tenant_generation_tokens_total", tenant="none") == completion_tokens - 7

    stats = httpx.get(server.url + "/stats").json()  # no key needed either
    assert stats["num_finished_requests"] == n
    assert stats["finish_reasons"] == {"length": n - 1, "stop": 1}
    assert stats["ttft_s"]["count"] == n and stats["e2e_s"]["count"] == n
    assert 0 < stats["ttft_s"]["p50"] <= stats["ttft_s"]["p95"] <= stats["ttft_s"]["p99"]
    assert stats["itl_s"]["count"] == completion_tokens - n
    assert stats["output_tokens_per_s"] > 0 and stats["prompt_tokens_per_s"] > 0
    assert stats["kv_cache_usage"] == 0 and stats["num_requests_running"] == 0
    assert stats["model"] == MODEL and stats["history"]
    assert stats["prefix_cache_hit_rate"] == pytest.approx(stats["prefix_cache_hits"]
                                                           / stats["prefix_cache_queries"])
    # What the core reported at startup, and the processes' resident memory now: the engine process
    # holds at least its weights and its (written, hence resident) KV cache.
    memory = stats["memory"]
    assert memory["weights_bytes"] > 0 and memory["kv_cache_bytes"] > 0 and memory["rotary_tables_bytes"] > 0
    assert memory["engine_rss_bytes"] >= memory["weights_bytes"] + memory["kv_cache_bytes"]
    assert memory["engine_rss_at_start_bytes"] >= memory["weights_bytes"] + memory["kv_cache_bytes"]
    assert memory["api_rss_bytes"] > 0

    # One sequence at a time and a queue of 2: a burst of 6 long requests must see some refused.
    long_body = {"prompt": "Count to a hundred:", "max_tokens": 100, "ignore_eos": True}
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(
            lambda _: httpx.post(server.url + "/v1/completions", headers=server.headers, json=long_body,
                                 timeout=120), range(6)))
    refused = [r for r in responses if r.status_code == 429]
    served = [r for r in responses if r.status_code == 200]
    assert len(refused) + len(served) == 6, [r.text for r in responses]
    assert refused, "no request was refused"
    assert all(r.json()["error"]["code"] == "queue_full" for r in refused)
    samples = wait_metrics_idle(server)
    assert metric(samples, "request_rejected_total", reason="queue_full") == len(refused)
    assert metric(samples, "request_success_total", finished_reason="length") == n - 1 + len(served)
    assert metric(samples, "generation_tokens_total") == completion_tokens + 100 * len(served)
    assert httpx.get(server.url + "/stats").json()["num_rejected"] == {"queue_full": len(refused)}
    # Every answer counted by route, method and status class (vLLM's http_requests_total): the refused
    # ones, the completions, the key-less /v1/models; a path that is no route counts as "other".
    assert httpx.get(server.url + "/no/such/path").status_code == 404
    samples = scrape(server)

    def answers(handler: str, method: str, status: str) -> float:
        return samples.get(("http_requests_total", (("handler", handler), ("method", method), ("status", status))), 0)

    assert answers("/v1/completions", "POST", "4xx") == len(refused)
    assert answers("/v1/completions", "POST", "2xx") == 4 + len(served)  # 3 complete(), 1 stream, the burst
    assert answers("/v1/chat/completions", "POST", "2xx") == 1
    assert answers("/v1/models", "GET", "4xx") == 1
    assert answers("other", "GET", "4xx") == 1
    assert not any(name == "http_requests_total" and status.endswith("5xx") for (name, labels) in samples
                   for key, status in labels if key == "status")


@pytest.mark.slow
def test_preemption_counter_and_abort_on_an_idle_engine(start_server, tiny_llama_dir):
    # 8 blocks of 16 tokens: three requests growing to ~65 tokens (5 blocks each) cannot all fit.
    server = start_server(["--model", str(tiny_llama_dir), "--served-model-name", MODEL, "--max-model-len", "128",
                           "--num-kv-blocks", "8", "--disable-access-log", "--disable-log-stats"])
    body = {"prompt": "Hello", "max_tokens": 60, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(
            lambda _: httpx.post(server.url + "/v1/completions", json=body, timeout=120), range(3)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    usages = [r.json()["usage"] for r in responses]
    # n = 2 computes the prompt once: one request, its prompt counted once, both samples' tokens counted.
    forked = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 4, "n": 2}, timeout=120)
    assert forked.status_code == 200, forked.text
    usages.append(forked.json()["usage"])
    assert usages[-1]["completion_tokens"] == 8

    samples = wait_metrics_idle(server)
    preemptions = metric(samples, "num_preemptions_total")
    assert preemptions >= 1, "a KV cache of 8 blocks did not force a preemption"
    stats = server.stats()
    assert stats["num_preemptions"] == preemptions
    # Recomputing a preempted request counts neither its prompt nor its tokens twice.
    assert metric(samples, "prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert metric(samples, "generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert metric(samples, "time_to_first_token_seconds_count") == 4
    assert metric(samples, "request_success_total", finished_reason="length") == 4
    assert metric(samples, "kv_cache_usage_perc") == 0

    # A client leaving is the last thing the engine sees: no further step follows, yet the gauges must
    # drop the request and the abort must be counted.
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/completions",
                           json={**body, "max_tokens": 120, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # held: a dropped line iterator would close the connection
            assert next(line for line in lines if line.startswith("data: "))
            busy = scrape(server)
            assert metric(busy, "num_requests_running") == 1 and metric(busy, "kv_cache_usage_perc") > 0
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(server)
        # The abort is counted by the API process at once; the gauges follow with the core's next report.
        settled = (metric(samples, "request_success_total", finished_reason="abort") == 1
                   and metric(samples, "num_requests_running") == 0 and metric(samples, "kv_cache_usage_perc") == 0)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert metric(samples, "request_success_total", finished_reason="abort") == 1
    assert metric(samples, "num_requests_running") == 0
    assert metric(samples, "kv_cache_usage_perc") == 0
    assert metric(samples, "e2e_request_latency_seconds_count") == 5
