"""Decode attention per layer over a bfloat16, an int8 and a float32 cache: the C++ kernel alone, 1.2B-shape heads
(32 query heads, 8 KV heads, head_dim 64), contexts of 3,000 tokens in scattered 16-token blocks.

    python benchmarks/results/2026-12-07-kv-int8/decode/attention_kernel.py
"""
import time

import torch

from tokenmill.model.layers import cpu_kernels
from tokenmill.model.layers.kv_int8 import quantize_kv_rows

kernels = cpu_kernels.load()
torch.set_num_threads(2)
B, H, Hkv, D, bs, ctx = 4, 32, 8, 64, 16, 3000
nb = B * (ctx // bs + 1) + 8
values = torch.randn(2, nb, bs, Hkv, D)
caches = {"bfloat16": values.bfloat16(), "int8": quantize_kv_rows(values), "float32": values}
tables = torch.randperm(nb)[:B * (ctx // bs + 1)].int().view(B, -1)
lens = torch.full((B,), ctx, dtype=torch.int32)
q = torch.randn(B, H, D)
for rows in (1, 4):
    for round_ in range(3):
        for name, cache in caches.items():
            args = (q[:rows].contiguous(), cache, tables[:rows].contiguous(), lens[:rows], 0.125)
            for _ in range(3):
                kernels.paged_decode_attention(*args)
            start = time.perf_counter()
            for _ in range(20):
                kernels.paged_decode_attention(*args)
            print(f"{rows} requests, round {round_ + 1}, {name} cache: "
                  f"{(time.perf_counter() - start) / 20 * 1000:.3f} ms per layer")
