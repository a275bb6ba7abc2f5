"""The Triton dequantize-and-matmul kernel for block-quantized weights: y = x W^T (+ bias).

Imported only by `triton_quant_linear.py` once CUDA block layers are built (or a test asks), so
tokenmill imports without triton. Whether the kernel compiles for the GPU or runs in Triton's
interpreter is fixed when this module is imported (TRITON_INTERPRET=1 before the import: the
interpreter, which takes CPU tensors).

W arrives in `pack_blocks`' layout (linear.py), never as floats. Output feature n lives in panel
n // 16 at lane n % 16; input k in block k // 32 at row k % 32 of that block:

    8-bit q   int8  [panel][block][k][16]  element (n, k) at ((panel * B + block) * 32 + k % 32) * 16 + lane
    4-bit q   uint8 [panel][block][k][8]   byte    (n, k) at ((panel * B + block) * 32 + k % 32) * 8 + lane % 8,
                                           low nibble for lanes 0-7, high for lanes 8-15 (+8 without mins)
    scales, mins  f32 [panel][block][16]   value   (n, block) at (panel * B + block) * 16 + lane

A program owns a [BLOCK_M rows x BLOCK_N features] tile of y and walks K one 32-input block at a
time. Each step loads that block's integers as a [32, BLOCK_N] tile, turns them into the compute
dtype (exact: they are at most 8 bits), and multiplies:

    acc += (x[:, blk] @ q[blk, :]) * scale[blk, :]  (+ sum(x[:, blk]) * min[blk, :])

which is sum_k x * (q * scale + min) regrouped, so no dequantized weight tile is ever rounded to a
16-bit type. Accumulation is float32; the result is rounded once to x's dtype.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

try:  # what triton.jit below decided
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # triton < 3.4 has no knobs and reads the variable as exactly "1"
    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def block_linear_kernel(
    x_ptr, q_ptr, scales_ptr, mins_ptr, bias_ptr, y_ptr,
    M, N, num_blocks, stride_xm, stride_ym,
    BITS: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N  # the packed storage ends at the last (padded) panel; a tile may reach past it
    kk = tl.arange(0, 32)

    LANES: tl.constexpr = 16 if BITS == 8 else 8  # bytes per (block, k) row of a panel
    panel = (cols // 16).to(tl.int64)
    lane = cols % 16
    q_ptrs = q_ptr + (panel * num_blocks * 32 * LANES + lane % LANES)[None, :] + (kk * LANES)[:, None]  # [32, N]
    s_offsets = panel * num_blocks * 16 + lane  # [N]
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + kk[None, :]  # [M, 32]
    shift = ((lane // 8) * 4)[None, :]  # 4-bit: lanes 8-15 are the high nibbles

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for block in range(num_blocks):
        x = tl.load(x_ptrs + block * 32, mask=row_ok[:, None], other=0.0).to(COMPUTE)
        q = tl.load(q_ptrs + block * 32 * LANES, mask=col_ok[None, :], other=0)
        if BITS == 4:
            q = (q.to(tl.int32) >> shift) & 0xF
            if not HAS_MINS:
                q = q - 8
        if IEEE:  # float32 operands stay float32 (no TF32), as exact as the torch reference
            part = tl.dot(x, q.to(COMPUTE), input_precision="ieee")
        else:
            part = tl.dot(x, q.to(COMPUTE))
        scale = tl.load(scales_ptr + s_offsets + block * 16, mask=col_ok, other=0.0)
        acc += part * scale[None, :]
        if HAS_MINS:
            low = tl.load(mins_ptr + s_offsets + block * 16, mask=col_ok, other=0.0)
            acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * low[None, :]

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
