"""`make bench` smoke test: two tiny requests through tokenmill and both transformers baselines."""
from __future__ import annotations

import json

import pytest

from benchmarks import make_bench
from tokenmill.config import default_max_num_batched_tokens


def test_make_bench_runs_every_engine(tiny_llama_dir, workload_file, workload_requests, tmp_path):
    md, raw = tmp_path / "docs" / "benchmarks.md", tmp_path / "results" / "engine-core.json"
    md.parent.mkdir()
    md.write_text("# Benchmarks\n\n<!-- bench:other:start -->\nkeep me\n<!-- bench:other:end -->\n")
    argv = ["--model", str(tiny_llama_dir), "--workload", str(workload_file), "--output", str(md),
            "--results-json", str(raw), "--batch-size", "2", "--max-num-seqs", "4", "--no-tqdm", "--device", "cpu",
            "--kv-cache-memory-bytes", "64MiB"]
    report = make_bench.main(argv)

    assert report["settings"]["dtype"] == "float32" and report["section"] == "engine-core"
    wanted = sum(r["max_tokens"] for r in workload_requests)
    # A dense model at the defaults runs Q8_0 weights where the int8 kernels run: then a dense run (the
    # baselines' float32 weights) joins, as for a GGUF's kept blocks.
    rounded = report["results"]["tokenmill"]["numerics"]["weights"] == "q8_0"
    assert set(report["results"]) == {"tokenmill", "tokenmill-q8_0", "hf-static", "hf-naive"} | (
        {"tokenmill-dense"} if rounded else set())
    assert report["results"]["tokenmill-q8_0"]["engine_options"] == {"quantization": "q8_0",
                                                                      "kv_cache_dtype": "float16"}
    for result in report["results"].values():
        assert result["num_requests"] == 2
        assert result["output_tokens"] == wanted
        assert result["output_tok_s"] > 0
    # The static batch pads the short request up to the batch's longest max_tokens: waste, not output.
    assert report["results"]["hf-static"]["generated_tokens_incl_waste"] == 2 * 5
    assert {"tokenmill/hf-naive", "tokenmill/hf-static", "hf-static/hf-naive", "tokenmill-q8_0/hf-naive",
            "tokenmill-q8_0/hf-static", "tokenmill-q8_0/tokenmill"} <= set(report["ratios"])

    assert json.loads(raw.read_text())["results"]["tokenmill"]["output_tokens"] == wanted
    make_bench.update_markdown(md, make_bench.render_section(report, raw))  # a refresh replaces, never appends
    text = md.read_text()
    assert "keep me" in text
    assert text.count("<!-- bench:engine-core:start -->") == 1 and text.count("<!-- bench:engine-core:end -->") == 1
    # No budget given: the report carries the one the engine picked for the CPU, not a default of its own.
    assert report["settings"]["max_num_batched_tokens"] == default_max_num_batched_tokens("cpu")
    assert report["settings"]["max_num_seqs"] == 4 and report["results"]["tokenmill"]["concurrency"] == 2
    assert "| tokenmill `LLM.generate`" in text
    assert f"max_num_batched_tokens {default_max_num_batched_tokens('cpu')}," in text
    assert "| tokenmill `LLM.generate`, Q8_0 weights + float16 KV cache |" in text
    assert "With Q8_0 weights and a float16 KV cache" in text  # its ratios are kept apart from same-dtype ones


def test_make_bench_without_quantized_run(tiny_llama_dir, workload_file, tmp_path):
    argv = ["--model", str(tiny_llama_dir), "--workload", str(workload_file), "--output", str(tmp_path / "b.md"),
            "--results-json", str(tmp_path / "b.json"), "--skip-baselines", "--no-quantized", "--no-tqdm",
            "--device", "cpu", "--kv-cache-memory-bytes", "64MiB"]
    report = make_bench.main(argv)
    rounded = report["results"]["tokenmill"]["numerics"]["weights"] == "q8_0"
    assert set(report["results"]) == {"tokenmill"} | ({"tokenmill-dense"} if rounded else set())
    assert report["settings"]["quantized_run"] is None


@pytest.mark.gpu
def test_make_bench_on_cuda(tiny_llama_dir, workload_file, workload_requests, tmp_path):
    """On a GPU all three engines run there, in bfloat16 by default, into a section of their own."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    md = tmp_path / "b.md"
    md.write_text("# Benchmarks\n\n<!-- bench:engine-core:start -->\ncpu numbers\n<!-- bench:engine-core:end -->\n")
    argv = ["--model", str(tiny_llama_dir), "--workload", str(workload_file), "--output", str(md),
            "--results-json", str(tmp_path / "b.json"), "--batch-size", "2", "--max-num-seqs", "4", "--no-tqdm"]
    report = make_bench.main(argv)
    assert report["section"] == "engine-core-cuda" and report["settings"]["dtype"] == "bfloat16"
    assert set(report["results"]) == {"tokenmill", "hf-static", "hf-naive"}  # the Q8_0 kernels are CPU-only
    wanted = sum(r["max_tokens"] for r in workload_requests)
    assert all(r["output_tokens"] == wanted for r in report["results"].values())
    text = md.read_text()
    assert "cpu numbers" in text and "<!-- bench:engine-core-cuda:start -->" in text
    assert torch.cuda.get_device_name() in text


def test_ratios_pair_the_kept_gguf_run_with_its_dense_twin():
    results = {"tokenmill": {"output_tok_s": 120.0}, "tokenmill-dense": {"output_tok_s": 100.0},
               "hf-static": {"output_tok_s": 30.0}, "hf-naive": {"output_tok_s": 12.0}}
    got = make_bench.ratios(results)
    assert got["tokenmill/tokenmill-dense"] == 1.2 and got["tokenmill-dense/hf-static"] == 3.333
    assert got["tokenmill/hf-naive"] == 10.0 and "tokenmill-q8_0/tokenmill" not in got
