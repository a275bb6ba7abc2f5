"""Perplexity of every numerics mode on one text, against the exact mode and llama.cpp's llama-perplexity.

    python -m benchmarks.numerics_accuracy [--model M] [--file F] [--context-size 512] [--max-chunks N]
        [--modes float32:float32,int8:bfloat16,...] [--llama-perplexity PATH] [--markdown OUT]

Each mode is `block_matmul:kv_cache_dtype`, optionally after a weights format (`q8_0/int8:bfloat16`,
`none/default`: `--quantization` for that run), run through `tokenmill eval perplexity`'s scoring
(entrypoints/eval_cli.py) one engine at a time; `default` runs the engine at its defaults (what this
machine resolves them to). llama.cpp's figure comes from its own binary on the same GGUF, text and
context size (built by `make bench-peers` at .bench/llama.cpp/build/bin/llama-perplexity); it is left out
when that binary is missing. The default text is Debian's GPL-3 (/usr/share/common-licenses/GPL-3), a
fixed English text every Debian machine has.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Optional

from benchmarks.paths import repo_root
from benchmarks.tables import markdown_table
from tokenmill.config import QUANTIZATIONS

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
DEFAULT_MODES = ("float32:float32", "float32:float16", "float32:bfloat16", "int8:float32", "int8:float16",
                 "int8:bfloat16", "bfloat16:bfloat16", "bfloat16-int8:bfloat16", "default")


def engine_perplexity(model: Optional[str], text: str, context_size: int, max_chunks: Optional[int],
                      mode: str) -> dict:
    from tokenmill import LLM
    from tokenmill.entrypoints.eval_cli import evaluate_perplexity

    options = {}
    quantization, _, numerics = mode.rpartition("/")
    if numerics != "default":
        block_matmul, kv_cache_dtype = numerics.split(":")
        options = dict(dtype="float32", block_matmul=block_matmul, kv_cache_dtype=kv_cache_dtype)
    if quantization:
        options["quantization"] = quantization
    llm = LLM(model, max_model_len=context_size + 1, kv_cache_memory_bytes=256 * 2**20, enable_prefix_caching=False,
              **options)
    result = evaluate_perplexity(llm, text, context_size, max_chunks)
    numerics = llm.llm_engine.numerics
    llm.shutdown()
    del llm
    gc.collect()
    return {"mode": mode, "numerics": numerics, "perplexity": result.perplexity,
            "stderr": result.perplexity_stderr, "tokens": result.tokens_scored, "seconds": result.seconds}


def llama_cpp_perplexity(binary: Path, model: Path, text_path: Path, context_size: int,
                         max_chunks: Optional[int]) -> Optional[float]:
    command = [str(binary), "-m", str(model), "-f", str(text_path), "-c", str(context_size),
               "-t", str(os.cpu_count() or 1)]
    if max_chunks is not None:
        command += ["--chunks", str(max_chunks)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    return float(match.group(1)) if match else None


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF (default: the embedded SmolLM2)")
    parser.add_argument("--file", default=str(DEFAULT_TEXT))
    parser.add_argument("--context-size", type=int, default=512)
    parser.add_argument("--max-chunks", type=int, default=None)
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help="comma-separated: 'default', 'exact' or BLOCK_MATMUL:KV_CACHE_DTYPE pairs")
    parser.add_argument("--llama-perplexity", default=str(repo_root() / ".bench/llama.cpp/build/bin/llama-perplexity"))
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args(argv)
    # "exact" names the exact mode's pair (float32 matmuls over a float32 cache).
    modes = ["float32:float32" if mode == "exact" else mode for mode in args.modes.split(",")]
    for mode in modes:
        quantization, _, numerics = mode.rpartition("/")
        if (numerics != "default" and len(numerics.split(":")) != 2) or quantization not in ("", *QUANTIZATIONS):
            parser.error(f"mode {mode!r}: expected 'default', 'exact' or BLOCK_MATMUL:KV_CACHE_DTYPE "
                         f"(e.g. int8:bfloat16), optionally after QUANTIZATION/ (e.g. q8_0/default)")

    from tokenmill.model.default_model import default_model_path

    model_path = Path(args.model) if args.model else default_model_path()
    text_path = Path(args.file)
    text = text_path.read_text(encoding="utf-8")
    rows = []
    for mode in modes:
        rows.append(engine_perplexity(str(model_path), text, args.context_size, args.max_chunks, mode))
        print(json.dumps(rows[-1]), flush=True)
    binary = Path(args.llama_perplexity)
    llama = (llama_cpp_perplexity(binary, model_path, text_path, args.context_size, args.max_chunks)
             if binary.is_file() else None)
    print(json.dumps({"llama.cpp": llama}), flush=True)
    exact = next((row["perplexity"] for row in rows if row["mode"] == "float32:float32"), None)
    table = []
    for row in rows:
        chosen = row["numerics"]
        quantization, _, numerics = row["mode"].rpartition("/")
        blocks = chosen.get("weights", {}).get("value") == "q8_0" or chosen["block_matmul"]["value"] != "float32"
        dtype = chosen.get("dtype", {}).get("value", "float32")
        matmul = chosen["block_matmul"]["value"] if blocks else f"{dtype} matmuls"
        label = (f"default ({matmul}, KV {chosen['kv_cache_dtype']['value']})"
                 if numerics == "default" else numerics.replace(":", ", KV "))
        weights = chosen.get("weights", {}).get("value")
        label = f"{quantization or weights or 'as stored'} weights, {label}" if quantization or weights else label
        vs_exact = f"{row['perplexity'] / exact - 1:+.2%}" if exact else "-"
        vs_llama = f"{row['perplexity'] / llama - 1:+.2%}" if llama else "-"
        table.append([label, f"{row['perplexity']:.4f} ± {row['stderr']:.4f}", vs_exact, vs_llama,
                      f"{row['tokens'] / row['seconds']:.0f}"])
    if llama:
        table.append(["llama.cpp llama-perplexity", f"{llama:.4f}", f"{llama / exact - 1:+.2%}" if exact else "-",
                      "", ""])
    lines = [f"{model_path.name}, {text_path} ({rows[0]['tokens']} tokens scored, windows of {args.context_size})", "",
             *markdown_table(["block matmul, KV cache", "perplexity", "vs exact", "vs llama.cpp", "scored tok/s"],
                             table)]
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "llama.cpp": llama}, indent=2) + "\n")


if __name__ == "__main__":
    main()
