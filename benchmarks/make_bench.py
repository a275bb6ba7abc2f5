"""`make bench`: offline throughput of tokenmill against two plain-transformers baselines.

The fixed workload (../shared/bench/workload-64.jsonl) runs through tokenmill's `LLM.generate`, a
naive one-at-a-time `generate` loop and static left-padded batches of 16, all on the same weights,
dtype and threads, in one process, one after another (tokenmill at its default numerics, which it
chooses from the hardware and the report names, unless --dtype is given; where those keep weights in
blocks (a GGUF's, or a dense model's rounded to Q8_0), a dense run too, the weights as the baselines hold
them, in the exact mode, float32 like the baselines); with float32, tokenmill also runs once more
with Q8_0 weights and a float16 KV cache (`--no-quantized` to skip), reported apart. Prints a
table, refreshes the `bench:engine-core` section of docs/benchmarks.md and writes the raw numbers
to bench-results/engine-core.json.

    .venv/bin/python -m benchmarks.make_bench [--dtype bfloat16] [--naive-limit 16] ...
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.engine_options import effective, given
from benchmarks.paths import default_workload_path, module_command, repo_root
from benchmarks.tables import markdown_table, text_table
from tokenmill.entrypoints.engine_args import add_engine_args

SECTION = "engine-core"
ENGINE_LABELS = {
    "tokenmill": "tokenmill `LLM.generate` (continuous batching)",
    "tokenmill-dense": "tokenmill `LLM.generate`, weights dequantized to float32 (`--quantization none`)",
    "tokenmill-q8_0": "tokenmill `LLM.generate`, Q8_0 weights + float16 KV cache",
    "hf-static": "transformers static batches",
    "hf-naive": "transformers naive sequential `generate`",
}


def positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="make bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default=None, help="JSON-lines workload (default: ../shared/bench/workload-64.jsonl)")
    p.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="for all three engines (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="for all three engines (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--limit", type=positive, default=None, help="first N requests only (smoke runs)")
    p.add_argument("--skip-baselines", action="store_true", help="run tokenmill only")
    p.add_argument("--quantized", action=argparse.BooleanOptionalAction, default=True,
                   help="also run tokenmill with --quantization q8_0 --kv-cache-dtype float16 (float32 only)")
    p.add_argument("--naive-limit", type=positive, default=None,
                   help="run the naive baseline on the first N requests only (tok/s over those)")
    p.add_argument("--batch-size", type=positive, default=16, help="static-batch baseline batch size")
    # Engine options, the engine's own flags and defaults (EngineConfig).
    add_engine_args(p, ("max_num_seqs", "max_num_batched_tokens", "block_size", "enable_prefix_caching",
                        "kv_cache_memory_bytes"))
    p.add_argument("--threads", type=positive, default=None, help="torch CPU threads (default: usable cores)")
    p.add_argument("--output", default=None, help="markdown report (default: docs/benchmarks.md)")
    p.add_argument("--results-json", default=None, help="raw numbers (default: bench-results/engine-core.json)")
    p.add_argument("--no-tqdm", action="store_true", help="no progress bars")
    return p


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    import torch

    from tokenmill.bench.workloads import load_workload, workload_summary

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("make bench: --device cuda, but torch sees no CUDA device")
    args.dtype_given = args.dtype is not None  # else tokenmill runs at its own default numerics
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    section = section_name(args.device)
    threads = args.threads or _usable_cores()
    torch.set_num_threads(threads)
    workload_path = Path(args.workload) if args.workload else default_workload_path()
    requests = load_workload(workload_path, args.limit)
    report: dict[str, Any] = {
        "section": section,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": exact_command(argv),
        "machine": machine_info(threads, args.device),
        "settings": settings_of(args, threads),
        "workload": {"path": str(workload_path), "limit": args.limit, **workload_summary(requests)},
        "results": {},
    }
    report["results"]["tokenmill"] = run_tokenmill(args, requests, threads)
    report["settings"].update(report["results"]["tokenmill"]["engine_settings"])
    if report["results"]["tokenmill"]["gguf_layers_kept"]:
        # The baselines hold the file's weights dequantized to float32; so does this run.
        dense = {"quantization": "none", **({"numerics": "exact"} if args.dtype == "float32" else {})}
        report["results"]["tokenmill-dense"] = run_tokenmill(args, requests, threads, dense)
    if quantized_run(args):
        report["results"]["tokenmill-q8_0"] = run_tokenmill(args, requests, threads, QUANTIZED)
    if not args.skip_baselines:
        report["results"].update(run_baselines(args, requests))
    report["ratios"] = ratios(report["results"])
    print()
    print(format_table(report))
    publish_report(report, args, section, render_section)
    return report


def section_name(device: str) -> str:
    """CPU and GPU results live in separate sections of docs/benchmarks.md: neither overwrites the other."""
    return SECTION if device == "cpu" else f"{SECTION}-{device}"


def quantized_run(args: argparse.Namespace) -> bool:
    """The Q8_0 kernels are CPU kernels over float32 activations."""
    return args.quantized and args.dtype == "float32" and args.device == "cpu"


# The quantized configuration: llama.cpp's usual serving setup (8-bit weights, 16-bit KV cache) in
# tokenmill's terms. Its weights are not the baselines' float32 weights, so its ratios are reported apart.
QUANTIZED = {"quantization": "q8_0", "kv_cache_dtype": "float16"}


def run_tokenmill(args: argparse.Namespace, requests, threads: int,
                  engine_options: Optional[dict[str, str]] = None) -> dict[str, Any]:
    from tokenmill import LLM
    from tokenmill.bench.throughput import run_offline_throughput

    engine_options = engine_options or {}
    dtype = {"dtype": args.dtype} if args.dtype_given else {}
    llm = LLM(model=args.model, num_threads=threads, device=args.device, **dtype,
              **given(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                      block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
                      kv_cache_memory_bytes=args.kv_cache_memory_bytes),
              **engine_options)
    settings = effective(llm)
    shown = "".join(f", {k}={v}" for k, v in {**settings, **engine_options}.items())
    print(f"tokenmill: {len(requests)} requests, device={args.device}, dtype={args.dtype}{shown}", flush=True)
    runner = llm.llm_engine.core.core.runner
    linear_layers, gguf_layers_kept = runner.linear_layers, runner.num_gguf_layers_kept
    numerics = llm.llm_engine.numerics
    try:
        result = run_offline_throughput(llm, requests, use_tqdm=not args.no_tqdm)
    finally:
        del llm
        gc.collect()  # release the KV cache before the baselines load their model
    result["concurrency"] = min(settings["max_num_seqs"] or len(requests), len(requests))
    result["engine_options"] = engine_options
    result["engine_settings"] = settings
    result["linear_layers"] = linear_layers
    result["numerics"] = {name: choice["value"] for name, choice in numerics.items()}
    result["gguf_layers_kept"] = gguf_layers_kept
    _print_result(result)
    return result


def run_baselines(args: argparse.Namespace, requests) -> dict[str, Any]:
    from benchmarks.baselines import load_hf_model, run_naive, run_static_batches

    hf = load_hf_model(args.model, args.dtype, args.device)
    out: dict[str, Any] = {}
    print(f"hf-static: {len(requests)} requests in batches of {args.batch_size}", flush=True)
    out["hf-static"] = run_static_batches(hf, requests, args.batch_size, progress=not args.no_tqdm)
    _print_result(out["hf-static"])
    naive_requests = requests[:args.naive_limit] if args.naive_limit else requests
    print(f"hf-naive: {len(naive_requests)} requests one at a time", flush=True)
    out["hf-naive"] = run_naive(hf, naive_requests, progress=not args.no_tqdm)
    out["hf-naive"]["subset_of_workload"] = len(naive_requests) < len(requests)
    _print_result(out["hf-naive"])
    del hf
    gc.collect()
    return out


def _print_result(r: dict[str, Any]) -> None:
    print(f"  {r['engine']}: {r['output_tokens']} output tokens in {r['wall_s']:.2f} s -> "
          f"{r['output_tok_s']:.1f} output tok/s, {r['total_tok_s']:.1f} total tok/s", flush=True)


def ratios(results: dict[str, Any]) -> dict[str, float]:
    tok = {name: r["output_tok_s"] for name, r in results.items()}
    pairs = [("tokenmill", "hf-naive"), ("tokenmill", "hf-static"), ("tokenmill-dense", "hf-naive"),
             ("tokenmill-dense", "hf-static"), ("tokenmill", "tokenmill-dense"), ("hf-static", "hf-naive"),
             ("tokenmill-q8_0", "hf-naive"), ("tokenmill-q8_0", "hf-static"), ("tokenmill-q8_0", "tokenmill")]
    return {f"{a}/{b}": round(tok[a] / tok[b], 3) for a, b in pairs if a in tok and tok.get(b)}


# ---- machine, settings, command --------------------------------------------------------------
def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info(threads: int, device: str = "cpu") -> dict[str, Any]:
    import torch
    import transformers

    return {
        "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cores": _usable_cores(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def settings_of(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    return {
        "model": args.model or "SmolLM2-135M-Instruct (embedded Q4_1 GGUF)",
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "enable_prefix_caching": args.enable_prefix_caching,
        "static_batch_size": args.batch_size,
        "naive_limit": args.naive_limit,
        "skip_baselines": args.skip_baselines,
        "device": args.device,
        "quantized_run": QUANTIZED if quantized_run(args) else None,
        "threads": threads,
        "sampling": "greedy, ignore_eos, exactly max_tokens per request",
    }


def exact_command(argv: Sequence[str]) -> str:
    """How this run was started: `make bench ARGS=...` under make, else the python -m line."""
    if os.environ.get("MAKELEVEL"):
        joined = shlex.join(argv)
        return "make bench" + (f" ARGS={shlex.quote(joined)}" if joined else "")
    return module_command("benchmarks.make_bench", argv)


# ---- output ------------------------------------------------------------------------------
def _rows(report: dict[str, Any]) -> list[list[str]]:
    results = report["results"]
    naive = results.get("hf-naive", {}).get("output_tok_s")
    rows = []
    for name in ENGINE_LABELS:
        r = results.get(name)
        if r is None:
            continue
        vs_naive = f"{r['output_tok_s'] / naive:.2f}x" if naive else "-"
        rows.append([ENGINE_LABELS[name], str(r.get("concurrency", "-")), str(r["num_requests"]),
                     str(r["output_tokens"]), f"{r['wall_s']:.1f}", f"{r['output_tok_s']:.1f}",
                     f"{r['total_tok_s']:.1f}", vs_naive])
    return rows


TABLE_HEADER = ["engine", "concurrency", "requests", "output tokens", "wall (s)", "output tok/s",
                "total tok/s", "vs naive"]


def format_table(report: dict[str, Any]) -> str:
    lines = text_table(TABLE_HEADER, _rows(report))
    if report.get("ratios"):
        lines.append("ratios (output tok/s): " + ", ".join(f"{k} = {v:.2f}x" for k, v in report["ratios"].items()))
    return "\n".join(lines)


def render_section(report: dict[str, Any], json_path: Path) -> str:
    m, s, w = report["machine"], report["settings"], report["workload"]
    md_rows = markdown_table(TABLE_HEADER, _rows(report))
    name = report.get("section", SECTION)
    on_gpu = m.get("gpu") is not None
    where = (f"{m['gpu']} (host: {m['cpu']}, {m['usable_cores']} usable cores)" if on_gpu else
             f"{m['cpu']} ({m['usable_cores']} usable of {m['logical_cpus']} logical CPUs, "
             f"{m['torch_threads']} torch threads)")
    lines = [
        f"<!-- bench:{name}:start -->",
        "## Engine core: offline throughput (`make bench`" + (", CUDA)" if on_gpu else ")"),
        "",
        f"Measured {report['date']} on {where}, torch {m['torch']}, transformers {m['transformers']}, "
        f"Python {m['python']}.",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Workload: `{Path(w['path']).name}`" + (f" (first {w['limit']} requests)" if w.get("limit") else "")
        + f", {w['num_requests']} requests, {w['prompt_tokens']} prompt tokens, {w['output_tokens']} output "
        "tokens; every request generates exactly its `max_tokens` (greedy, EOS ignored), all queued at t=0.",
        "",
        f"Settings: model {s['model']}, dtype {s['dtype']} for the baselines (tokenmill's numerics below), "
        f"max_num_seqs {s['max_num_seqs']}, "
        f"max_num_batched_tokens {s['max_num_batched_tokens']}, block size {s['block_size']}, prefix caching "
        f"{'on' if s['enable_prefix_caching'] else 'off'}."
        + (" The Q8_0 row rounds the decoder projections and the LM head to GGUF's Q8_0 at load and keeps K/V in "
           "float16 (`--quantization q8_0 --kv-cache-dtype float16`)." if s.get("quantized_run") else ""),
        "",
        *md_rows,
        "",
        *_notes(report),
        "",
        f"Raw numbers: `{_display_path(json_path)}`.",
        f"<!-- bench:{name}:end -->",
    ]
    return "\n".join(lines) + "\n"


def _notes(report: dict[str, Any]) -> list[str]:
    results, notes = report["results"], []
    ratios_ = report.get("ratios") or {}
    same_dtype = {k: v for k, v in ratios_.items() if "q8_0" not in k}
    quantized = {k: v for k, v in ratios_.items() if "q8_0" in k}
    for name in ("tokenmill", "tokenmill-dense", "tokenmill-q8_0"):
        chosen = results.get(name, {}).get("numerics")
        if chosen:
            notes.append(f"{name} numerics: dtype {chosen['dtype']}, block matmul {chosen['block_matmul']}, KV cache "
                         f"{chosen['kv_cache_dtype']}.")
    if results.get("tokenmill", {}).get("gguf_layers_kept"):
        notes.append("tokenmill keeps the GGUF's quantized matrices as stored (4-bit or int8 values with a float32 "
                     "scale and offset per 32, the very values transformers dequantizes them to); the dense row and "
                     "the baselines hold the same values as float32 tensors.")
    if same_dtype:
        notes.append("Ratios of output tok/s, same weight values (tokenmill in the numerics above): "
                     + ", ".join(f"{k} **{v:.2f}x**" for k, v in same_dtype.items()) + ".")
    if quantized:
        notes.append("With Q8_0 weights and a float16 KV cache (weights rounded to 8 bits at load, so not the "
                     "baselines' numbers; accuracy cost in docs/performance.md): "
                     + ", ".join(f"{k} **{v:.2f}x**" for k, v in quantized.items()) + ".")
    for name in ("tokenmill", "tokenmill-dense", "tokenmill-q8_0"):
        tm = results.get(name, {})
        if tm.get("ttft_p50_s") is not None:
            notes.append(f"{name} TTFT p50 / p95: {tm['ttft_p50_s']:.2f} / {tm['ttft_p95_s']:.2f} s; "
                         f"{tm.get('num_cached_prompt_tokens', 0)} prompt tokens served from the prefix cache, "
                         f"{tm.get('num_preemptions', 0)} preemptions.")
    static = results.get("hf-static")
    if static:
        notes.append(f"Static batches: requests in workload order, left-padded, {static['batch_size']} a batch; each "
                     "batch runs until its longest `max_tokens`, and only each request's own `max_tokens` count as "
                     f"output ({static['output_tokens']} of {static['generated_tokens_incl_waste']} generated).")
    naive = results.get("hf-naive")
    if naive and naive.get("subset_of_workload"):
        notes.append(f"The naive baseline ran on the first {naive['num_requests']} requests only "
                     "(`--naive-limit`); its tok/s is over those requests.")
    if report["settings"].get("skip_baselines") or not (static or naive):
        notes.append("Baselines skipped (`--skip-baselines`).")
    return ["- " + n for n in notes]


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(repo_root()))
    except ValueError:
        return str(path)


def publish_report(report: dict[str, Any], args: argparse.Namespace, section: str, render_section) -> None:
    """Write the JSON under bench-results/ and the report's section of docs/benchmarks.md
    (or where --results-json / --output point), then say where."""
    root = repo_root()
    json_path = Path(args.results_json) if args.results_json else root / "bench-results" / f"{section}.json"
    md_path = Path(args.output) if args.output else root / "docs" / "benchmarks.md"
    write_json(json_path, report)
    update_markdown(md_path, render_section(report, json_path), name=section)
    print(f"\nwrote {md_path} (section {section}) and {json_path}")


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def update_markdown(path: Path, section: str, name: str = SECTION) -> None:
    """Replace the marked section `name` (default: this benchmark's), keeping every other section."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    start_mark, end_mark = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    start, end = text.find(start_mark), text.find(end_mark)
    if start != -1 and end > start:
        text = text[:start] + section.rstrip("\n") + text[end + len(end_mark):]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
