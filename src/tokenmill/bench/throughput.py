"""Offline throughput of tokenmill's LLM: submit a whole workload at once, time until all are done.

`run_offline_throughput(llm, requests)` is shared by `make bench` and `tokenmill bench throughput`.
Every request generates exactly its max_tokens (ignore_eos, greedy); a request that comes back
shorter or longer fails the run loudly, since its tokens/s would be meaningless.
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

from tokenmill.bench.workloads import WorkloadRequest

if TYPE_CHECKING:
    from tokenmill import LLM


class BenchmarkError(RuntimeError):
    """An engine returned something other than what the workload asked for."""


def throughput_result(engine: str, wall_s: float, prompt_tokens: int, output_tokens: int,
                      num_requests: int, **extra: Any) -> dict[str, Any]:
    """The common shape of one engine's numbers (JSON-ready)."""
    wall = max(wall_s, 1e-9)
    result: dict[str, Any] = {
        "engine": engine,
        "num_requests": num_requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "wall_s": round(wall_s, 4),
        "output_tok_s": round(output_tokens / wall, 3),
        "total_tok_s": round((prompt_tokens + output_tokens) / wall, 3),
        "requests_per_s": round(num_requests / wall, 4),
    }
    result.update(extra)
    return result


def check_output_lengths(engine: str, requests: Sequence[WorkloadRequest], lengths: Sequence[int]) -> None:
    if len(lengths) != len(requests):
        raise BenchmarkError(f"{engine}: {len(lengths)} outputs for {len(requests)} requests")
    bad = [(r.id, r.max_tokens, n) for r, n in zip(requests, lengths) if n != r.max_tokens]
    if bad:
        shown = ", ".join(f"id {i}: asked {want}, got {got}" for i, want, got in bad[:5])
        raise BenchmarkError(f"{engine}: {len(bad)} request(s) did not generate exactly max_tokens ({shown})")


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def warm_up_llm(llm: "LLM", requests: Sequence[WorkloadRequest]) -> None:
    """One tiny untimed request, so lazy initialisation and first-call costs stay out of the timing.

    The prompt is shorter than a KV block, so it leaves nothing in the prefix cache.
    """
    from tokenmill import SamplingParams

    prompt = list(requests[0].prompt_token_ids[:8])
    llm.generate([{"prompt_token_ids": prompt}],
                 [SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)], use_tqdm=False)


def generate_timed(llm: "LLM", requests: Sequence[WorkloadRequest], use_tqdm: bool,
                   name: str = "tokenmill") -> tuple[float, list]:
    """Generate every request (greedy, exactly max_tokens each) in one `LLM.generate` call; returns the
    wall time and the outputs, after checking every output has its length."""
    from tokenmill import SamplingParams

    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    wall = time.perf_counter() - start
    check_output_lengths(name, requests, [len(o.outputs[0].token_ids) for o in outputs])
    return wall, outputs


def run_offline_throughput(llm: "LLM", requests: Sequence[WorkloadRequest], *, use_tqdm: bool = True,
                           warmup: bool = True, engine: str = "tokenmill") -> dict[str, Any]:
    """Generate every request (exactly max_tokens each) in one `LLM.generate` call; return the numbers."""
    if not requests:
        raise ValueError("no requests to run")
    if warmup:
        warm_up_llm(llm, requests)
    wall, outputs = generate_timed(llm, requests, use_tqdm, engine)
    return throughput_result(
        engine, wall,
        prompt_tokens=sum(r.prompt_len for r in requests),
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        num_requests=len(requests),
        **_latency_stats(outputs),
    )


def _latency_stats(outputs) -> dict[str, Any]:
    """TTFT and end-to-end latency from the engine's own request metrics (all arrive at t=0)."""
    ttfts, latencies, cached, preemptions = [], [], 0, 0
    for out in outputs:
        m = out.metrics
        if m is None:
            continue
        if m.first_token_time is not None:
            ttfts.append(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            latencies.append(m.finished_time - m.arrival_time)
        cached += m.num_cached_tokens or 0
        preemptions += m.num_preemptions or 0

    def r(x: Optional[float]) -> Optional[float]:
        return None if x is None else round(x, 4)

    return {
        "ttft_p50_s": r(percentile(ttfts, 50)),
        "ttft_p95_s": r(percentile(ttfts, 95)),
        "latency_mean_s": r(statistics.fmean(latencies)) if latencies else None,
        "num_cached_prompt_tokens": cached,
        "num_preemptions": preemptions,
    }
