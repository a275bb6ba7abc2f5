"""Offline prefill speed and single-stream decode time of the embedded model (or --model).

    python -m benchmarks.prefill_decode [--model PATH] [--label NAME] [--block-matmul int8]

Prefill: 8 random 512-token prompts with max_tokens=1, best of 3, in tokens per second. Decode: one
32-token prompt generating 129 tokens minus the same prompt generating 1 (so the prefill cancels), per
output token. Prefix caching is off so every run computes its prompts. Run a second checkout's copy of
this module with that checkout's PYTHONPATH to compare two builds in one sitting.
"""
from __future__ import annotations

import argparse
import json
import random
import time

from tokenmill import LLM, SamplingParams
from tokenmill.config import BLOCK_MATMULS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--label", default="tokenmill")
    parser.add_argument("--block-matmul", default="float32", choices=BLOCK_MATMULS)
    args = parser.parse_args(argv)
    llm = LLM(args.model, kv_cache_memory_bytes=512 * 2**20, enable_prefix_caching=False,
              block_matmul=args.block_matmul)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(512)] for _ in range(8)]

    def seconds(max_tokens: int, batch: list[list[int]]) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in batch],
                     SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0), use_tqdm=False)
        return time.perf_counter() - start

    seconds(1, prompts[:1])  # warm-up
    prefill = min(seconds(1, prompts) for _ in range(3))
    short = [prompts[0][:32]]
    one = min(seconds(1, short) for _ in range(2))
    many = min(seconds(129, short) for _ in range(2))
    print(json.dumps({"label": args.label, "prefill_tok_s": round(8 * 512 / prefill, 1),
                      "time_per_output_token_ms": round((many - one) / 128 * 1e3, 2)}))


if __name__ == "__main__":
    main()
