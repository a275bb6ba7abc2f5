"""The shared-prefix workload and a tiny run of the prefix-cache benchmark on the tiny Llama."""
from __future__ import annotations

import json

from benchmarks import prefix_bench
from benchmarks.make_bench import update_markdown
from benchmarks.shared_prefix import MIN_TOKEN_ID, SharedPrefixSpec, build_shared_prefix_workload, ideal_cached_tokens


def test_workload_is_deterministic_round_robin_and_shares_prefixes():
    spec = SharedPrefixSpec(num_prefixes=3, questions_per_prefix=2, prefix_len=40, max_tokens=5)
    requests = build_shared_prefix_workload(spec, vocab_size=1000)
    assert [r.id for r in requests] == ["p0-q0", "p1-q0", "p2-q0", "p0-q1", "p1-q1", "p2-q1"]
    assert requests == build_shared_prefix_workload(spec, vocab_size=1000)
    assert requests[0].prompt_token_ids[:40] == requests[3].prompt_token_ids[:40]
    assert requests[0].prompt_token_ids[:40] != requests[1].prompt_token_ids[:40]
    assert all(MIN_TOKEN_ID <= t < 1000 for r in requests for t in r.prompt_token_ids)
    assert all(16 <= r.prompt_len - 40 <= 48 and r.max_tokens == 5 for r in requests)
    assert len(build_shared_prefix_workload(spec, 1000, limit=4)) == 4
    # 3 of the 6 requests find their system prompt's 2 full blocks (32 tokens) cached.
    assert ideal_cached_tokens(spec, 6, 16) == 3 * 32 and ideal_cached_tokens(spec, 2, 16) == 0


def test_prefix_bench_runs_every_config(tiny_llama_dir, tmp_path):
    md, raw = tmp_path / "docs" / "benchmarks.md", tmp_path / "results" / "prefix-cache.json"
    md.parent.mkdir()
    md.write_text("# Benchmarks\n\n<!-- bench:engine-core:start -->\nkeep me\n<!-- bench:engine-core:end -->\n")
    argv = ["--model", str(tiny_llama_dir), "--device", "cpu", "--num-prefixes", "2", "--questions-per-prefix", "2",
            "--prefix-len", "40", "--max-tokens", "3", "--kv-cache-memory-bytes", "16MiB",
            "--output", str(md), "--results-json", str(raw), "--no-tqdm"]
    report = prefix_bench.main(argv)

    assert list(report["results"]) == ["cache-off", "cache-on", "cache-on-lpm"]
    for name, result in report["results"].items():
        assert result["num_requests"] == 4 and result["output_tokens"] == 12
        assert result["ttft_mean_s"] > 0 and result["ttft_p95_s"] >= result["ttft_p50_s"]
    assert report["results"]["cache-off"]["hit_rate"] == 0.0
    # The second request of each system prompt hits its 2 full blocks.
    for name in ("cache-on", "cache-on-lpm"):
        assert report["results"][name]["prefix_cache_hits"] == 2 * 32
        assert report["results"][name]["num_cached_prompt_tokens"] == 2 * 32
    assert set(report["ratios"]) == {"cache-on/cache-off throughput", "cache-off/cache-on mean TTFT",
                                     "cache-on-lpm/cache-off throughput", "cache-off/cache-on-lpm mean TTFT"}
    assert json.loads(raw.read_text())["results"]["cache-on"]["prefix_cache_hits"] == 64
    update_markdown(md, prefix_bench.render_section(report, raw), prefix_bench.SECTION)  # replaces
    text = md.read_text()
    assert "keep me" in text and text.count("<!-- bench:prefix-cache:start -->") == 1
    assert "| prefix caching on (fcfs) |" in text
