"""Decode speed over long contexts, a bfloat16 KV cache against an int8 one, both engines in one process.

    PYTHONPATH=. python benchmarks/results/2026-12-07-kv-int8/decode/kv_decode.py MODEL [--context 3000]
        [--streams 1,4] [--rounds 4] [--tokens 64] [--json OUT]

Each engine (the defaults, --kv-cache-dtype bfloat16 or int8) first prefills the streams' prompts (random token
ids, distinct per stream) once; every timed run then sends the same prompts again, which hit the prefix cache, so
a run is one short prefill step and `tokens` decode steps over contexts of about `context` tokens. Runs alternate
between the engines (ABAB) for `rounds` rounds; the result is time per decode step (ms), median and spread.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from tokenmill import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=3000)
    parser.add_argument("--streams", default="1,4")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.context)] for _ in range(max(streams))]
    engines = {kv: LLM(args.model, kv_cache_dtype=kv, max_model_len=args.context + args.tokens + 16,
                       max_num_seqs=max(streams))
               for kv in ("bfloat16", "int8")}
    decode = SamplingParams(temperature=0.0, max_tokens=args.tokens + 1, ignore_eos=True)
    for llm in engines.values():  # fill the prefix caches
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)
    results = {f"{kv}/{n}": [] for n in streams for kv in engines}
    for _ in range(args.rounds):
        for n in streams:
            for kv, llm in engines.items():
                start = time.perf_counter()
                outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:n]], decode, use_tqdm=False)
                elapsed = time.perf_counter() - start
                assert all(o.num_cached_tokens >= args.context - 16 for o in outputs)
                results[f"{kv}/{n}"].append(elapsed / args.tokens * 1000)
    summary = {}
    for n in streams:
        rows = {kv: results[f"{kv}/{n}"] for kv in engines}
        summary[n] = {kv: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "runs_ms": v}
                      for kv, v in rows.items()}
        ratio = statistics.median(rows["bfloat16"]) / statistics.median(rows["int8"])
        summary[n]["bf16_over_int8"] = ratio
        print(f"{n} streams, context {args.context}: bfloat16 {statistics.median(rows['bfloat16']):.1f} ms "
              f"[{min(rows['bfloat16']):.1f}-{max(rows['bfloat16']):.1f}], int8 {statistics.median(rows['int8']):.1f} ms "
              f"[{min(rows['int8']):.1f}-{max(rows['int8']):.1f}] per step: int8 {ratio:.2f}x")
    blocks = {kv: llm.llm_engine.core.core.runner.kv_caches[0].shape[1] for kv, llm in engines.items()}
    print(f"KV blocks in the same budget: {blocks}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "context": args.context, "tokens": args.tokens, "rounds": args.rounds,
                       "kv_blocks": blocks, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
