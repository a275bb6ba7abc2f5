"""`tokenmill serve --kv-offload-dir`: a restarted server answers a prompt it saw before from the tier
(same text, the prefix counted as cached, the tier's counters in /metrics and /stats), and a directory it
cannot use leaves it serving."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx

PROMPT = "A short history of the lighthouse keepers of the northern coast, told year by year. " * 24
OTHER_PROMPT = "Notes on the tides, winds and shipping lanes of a small harbour town, season by season. " * 24


def complete(server, **extra) -> dict:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    match = re.search(rf"^tokenmill:{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_a_restarted_server_restores_the_prefix(start_server, tiny_llama_dir, tmp_path):
    """The first server computes two prompts; the restarted one runs two engine cores sharing the directory
    (--data-parallel-size 2): the two prompts, sent together, go one to each core, and each core restores
    its prompt from the blocks the first server wrote."""
    args = ["--model", str(tiny_llama_dir), "--served-model-name", "m", "--kv-offload-dir", str(tmp_path / "tier"),
            "--numerics", "exact"]
    first = start_server(args)
    cold = [complete(first), complete(first, prompt=OTHER_PROMPT)]
    assert cold[0]["usage"]["prompt_tokens"] > 400
    assert first.stop() == 0  # a graceful stop writes what was queued
    second = start_server(args + ["--data-parallel-size", "2"])
    with ThreadPoolExecutor(2) as pool:
        warm = list(pool.map(lambda extra: complete(second, **extra), [{}, {"prompt": OTHER_PROMPT}]))
    assert [w["choices"][0]["text"] for w in warm] == [c["choices"][0]["text"] for c in cold]
    prompt_tokens = [w["usage"]["prompt_tokens"] for w in warm]
    cached = [w["usage"]["prompt_tokens_details"]["cached_tokens"] for w in warm]
    assert cached == [(n - 1) // 16 * 16 for n in prompt_tokens]
    replicas = second.stats()["data_parallel"]
    assert [r["routed_with_tier_prefix"] for r in replicas] == [1, 1]  # one prompt on each core
    assert metric_sum(second, "external_prefix_cache_hits_total") == sum(cached)
    assert metric_sum(second, "external_prefix_cache_queries_total") == sum(prompt_tokens)
    assert metric_sum(second, "kv_offload_blocks_read_total") == sum(cached) // 16
    assert metric_sum(second, "kv_offload_usage_bytes") > 0
    offload = second.stats()["kv_offload"]
    assert offload["hits"] == sum(cached) and offload["hit_rate"] > 0.9 and offload["corrupt"] == 0


def metric_sum(server, name: str) -> float:
    """A metric summed over its series (one per engine core under data parallelism)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values = re.findall(rf"^tokenmill:{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.MULTILINE)
    assert values, f"{name} missing from /metrics"
    return sum(float(v) for v in values)


def test_an_unwritable_directory_leaves_the_server_serving_and_cache_ttl_pins(start_server, tiny_llama_dir,
                                                                             tmp_path):
    """A tier directory that cannot be created: the server serves, logs it and counts the error. The same
    server pins a prompt for its cache_ttl_s and refuses bad values with a 400 naming the field."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    server = start_server(["--model", str(tiny_llama_dir), "--served-model-name", "m", "--kv-offload-dir",
                           str(blocker / "tier")])
    assert complete(server)["usage"]["completion_tokens"] == 8
    usage = complete(server, cache_ttl_s=300)["usage"]
    assert "KV offload: cannot write" in server.log_text()
    assert metric(server, "kv_offload_write_errors_total") >= 1
    assert server.stats()["prefix_cache_pinned_blocks"] == (usage["prompt_tokens"] - 1) // 16
    assert metric(server, "prefix_cache_pinned_blocks") == (usage["prompt_tokens"] - 1) // 16
    for bad in (-1, 0, 10**9, "soon"):
        body = {"model": "m", "prompt": "hi", "max_tokens": 2, "cache_ttl_s": bad}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["param"] == "cache_ttl_s"
