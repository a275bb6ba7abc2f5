"""`python -m benchmarks.mixed_bench` smoke run: long-prompt isolation on and off on the tiny Llama."""
from __future__ import annotations

import torch

from benchmarks import mixed_bench


def test_mixed_bench_smoke_runs_isolation_on_and_off(tiny_llama_dir, tmp_path):
    md, raw = tmp_path / "benchmarks.md", tmp_path / "scheduling.json"
    md.write_text("# Benchmarks\n\n<!-- bench:engine-core:start -->\nkeep me\n<!-- bench:engine-core:end -->\n")
    argv = ["--model", str(tiny_llama_dir), "--cpu", "--max-model-len", "512", "--kv-cache-memory-bytes", "64MiB",
            "--limit", "3", "--num-long", "1",
            "--long-prompt-len", "300", "--short-prompt-len", "8", "--short-max-tokens", "6", "--threshold", "32",
            "--max-num-batched-tokens", "128", "--threads", "1", "--output", str(md), "--results-json", str(raw)]
    threads = torch.get_num_threads()
    try:
        report = mixed_bench.main(argv)
    finally:
        torch.set_num_threads(threads)  # the bench sets the process-wide thread count
    assert set(report["results"]) == {"isolation on", "isolation off"}
    for result in report["results"].values():
        assert result["short_ttft_ms"]["p50"] > 0 and result["short_itl_ms"]["p99"] > 0
    # With isolation the 300-token prompt needs ceil(300 / 32) chunks, without it ceil(300 / 128).
    assert report["results"]["isolation on"]["num_steps"] > report["results"]["isolation off"]["num_steps"]
    text = md.read_text()
    assert "keep me" in text and text.count(mixed_bench.START_MARK) == 1 and "| isolation on | 32 |" in text
    assert raw.is_file()
    workload = mixed_bench.build_workload(1000, num_short=2, num_long=1, short_prompt_len=4, short_max_tokens=2,
                                          long_prompt_len=10, long_max_tokens=1, short_every=1, long_every=5, seed=3)
    assert [(r.request_id, r.arrival_step) for r in workload] == [("short-0", 0), ("long-0", 1), ("short-1", 1)]
    assert workload == mixed_bench.build_workload(1000, num_short=2, num_long=1, short_prompt_len=4,
                                                  short_max_tokens=2, long_prompt_len=10, long_max_tokens=1,
                                                  short_every=1, long_every=5, seed=3)
