"""What a weight format costs in accuracy: perplexity and per-token logprob deltas on a fixed text.

    python -m benchmarks.quant_accuracy [--quantization q8_0|gguf] [--block-matmul int8] [--text FILE]

Scores the same token ids twice through `prompt_logprobs` (exact float32 weights, then the chosen
format, its matmuls in `--block-matmul`'s arithmetic) and reports perplexity for both, the mean and
max |delta logprob| per token, and how many positions change their top-1 token. The default text is
tokenmill's README.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
from pathlib import Path
from typing import Any, Optional

from benchmarks.paths import repo_root


def token_logprobs(llm, token_ids: list[int]) -> tuple[list[float], list[int]]:
    """Logprob of each actual next token (positions 1..n-1) and the top-1 token at each position."""
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    out = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    actual, top1 = [], []
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        actual.append(entry[token_ids[position]].logprob)
        top1.append(min(entry.items(), key=lambda kv: kv[1].rank)[0])
    return actual, top1


def compare(reference: tuple[list[float], list[int]], candidate: tuple[list[float], list[int]]) -> dict[str, Any]:
    ref_lp, ref_top = reference
    cand_lp, cand_top = candidate
    deltas = [abs(a - b) for a, b in zip(ref_lp, cand_lp)]
    return {
        "tokens_scored": len(deltas),
        "perplexity_reference": round(math.exp(-sum(ref_lp) / len(ref_lp)), 4),
        "perplexity_candidate": round(math.exp(-sum(cand_lp) / len(cand_lp)), 4),
        "mean_abs_logprob_delta": round(sum(deltas) / len(deltas), 5),
        "max_abs_logprob_delta": round(max(deltas), 5),
        "top1_changed": sum(a != b for a, b in zip(ref_top, cand_top)),
    }


def main(argv: Optional[list[str]] = None) -> None:
    from tokenmill import LLM
    from tokenmill.config import BLOCK_MATMULS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default="q8_0", choices=["q8_0", "gguf"])
    parser.add_argument("--block-matmul", default="float32", choices=BLOCK_MATMULS,
                        help="the candidate's block matmul arithmetic (the reference is always float32)")
    parser.add_argument("--text", default=None, help="text file to score (default: README.md)")
    parser.add_argument("--max-tokens", type=int, default=1024, help="score at most this many tokens")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    text_path = Path(args.text) if args.text else repo_root() / "README.md"
    text = text_path.read_text()
    results: list[tuple[list[float], list[int]]] = []
    token_ids: list[int] = []
    for quantization in ("none", args.quantization):  # dense float32 is the reference
        block_matmul = "float32" if quantization == "none" else args.block_matmul
        llm = LLM(args.model, quantization=quantization, block_matmul=block_matmul,
                  max_model_len=args.max_tokens + 8, enable_prefix_caching=False)
        if not token_ids:
            token_ids = llm.get_tokenizer().encode(text)[:args.max_tokens]
        results.append(token_logprobs(llm, token_ids))
        del llm
        gc.collect()
    summary = {"text": str(text_path), "quantization": args.quantization,
               "block_matmul": args.block_matmul, **compare(results[0], results[1])}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
