"""Speed of each `--block-matmul` path on the embedded model's own kept layers.

    python -m benchmarks.block_matmul_paths [--rows 16 256 1024] [--repeat 20]

For every distinct projection shape (q/k/v, o, gate/up, down; the LM head is left out: serving only
multiplies its sampled rows) the float32 kernel (`block_linear`), the int8 one (`block_linear_q8`) and
the bfloat16 one (`block_linear_bf16`: AMX tiles or MKL, whichever `bf16_tiles()` names) on random x of
each row count, in GOPS (2 x rows x in x out per second, best mean of --repeat calls after a warm-up),
on two torch threads. Run a second checkout's copy with its PYTHONPATH to compare two builds.
"""
from __future__ import annotations

import argparse
import time

import torch

from tokenmill import LLM
from tokenmill.model.layers.linear import BlockQuantLinear

KERNELS = {"float32": "block_linear", "int8": "block_linear_q8", "bfloat16": "block_linear_bf16"}


def seconds_per_call(call, repeat: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - start) / repeat


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 256, 1024])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    llm = LLM(None, max_model_len=512, num_kv_blocks=64)
    runner = llm.llm_engine.core.core.runner
    layers = {}
    for module in runner.model.modules():
        if isinstance(module, BlockQuantLinear) and module is not getattr(runner.model, "lm_head", None):
            layers.setdefault((module.in_features, module.out_features, module.bits), module)
    kernels = next(iter(layers.values())).kernels
    print(f"int8_dot={kernels.int8_dot} bf16_tiles={kernels.bf16_tiles()}")
    print(f"{'projection':>16} {'bits':>4} {'rows':>5} " + " ".join(f"{name:>9}" for name in KERNELS) + "  (GOPS)")
    for (in_features, out_features, bits), layer in sorted(layers.items()):
        weights = (layer.q, layer.scales, layer.mins, layer.bias, out_features)
        for rows in args.rows:
            x = torch.randn(rows, in_features)
            ops = 2 * rows * in_features * out_features
            gops = [ops / seconds_per_call(lambda: getattr(kernels, kernel)(x, *weights), args.repeat) / 1e9
                    for kernel in KERNELS.values()]
            print(f"{in_features:>7} -> {out_features:<6} {bits:>4} {rows:>5} " + " ".join(f"{g:9.0f}" for g in gops))


if __name__ == "__main__":
    main()
