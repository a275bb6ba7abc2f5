"""Mixed workload: many short chats next to a few very long prompts, long-prompt isolation on vs off.

The same deterministic workload (synthetic token ids) runs twice through the LLMEngine step loop,
once with `long_prefill_token_threshold` set (a long prompt advances at most that many tokens a
step, so decodes keep flowing) and once without. Requests arrive by step number, not wall time, so
both runs see the same arrival pattern. Each engine step is timed, and every request's tokens are
stamped with the wall time of the step that produced them; the short requests' TTFT and inter-token
latency percentiles are the result. Prints a table, refreshes the `bench:scheduling` section of
docs/benchmarks.md and writes bench-results/scheduling.json.

    .venv/bin/python -m benchmarks.mixed_bench [--threshold 256] [--limit 8] ...
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.engine_options import effective, given
from benchmarks.make_bench import _display_path, _usable_cores, machine_info, positive, publish_report
from benchmarks.paths import module_command
from benchmarks.tables import markdown_table, text_table
from tokenmill.bench.throughput import BenchmarkError, percentile
from tokenmill.entrypoints.engine_args import add_engine_args

SECTION = "scheduling"
START_MARK = f"<!-- bench:{SECTION}:start -->"
END_MARK = f"<!-- bench:{SECTION}:end -->"
# Token ids are drawn from this range: clear of the special tokens at the bottom of most vocabularies.
FIRST_TOKEN_ID = 100


@dataclass(slots=True)
class MixedRequest:
    request_id: str
    kind: str  # "short" | "long"
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_step: int


@dataclass(slots=True)
class Timeline:
    """When a request was added and when each of its tokens came back (perf_counter seconds)."""
    arrival: float
    token_times: list[float] = field(default_factory=list)


# ---- workload ----------------------------------------------------------------------------------
def build_workload(vocab_size: int, *, num_short: int, num_long: int, short_prompt_len: int, short_max_tokens: int,
                   long_prompt_len: int, long_max_tokens: int, short_every: int, long_every: int,
                   seed: int) -> list[MixedRequest]:
    """Shorts arrive one every `short_every` steps from step 0; longs one every `long_every` steps
    from step 1, so each long prefill lands among running short decodes."""
    rng = random.Random(seed)
    high = max(vocab_size - 1, FIRST_TOKEN_ID + 1)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, high) for _ in range(n)]

    requests = [MixedRequest(f"short-{i}", "short", prompt(short_prompt_len), short_max_tokens, i * short_every)
                for i in range(num_short)]
    requests += [MixedRequest(f"long-{i}", "long", prompt(long_prompt_len), long_max_tokens, 1 + i * long_every)
                 for i in range(num_long)]
    return sorted(requests, key=lambda r: (r.arrival_step, r.request_id))


# ---- one run -----------------------------------------------------------------------------------
def run_mode(llm, workload: Sequence[MixedRequest], max_steps: int = 1_000_000) -> dict[str, Any]:
    """Step the engine ourselves, adding requests at their arrival step; returns timelines and steps."""
    from tokenmill.engine.input_processor import ProcessedPrompt
    from tokenmill.sampling_params import SamplingParams

    engine = llm.llm_engine
    pending = list(workload)
    timelines: dict[str, Timeline] = {}
    step_times: list[float] = []
    lengths: dict[str, int] = {}
    step = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        if step >= max_steps:
            raise BenchmarkError(f"not done after {max_steps} steps")
        if not engine.has_unfinished_requests() and pending[0].arrival_step > step:
            step = pending[0].arrival_step  # idle engine: jump to the next arrival
        while pending and pending[0].arrival_step <= step:
            r = pending.pop(0)
            params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
            engine.add_request(r.request_id, ProcessedPrompt(None, list(r.prompt_token_ids)), params)
            timelines[r.request_id] = Timeline(arrival=time.perf_counter())
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        step_times.append(now - before)
        for out in outputs:
            timeline = timelines[out.request_id]
            count = len(out.outputs[0].token_ids)
            timeline.token_times.extend([now] * (count - len(timeline.token_times)))
            if out.finished:
                lengths[out.request_id] = count
        step += 1
    wall = time.perf_counter() - start
    _check_lengths(workload, lengths)
    stats = engine.core.core.get_stats()
    return {"timelines": timelines, "step_times": step_times, "wall_s": wall,
            "num_preemptions": stats.num_preemptions}


def _check_lengths(workload: Sequence[MixedRequest], lengths: dict[str, int]) -> None:
    bad = [(r.request_id, r.max_tokens, lengths.get(r.request_id)) for r in workload
           if lengths.get(r.request_id) != r.max_tokens]
    if bad:
        shown = ", ".join(f"{rid}: asked {want}, got {got}" for rid, want, got in bad[:5])
        raise BenchmarkError(f"{len(bad)} request(s) did not generate exactly max_tokens ({shown})")


def summarize(run: dict[str, Any], workload: Sequence[MixedRequest]) -> dict[str, Any]:
    """Percentiles (ms) of the short requests' TTFT and inter-token latency; the long ones' TTFT."""
    kinds = {r.request_id: r.kind for r in workload}
    ttft: dict[str, list[float]] = {"short": [], "long": []}
    itl: list[float] = []
    for rid, timeline in run["timelines"].items():
        ttft[kinds[rid]].append(timeline.token_times[0] - timeline.arrival)
        if kinds[rid] == "short":
            itl.extend(b - a for a, b in zip(timeline.token_times, timeline.token_times[1:]))

    def ms(values: list[float], q: float) -> Optional[float]:
        value = percentile(values, q)
        return None if value is None else round(value * 1000, 2)

    output_tokens = sum(r.max_tokens for r in workload)
    return {
        "short_ttft_ms": {f"p{q}": ms(ttft["short"], q) for q in (50, 95, 99)},
        "short_itl_ms": {f"p{q}": ms(itl, q) for q in (50, 95, 99)},
        "short_itl_max_ms": ms(itl, 100),
        "long_ttft_ms": {f"p{q}": ms(ttft["long"], q) for q in (50, 100)},
        "num_steps": len(run["step_times"]),
        "step_ms": {"p50": ms(run["step_times"], 50), "max": ms(run["step_times"], 100)},
        "wall_s": round(run["wall_s"], 3),
        "output_tok_s": round(output_tokens / max(run["wall_s"], 1e-9), 2),
        "num_preemptions": run["num_preemptions"],
    }


def _warm_up(llm, vocab_size: int) -> None:
    """An untimed request so first-call costs stay out of both runs."""
    from tokenmill.sampling_params import SamplingParams

    ids = list(range(FIRST_TOKEN_ID, min(FIRST_TOKEN_ID + 8, vocab_size)))
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
                 use_tqdm=False)


def run_both(args: argparse.Namespace, threads: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(workload summary, {mode: summary}) for isolation on, then off, each on a fresh engine."""
    from tokenmill import LLM

    results: dict[str, Any] = {}
    workload: list[MixedRequest] = []
    for mode, threshold in (("isolation on", args.threshold), ("isolation off", None)):
        llm = LLM(model=args.model, dtype=args.dtype, device="cpu" if args.cpu else None,
                  **given(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes),
                  long_prefill_token_threshold=threshold, max_long_partial_prefills=args.max_long_partial_prefills,
                  enable_prefix_caching=False, num_threads=threads, max_model_len=args.max_model_len)
        vocab_size = llm.llm_engine.hf_config.vocab_size
        if not workload:
            workload = workload_from_args(args, vocab_size)
        _warm_up(llm, vocab_size)
        print(f"{mode}: {len(workload)} requests, long_prefill_token_threshold={threshold}", flush=True)
        summary = summarize(run_mode(llm, workload), workload)
        summary["long_prefill_token_threshold"] = threshold
        summary["engine_settings"] = effective(llm, ("max_num_seqs", "max_num_batched_tokens"))
        results[mode] = summary
        print(f"  wall {summary['wall_s']:.2f} s, {summary['num_steps']} steps, short ITL p99 "
              f"{summary['short_itl_ms']['p99']} ms", flush=True)
        del llm
        gc.collect()
    return workload_summary(workload), results


def workload_from_args(args: argparse.Namespace, vocab_size: int) -> list[MixedRequest]:
    num_short = min(args.num_short, args.limit) if args.limit else args.num_short
    return build_workload(vocab_size, num_short=num_short, num_long=args.num_long,
                          short_prompt_len=args.short_prompt_len, short_max_tokens=args.short_max_tokens,
                          long_prompt_len=args.long_prompt_len, long_max_tokens=args.long_max_tokens,
                          short_every=args.short_every, long_every=args.long_every, seed=args.seed)


def workload_summary(workload: Sequence[MixedRequest]) -> dict[str, Any]:
    shorts = [r for r in workload if r.kind == "short"]
    longs = [r for r in workload if r.kind == "long"]
    return {
        "num_short": len(shorts), "num_long": len(longs),
        "short_prompt_len": len(shorts[0].prompt_token_ids) if shorts else None,
        "short_max_tokens": shorts[0].max_tokens if shorts else None,
        "long_prompt_len": len(longs[0].prompt_token_ids) if longs else None,
        "long_max_tokens": longs[0].max_tokens if longs else None,
        "arrivals": {r.request_id: r.arrival_step for r in workload},
    }


# ---- command line and report -------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mixed_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--cpu", action="store_true", help="force the CPU even where CUDA is available")
    p.add_argument("--num-short", type=positive, default=48, help="short chat requests")
    p.add_argument("--num-long", type=positive, default=2, help="very long prompts")
    p.add_argument("--limit", type=positive, default=None, help="first N short requests only (smoke runs)")
    p.add_argument("--short-prompt-len", type=positive, default=96)
    p.add_argument("--short-max-tokens", type=positive, default=48)
    p.add_argument("--long-prompt-len", type=positive, default=3072)
    p.add_argument("--long-max-tokens", type=positive, default=8)
    p.add_argument("--short-every", type=positive, default=1, help="a short request arrives every N steps")
    p.add_argument("--long-every", type=positive, default=24, help="a long prompt arrives every N steps")
    p.add_argument("--threshold", type=positive, default=256,
                   help="long_prefill_token_threshold of the isolation-on run")
    p.add_argument("--max-long-partial-prefills", type=positive, default=1)
    # Engine options, the engine's own flags and defaults (EngineConfig); the benchmark's prompts need a 4096-token
    # context whatever the model's own limit is.
    add_engine_args(p, ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"))
    p.add_argument("--max-model-len", type=positive, default=4096)
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic token ids")
    p.add_argument("--threads", type=positive, default=None, help="torch CPU threads (default: usable cores)")
    p.add_argument("--output", default=None, help="markdown report (default: docs/benchmarks.md)")
    p.add_argument("--results-json", default=None, help="raw numbers (default: bench-results/scheduling.json)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.long_prompt_len + args.long_max_tokens > args.max_model_len:
        raise SystemExit("--long-prompt-len + --long-max-tokens must fit in --max-model-len")
    import torch

    threads = args.threads or _usable_cores()
    torch.set_num_threads(threads)
    workload, results = run_both(args, threads)
    report: dict[str, Any] = {
        "section": SECTION,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": exact_command(argv),
        "machine": machine_info(threads),
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "results_json")},
        "workload": workload,
        "results": results,
    }
    # What the engine ran with, where the command line left an option to the engine's default.
    report["settings"].update(next(iter(results.values()))["engine_settings"])
    print()
    print(format_table(report))
    publish_report(report, args, SECTION, render_section)
    return report


def exact_command(argv: Sequence[str]) -> str:
    return module_command("benchmarks.mixed_bench", argv)


TABLE_HEADER = ["run", "threshold", "short TTFT p50/p95/p99 (ms)", "short ITL p50/p95/p99 (ms)",
                "short ITL max (ms)", "long TTFT p50 (ms)", "steps", "wall (s)"]


def _rows(report: dict[str, Any]) -> list[list[str]]:
    def triple(d: dict[str, Optional[float]]) -> str:
        return " / ".join("-" if v is None else f"{v:.1f}" for v in d.values())

    rows = []
    for mode, r in report["results"].items():
        threshold = r["long_prefill_token_threshold"]
        rows.append([mode, "-" if threshold is None else str(threshold), triple(r["short_ttft_ms"]),
                     triple(r["short_itl_ms"]), f"{r['short_itl_max_ms'] or 0:.1f}",
                     "-" if r["long_ttft_ms"]["p50"] is None else f"{r['long_ttft_ms']['p50']:.1f}",
                     str(r["num_steps"]), f"{r['wall_s']:.2f}"])
    return rows


def format_table(report: dict[str, Any]) -> str:
    lines = text_table(TABLE_HEADER, _rows(report))
    return "\n".join(lines)


def render_section(report: dict[str, Any], json_path: Path) -> str:
    m, s, w = report["machine"], report["settings"], report["workload"]
    md_rows = markdown_table(TABLE_HEADER, _rows(report))
    lines = [
        START_MARK,
        "## Scheduling: long-prompt isolation on a mixed workload (`mixed_bench`)",
        "",
        f"Measured {report['date']} on {m['cpu']} ({m['usable_cores']} usable of {m['logical_cpus']} logical "
        f"CPUs, {m['torch_threads']} torch threads), torch {m['torch']}.",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Workload: {w['num_short']} short request(s) ({w['short_prompt_len']} prompt tokens, {w['short_max_tokens']} "
        f"output tokens, one arriving every {s['short_every']} engine step(s)) and {w['num_long']} long prompt(s) "
        f"({w['long_prompt_len']} prompt tokens, {w['long_max_tokens']} output tokens, one every "
        f"{s['long_every']} steps from step 1); synthetic token ids (seed {s['seed']}), greedy, EOS ignored.",
        "",
        f"Settings: model {s['model'] or 'SmolLM2-135M-Instruct (embedded)'}, dtype {s['dtype']}, max_num_seqs "
        f"{s['max_num_seqs']}, max_num_batched_tokens {s['max_num_batched_tokens']}, prefix caching off; "
        f"isolation on = `--long-prefill-token-threshold {s['threshold']}` (max_long_partial_prefills "
        f"{s['max_long_partial_prefills']}).",
        "",
        *md_rows,
        "",
        "- TTFT counts from the request's arrival step; ITL is the gap between a request's consecutive "
        "tokens, each stamped with the wall time of the engine step that produced it.",
        "",
        f"Raw numbers: `{_display_path(json_path)}`.",
        END_MARK,
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
