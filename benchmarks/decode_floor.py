"""One stream's decode against the memory wall: time per output token as a share of (weight bytes / read bandwidth).

    python -m benchmarks.decode_floor --model CHECKPOINT [--output-len 128] [--rounds 3] [--json OUT]
    python -m benchmarks.decode_floor --bandwidth-only

A one-stream decode step multiplies one row by every weight matrix, so it reads every weight byte once per
token: its floor is (bytes of the weights a token reads) / (the machine's read bandwidth). The probe reads a
buffer far larger than the last-level cache (1 GiB by default) with torch's summation on every thread the
engine gets, best of several passes per buffer; the weight bytes are the engine's own tensors as loaded (packed blocks,
scales and mins included; the embedding table is left out unless it is also the LM head, since a token reads
one row of it). A round's decode time is (last token's time - first token's time) / (output tokens - 1) for one request
with a short prompt, so prefill is not in it; each round sits between two probes (separate buffers), and its
share of the floor uses the median of the probes beside it (this machine's bandwidth can move between rounds).
The result is the median share over rounds, with its range.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional


def read_bandwidth(buffer_bytes: int = 1 << 30, passes: int = 6, threads: Optional[int] = None,
                   allocations: int = 4) -> list[float]:
    """Bytes per second torch reads from memory, one figure per freshly allocated buffer of buffer_bytes (the
    best of `passes` sums over it). Separate allocations, because on a virtual machine the rate can depend on
    where the pages land (on one 2-core Zen 5 VM, buffers read at either ~43 or ~72 GB/s)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    rates = []
    for _ in range(allocations):
        buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)
        buffer.sum()  # fault the pages in, warm the code
        best = float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        rates.append(buffer_bytes / best)
        del buffer
    return rates


def weight_bytes_per_token(model: Any) -> int:
    """Bytes of the model's tensors one decode token reads: every weight and buffer once (shared storage
    counted once), less an embedding table that is not also the LM head (a token reads one row of it)."""
    from tokenmill.runner.model_memory import tensor_storages

    weights, buffers = tensor_storages(model)
    embedding = getattr(model, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    embedding_only = set(tensor_storages(embedding)[0]) if embedding is not None else set()
    if head is not None:  # a tied head is the embedding's table: read whole every token
        embedding_only -= set(tensor_storages(head)[0])
    return sum(size for ptr, size in {**buffers, **weights}.items() if ptr not in embedding_only)


def one_stream_decode(llm: Any, output_len: int, rounds: int, warm_up: bool = True) -> list[float]:
    """Seconds per output token of one request (a 16-token prompt), prefill excluded, per round (after a
    warm-up round that is dropped, unless warm_up is False)."""
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    per_token = []
    for round_index in range(rounds + int(warm_up)):
        prompt = [100 + round_index + time.monotonic_ns() % 1000] + list(range(1000, 1015))
        times = list(_timed_stream(llm, prompt, params))
        if round_index or not warm_up:
            per_token.append((times[-1] - times[0]) / (len(times) - 1))
    return per_token


def _timed_stream(llm: Any, prompt: list[int], params: Any):
    """Arrival times of each new token of one request, stepping the engine by hand."""
    engine = llm.llm_engine
    request_id = f"floor-{time.monotonic_ns()}"
    engine.add_request(request_id, engine.input_processor.process_prompt({"prompt_token_ids": prompt}), params)
    seen = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            count = len(output.outputs[0].token_ids)  # cumulative: RequestOutputKind's default
            now = time.perf_counter()
            for _ in range(count - seen):
                yield now
            seen = count


def _engine_value(text: str) -> Any:
    """An engine option's value from the command line: a number or true/false where it reads as one."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--buffer-gib", type=float, default=1.0)
    parser.add_argument("--bandwidth-only", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("engine_args", nargs="*", help="extra engine options as KEY=VALUE (e.g. quantization=none)")
    args = parser.parse_args(argv)
    options: dict[str, Any] = {}
    for item in args.engine_args:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"engine option {item!r}: expected KEY=VALUE")
        options[key.replace("-", "_")] = _engine_value(value)
    import torch

    from benchmarks.make_bench import machine_info
    from tokenmill.model.layers.cpu_kernels import cpu_flags

    threads = torch.get_num_threads()
    buffer_bytes = int(args.buffer_gib * 2**30)
    rates = read_bandwidth(buffer_bytes, threads=threads)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    result: dict[str, Any] = {"machine": {**machine_info(threads), "cpu_flags": flags}}
    if not args.bandwidth_only:
        from tokenmill import LLM

        llm = LLM(args.model, max_model_len=1024, **options)
        model = llm.llm_engine.core.core.runner.model
        weights = weight_bytes_per_token(model)
        one_stream_decode(llm, args.output_len, 0)  # warm-up
        rounds = []
        for _ in range(args.rounds):
            # Each round's decode between two probes: this machine's bandwidth can move between rounds.
            per_token = one_stream_decode(llm, args.output_len, 1, warm_up=False)[0]
            after = read_bandwidth(buffer_bytes, threads=threads, allocations=2)
            beside = statistics.median([rates[-1], *after])
            rates += after
            rounds.append({"ms_per_token": per_token * 1e3, "read_bandwidth_gb_s": beside / 1e9,
                           "floor_ms": weights / beside * 1e3, "share_of_floor": weights / beside / per_token})
        shares = [r["share_of_floor"] for r in rounds]
        result.update(model=args.model, engine_options=options, numerics=llm.llm_engine.numerics,
                      weight_bytes_per_token=weights, rounds=rounds,
                      median_ms_per_token=statistics.median(r["ms_per_token"] for r in rounds),
                      share_of_floor=statistics.median(shares), share_of_floor_range=[min(shares), max(shares)],
                      achieved_gb_s=weights / statistics.median(r["ms_per_token"] for r in rounds) / 1e6)
    result["read_bandwidth_gb_s"] = [rate / 1e9 for rate in rates]
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
