"""The 8-bit KV cache (`--kv-cache-dtype int8`): each token's key (and value) of each KV head is stored as
head_dim int8 values followed by its scale, a float16 in two more bytes:

    kv_cache  int8 [2, num_blocks, block_size, num_kv_heads, head_dim + 2]
    row       q[0] ... q[head_dim - 1] | scale (float16 bits)      value[d] = q[d] * scale

One scale per (token, head) row, absmax / 127, so a row is quantized once when it is written and never again
(a per-block scale would have to requantize a block's earlier rows when a later token grows its range). The
cache stays one tensor per layer whose blocks copy, swap and move to the offload tier as bytes, like any
other dtype. At head_dim 64 a row takes 66 bytes where a 16-bit cache takes 128: 1.94x the tokens in the
same memory (1.97x at 128, 1.98x at 256). llama.cpp's `-ctk q8_0` keeps a float16 scale per 32 values.

The C++ kernels (csrc/decode_attention.cpp, csrc/prefill_attention.cpp, csrc/decoder_stack.cpp) read and write
the same rows: the scale, rounded to float16 first, divides the values before they round to nearest even, so
the torch and C++ writers store the same bytes.
"""
from __future__ import annotations

import torch

KV_INT8_SCALE_BYTES = 2
_FLOAT16_MAX = 65504.0


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements in one (token, head) row of a cache of this dtype: head_dim, plus the scale's bytes for int8."""
    return head_dim + KV_INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def cache_head_dim(kv_cache: torch.Tensor) -> int:
    """The head_dim a cache tensor stores (its last dimension less an int8 cache's scale bytes)."""
    width = kv_cache.shape[-1]
    return width - KV_INT8_SCALE_BYTES if kv_cache.dtype == torch.int8 else width


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) as int8 rows [..., head_dim + 2]: values, then the float16 scale."""
    values = x.float()
    scale = (values.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(max=_FLOAT16_MAX).to(torch.float16)
    wide = scale.float()
    q = torch.where(wide > 0, values / wide, torch.zeros_like(values)).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., head_dim + 2] back to values [..., head_dim] in `dtype` (products in float32)."""
    head_dim = rows.shape[-1] - KV_INT8_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float16).float()
    return (rows[..., :head_dim].float() * scale).to(dtype)


def kv_values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as values in `dtype`: an int8 cache's dequantized, a float cache's converted."""
    return dequantize_kv_rows(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)
