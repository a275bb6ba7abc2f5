"""Where an engine step's time goes: wall-clock totals per phase over a whole offline workload.

    python -m benchmarks.step_profile --workload ../shared/bench/workload-64.jsonl

Phases are timed by wrapping the functions that implement them (CPU torch ops are synchronous,
so wall time around a call is the call's cost; on CUDA the runner would need synchronisation and
this tool says so). The phases partition the run:

- schedule: Scheduler.schedule
- prepare inputs: SchedulerOutput -> tensors (runner)
- model: linear layers (every nn.Linear inside the decoder)
- model: attention (decode / prefill / other): the backend's attention over decoding requests, over
  prefill chunks, and the rest of its forward (KV cache writes)
- model: other (embedding, norms, rotary, activation, residuals: forward minus the two above); a step that runs
  the fused C++ decoder stack (every decode step, and steps that prefill wherever their chunks take the C++
  attention kernels: the defaults on CPU) shows here whole, its projections and attention included;
  `--layer-by-layer` runs every step through the layers to split it (same bits, more host time)
- logits: the LM head over the rows that sample
- sampling: the sampler
- update: Scheduler.update_from_output (append tokens, stop checks, free blocks)
- output processing: detokenization and RequestOutput assembly (LLMEngine.step minus the core step)
- runner other: the rest of ModelRunner.execute (COW/swap copies, bookkeeping)
- engine other: the rest of the wall time (LLM.generate's loop, tqdm)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import defaultdict
from typing import Any, Callable, Iterator, Optional

import torch

PHASES = ("schedule", "prepare inputs", "model: linear", "model: attention (decode)", "model: attention (prefill)",
          "model: attention (other)", "model: other", "logits",
          "sampling", "update", "output processing", "runner other", "engine other")


class PhaseTimer:
    """Accumulates seconds per phase; `wrap` times a callable and subtracts nested phases."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []  # per open phase: [time spent in nested phases]

    def wrap(self, phase: str, fn: Callable) -> Callable:
        timer = self

        def timed(*args, **kwargs):
            timer._stack.append([0.0])
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                nested = timer._stack.pop()[0]
                timer.seconds[phase] += elapsed - nested
                timer.calls[phase] += 1
                if timer._stack:
                    timer._stack[-1][0] += elapsed

        return timed


@contextlib.contextmanager
def _patched(obj: Any, name: str, replacement: Any) -> Iterator[None]:
    """Shadow obj.name; afterwards restore it, or drop the shadow if it came from the class."""
    own = name in getattr(obj, "__dict__", {})
    original = getattr(obj, name)
    setattr(obj, name, replacement)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


@contextlib.contextmanager
def profile_phases(llm) -> Iterator[PhaseTimer]:
    """Instrument one LLM's engine; the yielded timer fills while the block runs."""
    from tokenmill.model.layers.linear import BlockQuantLinear, PackedLinear

    engine = llm.llm_engine
    core = engine.core.core
    runner = core.runner
    model = runner.model
    timer = PhaseTimer()
    with contextlib.ExitStack() as stack:
        patch = lambda obj, name, phase: stack.enter_context(  # noqa: E731
            _patched(obj, name, timer.wrap(phase, getattr(obj, name))))
        patch(engine, "step", "output processing")
        patch(core, "step", "engine core")
        patch(core.scheduler, "schedule", "schedule")
        patch(core.scheduler, "update_from_output", "update")
        patch(runner, "execute", "runner other")
        patch(runner.input_batch, "prepare", "prepare inputs")
        patch(runner.sampler, "__call__", "sampling")
        patch(model, "compute_logits", "logits")
        patch(model, "forward", "model: other")
        backend = model.layers[0].self_attn.backend
        patch(backend, "forward", "model: attention (other)")
        patch(backend, "decode_into", "model: attention (decode)")
        patch(backend, "prefill_into", "model: attention (prefill)")
        for module in model.layers.modules():  # the LM head is timed as "logits"
            if isinstance(module, (torch.nn.Linear, BlockQuantLinear, PackedLinear)):
                patch(module, "forward", "model: linear")
        # Instance attributes shadow nn.Module.__call__'s lookup of `forward`; the sampler is called
        # as sampler(...), which looks up __call__ on the type, so route it through the instance.
        sampler = runner.sampler
        runner.sampler = lambda *a, **k: sampler.__call__(*a, **k)  # type: ignore[assignment]
        stack.callback(setattr, runner, "sampler", sampler)
        yield timer
    # engine core's own leftover is glue between schedule/execute/update: fold it into update.
    timer.seconds["update"] += timer.seconds.pop("engine core", 0.0)


def breakdown(timer: PhaseTimer, wall_s: float) -> list[dict[str, Any]]:
    accounted = sum(timer.seconds.values())
    seconds = dict(timer.seconds)
    seconds["engine other"] = max(0.0, wall_s - accounted)
    rows = []
    for phase in PHASES:
        s = seconds.get(phase, 0.0)
        rows.append({"phase": phase, "seconds": round(s, 6), "share": round(s / wall_s, 5) if wall_s else 0.0})
    return rows


def markdown_table(rows: list[dict[str, Any]], wall_s: float, steps: int) -> str:
    lines = ["| phase | seconds | share | ms / step |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['phase']} | {row['seconds']:.2f} | {100 * row['share']:.1f}% | "
                     f"{1000 * row['seconds'] / max(steps, 1):.2f} |")
    lines.append(f"| **total** | {wall_s:.2f} | 100% | {1000 * wall_s / max(steps, 1):.2f} |")
    return "\n".join(lines)


def run_layer_by_layer(llm) -> None:
    """Every step of llm through the per-layer modules from now on, not the fused C++ decoder stack (whose steps
    time as one "model: other" call): the same bits, the phases apart."""
    llm.llm_engine.core.core.runner.model._int8_decode = None


def run(llm, requests, use_tqdm: bool = False) -> dict[str, Any]:
    from tokenmill.bench.throughput import run_offline_throughput, warm_up_llm

    if llm.llm_engine.core.core.runner.device.type != "cpu":
        raise SystemExit("step_profile times CPU execution; on CUDA the phases would need synchronisation")
    warm_up_llm(llm, requests)
    with profile_phases(llm) as timer:
        start = time.perf_counter()
        result = run_offline_throughput(llm, requests, use_tqdm=use_tqdm, warmup=False)
        wall = time.perf_counter() - start
    steps = timer.calls.get("schedule", 0)
    rows = breakdown(timer, wall)
    return {"throughput": result, "steps": steps, "wall_s": round(wall, 3), "phases": rows,
            "markdown": markdown_table(rows, wall, steps)}


def main(argv: Optional[list[str]] = None) -> None:
    from benchmarks.engine_options import effective
    from benchmarks.paths import default_workload_path
    from tokenmill.bench.workloads import load_workload
    from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
    from tokenmill.entrypoints.llm import LLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default=None,
                        help="a workload JSONL file (prompt_token_ids, max_tokens per line; "
                        "default: ../shared/bench/workload-64.jsonl)")
    # Engine options, the engine's own flags and defaults (EngineConfig).
    add_engine_args(parser, ("model", "dtype", "max_num_seqs", "max_num_batched_tokens", "attention_backend",
                             "packed_linear", "quantization", "kv_cache_dtype", "block_matmul", "numerics"))
    parser.add_argument("--num-prompts", type=int, default=None, help="use only the first N requests")
    parser.add_argument("--layer-by-layer", action="store_true",
                        help="run every step through the per-layer modules instead of the fused C++ decoder stack, "
                        "so that its projections and attention are timed apart")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)

    llm = LLM.from_config(engine_config_from_args(args))
    if args.layer_by_layer:
        run_layer_by_layer(llm)
    requests = load_workload(args.workload or default_workload_path(), args.num_prompts)
    out = run(llm, requests)
    out["engine_settings"] = effective(llm)
    tp = out["throughput"]
    print(f"{tp['output_tok_s']:.1f} output tok/s, {out['steps']} steps, {out['wall_s']:.1f} s")
    print(out["markdown"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
