"""`tokenmill bench serve/sweep`: arrival statistics, datasets, metric math, and runs against a live server."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tokenmill.bench.datasets import (
    SAFE_ID_RANGE,
    DatasetConfig,
    TokenIdSpace,
    apply_prompt_format,
    build_requests,
)
from tokenmill.bench.serve import (
    RequestResult,
    ServeConfig,
    arrival_intervals,
    max_concurrent,
    parse_prometheus,
    summarize,
)
from tokenmill.entrypoints import cli
from tokenmill.errors import InvalidRequestError

METRICS = ("ttft", "tpot", "itl", "e2el")
RESULT_FIELDS = (
    "kind", "date", "label", "base_url", "endpoint", "model", "request_rate", "burstiness", "max_concurrency",
    "num_prompts", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "good_requests", "slo", "output_throughput", "total_token_throughput",
    "max_concurrent_requests", "usage_reported", "input_lens", "output_lens", "ttfts", "itls", "e2els",
    "start_times", "errors", "server", "engine", "dataset", "prompt_format",
) + tuple(f"{stat}_{m}_ms" for m in METRICS for stat in ("mean", "median", "std", "p50", "p90", "p95", "p99", "max"))


# ---- arrivals ------------------------------------------------------------------------------------------
def test_poisson_arrivals_have_the_requested_rate():
    rate = 4.0
    gaps = np.asarray(arrival_intervals(20_000, rate, seed=1))
    assert abs(gaps.mean() - 1 / rate) < 0.03 / rate
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential gaps: coefficient of variation 1
    assert arrival_intervals(5, rate, seed=1) == arrival_intervals(5, rate, seed=1)
    assert arrival_intervals(3, float("inf")) == [0.0, 0.0, 0.0]
    bursty = np.asarray(arrival_intervals(20_000, rate, burstiness=0.25, seed=1))
    assert abs(bursty.mean() - 1 / rate) < 0.06 / rate and bursty.std() > 1.5 * gaps.std()


# ---- datasets ------------------------------------------------------------------------------------------
def test_random_dataset_lengths_ids_and_determinism():
    cfg = DatasetConfig(name="random", num_prompts=50, seed=3, random_input_len=100, random_output_len=20,
                        random_range_ratio=0.5)
    requests = build_requests(cfg)
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.max_tokens <= 30 for r in requests)
    assert all(r.prompt_len == len(r.prompt_token_ids) for r in requests)
    ids = [i for r in requests for i in r.prompt_token_ids]
    assert SAFE_ID_RANGE[0] <= min(ids) and max(ids) < SAFE_ID_RANGE[1]
    assert [r.prompt_token_ids for r in build_requests(cfg)] == [r.prompt_token_ids for r in requests]
    space = TokenIdSpace(low=0, high=10, excluded=frozenset({0, 1, 2}))
    assert min(space.sample(np.random.default_rng(0), 500)) == 3


def test_shared_prefix_and_sharegpt_like_datasets():
    cfg = DatasetConfig(name="shared-prefix", num_prompts=24, num_prefixes=3, prefix_len=40, suffix_len=5)
    requests = build_requests(cfg)
    assert {len(r.prompt_token_ids) for r in requests} == {45}
    assert len({tuple(r.prompt_token_ids[:40]) for r in requests}) == 3
    assert len({tuple(r.prompt_token_ids[40:]) for r in requests}) == 24

    chats = build_requests(DatasetConfig(name="sharegpt-like", num_prompts=200, sharegpt_max_input_len=300,
                                         sharegpt_max_output_len=100))
    assert all(r.prompt_token_ids is None and r.prompt.endswith("Assistant:") for r in chats)
    assert all(r.prompt_len <= 300 and 4 <= r.max_tokens <= 100 for r in chats)
    assert any(len(r.messages) > 1 for r in chats) and all(r.messages[-1]["role"] == "user" for r in chats)
    words = [len(r.messages[-1]["content"].split()) for r in chats]
    assert 20 < float(np.median(words)) < 150  # ShareGPT-like: user turns of tens of tokens, a long tail


def test_file_dataset_and_prompt_formats(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 4, "prompt": "a b c"}) + "\n"
                    + json.dumps({"prompt_token_ids": [8, 9], "max_tokens": 2}) + "\n")
    requests = build_requests(DatasetConfig(name=f"file:{path}", num_prompts=10))
    assert [(r.prompt_token_ids, r.max_tokens) for r in requests] == [([5, 6, 7], 4), ([8, 9], 2)]

    class FakeTokenizer:
        def decode(self, ids):
            return " ".join(f"t{i}" for i in ids)

        def encode(self, text, add_special_tokens=False):
            return [len(word) for word in text.split()]

    loads = []
    apply_prompt_format(requests, "text", lambda: loads.append(1) or FakeTokenizer())
    assert [r.prompt for r in requests] == ["a b c", "t8 t9"] and len(loads) == 1
    assert all(r.prompt_token_ids is None for r in requests)
    apply_prompt_format(requests, "ids", FakeTokenizer)
    assert requests[1].prompt_token_ids == [2, 2]
    with pytest.raises(InvalidRequestError, match="unknown dataset"):
        DatasetConfig(name="sharegpt")
    with pytest.raises(InvalidRequestError, match="not found"):
        build_requests(DatasetConfig(name=f"file:{tmp_path / 'missing.jsonl'}"))


# ---- metric math ---------------------------------------------------------------------------------------
def test_summarize_metrics_goodput_and_failures():
    results = [
        RequestResult(prompt_len=10, success=True, output_len=5, ttft=0.1, itl=[0.05] * 4, latency=0.3,
                      start_time=0.0, usage_reported=True),
        RequestResult(prompt_len=20, success=True, output_len=3, ttft=0.5, itl=[0.1, 0.1], latency=0.9,
                      start_time=0.05, usage_reported=True),
        RequestResult(prompt_len=7, error="HTTP 400: too long", start_time=0.1),
    ]
    cfg = ServeConfig(slo_ttft_ms=200, slo_tpot_ms=100)
    out = summarize(results, 2.0, cfg)
    assert (out["completed"], out["failed"], out["total_input_tokens"], out["total_output_tokens"]) == (2, 1, 30, 8)
    assert out["request_throughput"] == 1.0 and out["output_throughput"] == 4.0 and out["total_token_throughput"] == 19
    assert out["mean_tpot_ms"] == pytest.approx((50 + 200) / 2)
    assert out["good_requests"] == 1 and out["request_goodput"] == 0.5
    assert out["max_ttft_ms"] == pytest.approx(500) and out["median_itl_ms"] == pytest.approx(50)
    assert out["max_concurrent_requests"] == 2 == max_concurrent(results[:2])
    assert out["errors"][2] == "HTTP 400: too long"
    assert summarize(results, 2.0, ServeConfig())["request_goodput"] is None


def test_parse_prometheus_sums_label_sets():
    text = ('# HELP x\nvllm:num_requests_waiting{model="a"} 3.0\nvllm:num_requests_waiting{model="b"} 2\n'
            "process_resident_memory_bytes 1.5e+09\n")
    assert parse_prometheus(text) == {"vllm:num_requests_waiting": 5.0, "process_resident_memory_bytes": 1.5e9}


def test_unreachable_server_is_a_one_line_error(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = cli.main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2",
                           "--random-input-len", "8", "--disable-tqdm", "--no-sample-server"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("tokenmill: error: cannot reach") and "Traceback" not in err


# ---- against a live tokenmill server -------------------------------------------------------------------
@pytest.fixture(scope="module")
def live_server(tiny_llama_dir, tmp_path_factory):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log_path = tmp_path_factory.mktemp("bench-server") / "server.log"
    log = open(log_path, "wb")
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.openai.api_server", "--model", str(tiny_llama_dir),
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512", "--num-kv-blocks", "128",
           "--disable-access-log"]
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        yield url, proc, log_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _server_usage(log_path: Path) -> list[dict]:
    records = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"request_finished"' in line:
            records.append(json.loads(line))
    return records


def _assert_ordered(result: dict, metric: str) -> None:
    chain = [result[f"{k}_{metric}_ms"] for k in ("p50", "p90", "p95", "p99", "max")]
    assert all(a <= b + 1e-9 for a, b in zip(chain, chain[1:])), (metric, chain)
    assert result[f"median_{metric}_ms"] == pytest.approx(result[f"p50_{metric}_ms"])
    assert result[f"mean_{metric}_ms"] <= result[f"max_{metric}_ms"] + 1e-9


@pytest.mark.slow
def test_a_time_boxed_run_stops_on_time_and_reports_the_stable_segment(live_server, tmp_path, capsys):
    url, proc, _ = live_server
    out = tmp_path / "timed.json"
    start = time.monotonic()
    code = cli.main([
        "bench", "serve", "--base-url", url, "--dataset", "random", "--num-prompts", "4", "--random-input-len", "32",
        "--random-output-len", "8", "--max-concurrency", "2", "--duration", "4", "--warmup", "2",
        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "0.001", "--price-per-hour", "2.5", "--disable-tqdm",
        "--result-json", str(out)])
    wall = time.monotonic() - start
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert code == 0 and "Stable segment, measured (s):" in printed and "within the SLO:" in printed
    segments = result["segments"]
    assert segments["warmup_s"] == 2 and segments["stable_s"] == 4 and result["duration"] == 4
    assert 6 <= segments["wall_s"] < 6 + 10 and wall < 6 + 30  # stops sending at 6 s; the drain is short
    # The 4 requests are cycled for the whole run, at most 2 in flight, and the warm-up's are left out.
    assert segments["requests_sent"] > 4 and result["max_concurrent_requests"] <= 2
    assert 0 < segments["requests_in_warmup"] < segments["requests_sent"]
    assert result["num_prompts"] == segments["requests_in_stable_segment"]
    assert all(2 <= t < 6 for t in result["start_times"])
    assert result["output_throughput"] > 0 and result["whole_run"]["output_throughput"] > 0
    # A TPOT SLO no server meets: the verdict says so; the TTFT one is met.
    verdict = result["verdict"]
    assert verdict["meets_slo"] is False and verdict["p95_ttft_within_slo"] and not verdict["p95_tpot_within_slo"]
    # The engine's configuration as the server reports it.
    engine = result["engine"]
    assert engine["config"]["max_num_seqs"] == 64 and engine["config"]["block_size"] == 16
    assert engine["models"][0]["max_model_len"] == 512 and engine["numerics"]
    # The price of an hour turned into the price of a million tokens at the measured throughput.
    cost = result["cost"]
    assert cost["per_million_output_tokens"] == pytest.approx(2.5 / (result["output_throughput"] * 3600) * 1e6)
    assert cost["per_million_tokens"] < cost["per_million_output_tokens"] and "Cost per 1M output tokens:" in printed


def test_the_stable_segment_counts_only_what_happened_inside_it():
    from tokenmill.bench.serve import summarize_stable_segment

    cfg = ServeConfig(max_concurrency=1, duration_s=10.0, warmup_s=5.0)
    results = [
        RequestResult(prompt_len=10, success=True, output_len=11, ttft=1.0, itl=[0.1] * 10, latency=2.0,
                      start_time=4.0),
        RequestResult(prompt_len=10, success=True, output_len=11, ttft=1.0, itl=[0.1] * 10, latency=2.0,
                      start_time=8.0),
        RequestResult(prompt_len=10, success=True, output_len=11, ttft=1.0, itl=[0.1] * 10, latency=2.0,
                      start_time=14.0),
    ]
    result = summarize_stable_segment(results, 16.5, cfg)
    # Starts at 4 (warm-up), 8 and 14 (stable); the third ends at 16, in the drain.
    assert result["segments"]["requests_in_warmup"] == 1 and result["num_prompts"] == 2
    assert result["segments"]["drain_s"] == pytest.approx(1.5)
    # Tokens inside [5, 15): all 11 of the first (its first at 5.0, where the segment starts, the rest by 6) and
    # of the second; the third's first token comes at 15, outside: none of it.
    assert result["output_throughput"] == pytest.approx((11 + 11 + 0) / 10)
    late = RequestResult(prompt_len=10, success=True, output_len=11, ttft=0.5, itl=[0.1] * 10, latency=1.5,
                         start_time=14.0)  # first token at 14.5, the other 10 spread over 14.5..15.5: half inside
    assert summarize_stable_segment([late], 16.0, cfg)["output_throughput"] == pytest.approx((1 + 5) / 10)
    assert result["request_throughput"] == pytest.approx(2 / 10)  # the first two end at 6 and 10
    assert result["verdict"] is None  # no SLO numbers
    with pytest.raises(InvalidRequestError, match="fixed load"):
        ServeConfig(duration_s=10.0)


def test_bench_serve_against_live_server(live_server, tiny_llama_dir, tmp_path, capsys):
    url, proc, log_path = live_server
    before = len(_server_usage(log_path))
    out = tmp_path / "serve.json"
    code = cli.main([
        "bench", "serve", "--base-url", url, "--dataset", "random", "--num-prompts", "10", "--random-input-len", "48",
        "--random-output-len", "12", "--random-range-ratio", "0.5", "--max-concurrency", "4", "--request-rate", "50",
        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--server-pid", str(proc.pid), "--disable-tqdm",
        "--label", "tokenmill", "--result-json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "Serving Benchmark Result" in printed and "P95 TTFT (ms):" in printed
    result = json.loads(out.read_text())
    assert not [f for f in RESULT_FIELDS if f not in result]
    assert (result["completed"], result["failed"], result["model"]) == (10, 0, tiny_llama_dir.name)
    assert result["usage_reported"] and result["max_concurrent_requests"] <= 4

    # Token counts are the server's usage: compare with its own per-request log (the first is the test request).
    usage = _server_usage(log_path)[before + 1:]
    assert len(usage) == 10
    assert result["total_output_tokens"] == sum(u["output_tokens"] for u in usage) == sum(result["output_lens"])
    assert result["total_input_tokens"] == sum(u["prompt_tokens"] for u in usage) == sum(result["input_lens"])
    dataset = build_requests(DatasetConfig(name="random", num_prompts=10, random_input_len=48,
                                           random_output_len=12, random_range_ratio=0.5))
    assert result["output_lens"] == [r.max_tokens for r in dataset]  # ignore_eos: exactly max_tokens each
    assert result["input_lens"] == [r.prompt_len for r in dataset]

    for metric in METRICS:
        _assert_ordered(result, metric)
    duration = result["duration"]
    assert result["request_throughput"] == pytest.approx(10 / duration)
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / duration)
    tpots = [(e - t) / (n - 1) for e, t, n in zip(result["e2els"], result["ttfts"], result["output_lens"])]
    assert result["mean_tpot_ms"] == pytest.approx(1000 * float(np.mean(tpots)))
    for ttft, e2el, itl, n in zip(result["ttfts"], result["e2els"], result["itls"], result["output_lens"]):
        assert 0 < ttft <= e2el and len(itl) <= n - 1
    assert result["good_requests"] == 10 and result["request_goodput"] == pytest.approx(10 / duration)
    assert result["server"]["peak_rss_bytes"] > 10 * 2**20
    assert result["server"]["rss_source"] == f"proc:{proc.pid}"
    assert result["server"]["max_running"] is not None  # sampled from tokenmill's /stats


@pytest.mark.slow
def test_bench_sweep_chat_and_plan_profile(live_server, tmp_path, capsys):
    url, _, _ = live_server
    sweep_path = tmp_path / "sweep.json"
    code = cli.main([
        "bench", "sweep", "--base-url", url + "/v1", "--endpoint", "/v1/chat/completions", "--dataset",
        "sharegpt-like", "--sharegpt-max-input-len", "120", "--sharegpt-max-output-len", "8", "--num-prompts", "4",
        "--concurrencies", "1,4", "--disable-tqdm", "--result-json", str(sweep_path)])
    assert code == 0
    sweep = json.loads(sweep_path.read_text())
    assert sweep["kind"] == "sweep" and [p["max_concurrency"] for p in sweep["points"]] == [1, 4]
    for point in sweep["points"]:
        assert point["completed"] == 4 and point["max_concurrent_requests"] <= point["max_concurrency"]
        assert point["prompt_format"] == "text" and point["total_output_tokens"] == sum(point["output_lens"])
        _assert_ordered(point, "ttft")
    assert sweep["points"][0]["max_concurrent_requests"] == 1
    capsys.readouterr()

    target = (sweep["points"][0]["p95_ttft_ms"] + sweep["points"][1]["p95_ttft_ms"]) / 2
    code = cli.main(["plan", "--model", "smollm2-135m", "--memory-gib", "8", "--max-model-len", "512",
                           "--concurrency", "16", "--target-ttft-ms", str(target), "--profile", str(sweep_path),
                           "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["profile"]["path"] == str(sweep_path)
    if sweep["points"][1]["p95_ttft_ms"] > sweep["points"][0]["p95_ttft_ms"]:
        assert 1 <= plan["profile"]["crossing_concurrency"] <= 4


@pytest.mark.slow
def test_bench_throughput_offline(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    code = cli.main(["bench", "throughput", "--model", str(tiny_llama_dir), "--dataset", "shared-prefix",
                           "--num-prefixes", "2", "--prefix-len", "24", "--suffix-len", "4",
                           "--random-output-len", "3", "--num-prompts", "4", "--max-num-seqs", "2",
                           "--max-num-batched-tokens", "64", "--max-model-len", "128", "--num-kv-blocks", "64",
                           "--disable-tqdm", "--result-json", str(out)])
    assert code == 0 and "Throughput:" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert (result["kind"], result["num_requests"], result["prompt_tokens"], result["output_tokens"]) == \
        ("throughput", 4, 4 * 28, 4 * 3)
    assert result["dataset"]["name"] == "shared-prefix" and result["output_tok_s"] > 0
