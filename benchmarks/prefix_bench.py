"""Prefix-cache benchmark: the shared-prefix workload through `LLM.generate`, caching off vs on.

64 requests (8 system prompts of ~1,000 tokens x 8 short questions, synthetic token ids, 32 output
tokens each, greedy, EOS ignored) run through a fresh `LLM` per configuration: prefix caching off,
on (fcfs), and on with the cache-aware `lpm` policy. Reports throughput, TTFT (mean / p50 / p95,
from each request's metrics: first_token_time - arrival_time) and the prefix-cache hit rate
(hit tokens / looked-up tokens), prints a table, refreshes the `bench:prefix-cache` section of
docs/benchmarks.md and writes the raw numbers to bench-results/prefix-cache.json.

    .venv/bin/python -m benchmarks.prefix_bench                    # the full run
    .venv/bin/python -m benchmarks.prefix_bench --limit 8 --num-prefixes 2 --prefix-len 64  # smoke
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import statistics
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.engine_options import effective, given
from benchmarks.make_bench import _display_path, _usable_cores, machine_info, positive, publish_report
from benchmarks.paths import module_command
from benchmarks.shared_prefix import SharedPrefixSpec, build_shared_prefix_workload, ideal_cached_tokens
from benchmarks.tables import markdown_table, text_table
from tokenmill.bench.throughput import generate_timed, percentile, throughput_result, warm_up_llm
from tokenmill.bench.workloads import WorkloadRequest, workload_summary
from tokenmill.entrypoints.engine_args import add_engine_args

SECTION = "prefix-cache"
# name -> (label, LLM keyword arguments)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "cache-off": ("prefix caching off", {"enable_prefix_caching": False, "scheduling_policy": "fcfs"}),
    "cache-on": ("prefix caching on (fcfs)", {"enable_prefix_caching": True, "scheduling_policy": "fcfs"}),
    "cache-on-lpm": ("prefix caching on, lpm policy", {"enable_prefix_caching": True, "scheduling_policy": "lpm"}),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefix_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--limit", type=positive, default=None, help="first N requests only (smoke runs)")
    p.add_argument("--num-prefixes", type=positive, default=8, help="distinct system prompts")
    p.add_argument("--questions-per-prefix", type=positive, default=8)
    p.add_argument("--prefix-len", type=positive, default=1000, help="system prompt length in tokens")
    p.add_argument("--max-tokens", type=positive, default=32, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic token ids")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of {', '.join(CONFIGS)}")
    # Engine options, the engine's own flags and defaults (EngineConfig).
    add_engine_args(p, ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes"))
    p.add_argument("--threads", type=positive, default=None, help="torch CPU threads (default: usable cores)")
    p.add_argument("--output", default=None, help="markdown report (default: docs/benchmarks.md)")
    p.add_argument("--results-json", default=None, help="raw numbers (default: bench-results/prefix-cache.json)")
    p.add_argument("--no-tqdm", action="store_true", help="no progress bars")
    return p


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise SystemExit(f"prefix_bench: unknown config(s) {unknown}; choose from {', '.join(CONFIGS)}")
    import torch

    threads = args.threads or _usable_cores()
    torch.set_num_threads(threads)
    spec = SharedPrefixSpec(num_prefixes=args.num_prefixes, questions_per_prefix=args.questions_per_prefix,
                            prefix_len=args.prefix_len, max_tokens=args.max_tokens, seed=args.seed)
    report: dict[str, Any] = {
        "section": SECTION,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": exact_command(argv),
        "machine": machine_info(threads),
        "settings": settings_of(args, threads),
        "workload": {"name": "shared-prefix", **spec.to_dict(), "limit": args.limit},
        "results": {},
    }
    requests: Optional[list[WorkloadRequest]] = None
    for name in configs:
        llm = make_llm(args, threads, CONFIGS[name][1])
        try:
            if requests is None:  # token ids need the model's vocabulary size
                requests = build_shared_prefix_workload(spec, llm.llm_engine.hf_config.vocab_size, args.limit)
                report["workload"].update(workload_summary(requests))
                report["settings"].update(effective(llm, ENGINE_SETTINGS))
                block_size = report["settings"]["block_size"]
                report["workload"]["ideal_cached_tokens"] = ideal_cached_tokens(spec, len(requests), block_size)
                report["device"] = str(llm.llm_engine.core.core.runner.device)
            print(f"{name}: {len(requests)} requests", flush=True)
            report["results"][name] = measure(llm, requests, name, use_tqdm=not args.no_tqdm)
        finally:
            del llm
            _release_memory(torch)
        _print_result(report["results"][name])
    report["ratios"] = ratios(report["results"])
    print()
    print(format_table(report))
    publish_report(report, args, SECTION, render_section)
    return report


def make_llm(args: argparse.Namespace, threads: int, config: dict[str, Any]):
    from tokenmill import LLM

    return LLM(model=args.model, dtype=args.dtype, device=args.device, num_threads=threads,
               **given(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes),
               **config)


# Resolved by the engine and recorded with the results (the configurations differ in prefix caching).
ENGINE_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "block_size")


def _release_memory(torch) -> None:
    gc.collect()  # the next configuration gets a fresh KV cache of the same size
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(llm, requests: Sequence[WorkloadRequest], name: str, use_tqdm: bool = True) -> dict[str, Any]:
    """One timed `LLM.generate` over the whole workload (all queued at t=0), after an untimed warm-up."""
    warm_up_llm(llm, requests)
    core = llm.llm_engine.core.core
    stats = core.kv_cache.prefix_stats
    queries0, hits0, evictions0 = stats.queries, stats.hits, core.kv_cache.pool.num_evictions
    wall, outputs = generate_timed(llm, requests, use_tqdm, name)
    queries, hits = stats.queries - queries0, stats.hits - hits0
    return throughput_result(
        name, wall,
        prompt_tokens=sum(r.prompt_len for r in requests),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        num_requests=len(requests),
        **ttft_stats(outputs),
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        hit_rate=round(hits / queries, 4) if queries else 0.0,
        num_cached_prompt_tokens=sum(o.num_cached_tokens for o in outputs),
        num_evictions=core.kv_cache.pool.num_evictions - evictions0,
        num_preemptions=sum(o.metrics.num_preemptions for o in outputs if o.metrics is not None),
        num_kv_blocks=core.kv_cache.pool.num_blocks,
    )


def ttft_stats(outputs) -> dict[str, Optional[float]]:
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs
             if o.metrics is not None and o.metrics.first_token_time is not None]

    def r(x: Optional[float]) -> Optional[float]:
        return None if x is None else round(x, 4)

    return {
        "ttft_mean_s": r(statistics.fmean(ttfts)) if ttfts else None,
        "ttft_p50_s": r(percentile(ttfts, 50)),
        "ttft_p95_s": r(percentile(ttfts, 95)),
    }


def _print_result(r: dict[str, Any]) -> None:
    print(f"  {r['engine']}: {r['output_tokens']} output tokens in {r['wall_s']:.2f} s -> "
          f"{r['output_tok_s']:.1f} output tok/s, {r['total_tok_s']:.1f} total tok/s, "
          f"TTFT mean {_s(r['ttft_mean_s'])} s, hit rate {r['hit_rate']:.1%}", flush=True)


def ratios(results: dict[str, Any]) -> dict[str, float]:
    """Speed-ups over caching off: output tok/s (total tok/s is the same ratio) and mean TTFT."""
    base = results.get("cache-off")
    out: dict[str, float] = {}
    if not base:
        return out
    for name, r in results.items():
        if name == "cache-off":
            continue
        out[f"{name}/cache-off throughput"] = round(r["output_tok_s"] / base["output_tok_s"], 3)
        if r.get("ttft_mean_s") and base.get("ttft_mean_s"):
            out[f"cache-off/{name} mean TTFT"] = round(base["ttft_mean_s"] / r["ttft_mean_s"], 3)
    return out


# ---- output ------------------------------------------------------------------------------
TABLE_HEADER = ["configuration", "output tok/s", "total tok/s", "wall (s)", "TTFT mean (s)", "TTFT p50 (s)",
                "TTFT p95 (s)", "hit rate", "preemptions", "vs off"]


def _s(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def _rows(report: dict[str, Any]) -> list[list[str]]:
    results = report["results"]
    base = results.get("cache-off", {}).get("output_tok_s")
    rows = []
    for name, r in results.items():
        rows.append([CONFIGS[name][0], f"{r['output_tok_s']:.1f}", f"{r['total_tok_s']:.1f}", f"{r['wall_s']:.1f}",
                     _s(r["ttft_mean_s"]), _s(r["ttft_p50_s"]), _s(r["ttft_p95_s"]), f"{r['hit_rate']:.1%}",
                     str(r["num_preemptions"]), f"{r['output_tok_s'] / base:.2f}x" if base else "-"])
    return rows


def format_table(report: dict[str, Any]) -> str:
    lines = text_table(TABLE_HEADER, _rows(report))
    if report.get("ratios"):
        lines.append("ratios: " + ", ".join(f"{k} = {v:.2f}x" for k, v in report["ratios"].items()))
    return "\n".join(lines)


def render_section(report: dict[str, Any], json_path: Path) -> str:
    m, s, w = report["machine"], report["settings"], report["workload"]
    md_rows = markdown_table(TABLE_HEADER, _rows(report))
    ideal = w["ideal_cached_tokens"] / w["prompt_tokens"] if w.get("prompt_tokens") else 0.0
    lines = [
        f"<!-- bench:{SECTION}:start -->",
        "## Prefix caching: shared-prefix workload (`python -m benchmarks.prefix_bench`)",
        "",
        f"Measured {report['date']} on {report.get('device', '?')} ({m['cpu']}, {m['usable_cores']} usable of "
        f"{m['logical_cpus']} logical CPUs, {m['torch_threads']} torch threads), torch {m['torch']}, "
        f"transformers {m['transformers']}, Python {m['python']}.",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Workload: {w['num_requests']} requests" + (f" (first {w['limit']})" if w.get("limit") else "")
        + f": {w['num_prefixes']} system prompts of {w['prefix_len']} synthetic tokens x "
        f"{w['questions_per_prefix']} questions of {w['min_question_len']}-{w['max_question_len']} tokens, "
        f"arriving round-robin over the system prompts, all queued at t=0; {w['prompt_tokens']} prompt tokens, "
        f"{w['output_tokens']} output tokens ({w['max_tokens']} per request, greedy, EOS ignored). A perfect "
        f"cache (each system prompt computed once) would serve {ideal:.1%} of the prompt tokens.",
        "",
        f"Settings: model {s['model']}, dtype {s['dtype']}, max_num_seqs {s['max_num_seqs']}, "
        f"max_num_batched_tokens {s['max_num_batched_tokens']}, block size {s['block_size']}, KV cache "
        f"{s['kv_cache_memory_bytes'] or 'default size'} ({_kv_blocks(report)} blocks); a fresh `LLM` per "
        "configuration.",
        "",
        *md_rows,
        "",
        *_notes(report),
        "",
        f"Raw numbers: `{_display_path(json_path)}`.",
        f"<!-- bench:{SECTION}:end -->",
    ]
    return "\n".join(lines) + "\n"


def _kv_blocks(report: dict[str, Any]) -> str:
    blocks = {r.get("num_kv_blocks") for r in report["results"].values()}
    return "/".join(str(b) for b in sorted(b for b in blocks if b is not None)) or "?"


def _notes(report: dict[str, Any]) -> list[str]:
    notes = []
    if report.get("ratios"):
        speedups = ", ".join(f"{k} **{v:.2f}x**" for k, v in report["ratios"].items())
        notes.append(f"Speed-ups over caching off: {speedups}.")
    notes.append("TTFT = first_token_time - arrival_time of each request (RequestOutput.metrics); hit rate = "
                 "prompt tokens served from the cache / prompt tokens looked up (`prefix_stats`), over the timed run.")
    if "cache-on-lpm" in report["results"]:
        notes.append("lpm admits the waiting request with the longest cached prefix first, but a request waiting "
                     "longer than 5 s goes first anyway; here every request arrives at t=0, so lpm only reorders "
                     "the first seconds of the run.")
    return ["- " + n for n in notes]


def settings_of(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    return {
        "model": args.model or "SmolLM2-135M-Instruct (embedded Q4_1 GGUF)",
        "dtype": args.dtype,
        "device": args.device,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "configs": args.configs,
        "threads": threads,
        "sampling": "greedy, ignore_eos, exactly max_tokens per request",
    }


def exact_command(argv: Sequence[str]) -> str:
    """The python -m line that reproduces this run (also when a make target started it)."""
    return module_command("benchmarks.prefix_bench", argv)


if __name__ == "__main__":
    main()
