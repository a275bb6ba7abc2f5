"""The 8-bit KV cache (`--kv-cache-dtype int8`): each token's key (and value) of each KV head is stored as
head_dim int8 values followed by one scale per group of 32 of them, each a float16 in two more bytes:

    kv_cache  int8 [2, num_blocks, block_size, num_kv_heads, head_dim + 2 * ceil(head_dim / 32)]
    row       q[0] ... q[head_dim - 1] | scale[0] ... (float16 bits)     value[d] = q[d] * scale[d // 32]

Llama.cpp's Q8_0 grouping (its `-ctk q8_0`), laid out per row: a row is quantized once when it is written and
never again (a per-block scale would have to requantize a block's earlier rows when a later token grows its
range), and 32-value groups keep an outlier channel from flattening a whole head's resolution (one scale per
row of Gemma 3's 256 values costs three times the perplexity of 32-value groups: docs/benchmarks.md). The cache
stays one tensor per layer whose blocks copy, swap and move to the offload tier as bytes, like any other
dtype. A row takes 1 + 1/16 bytes per value where a 16-bit cache takes 2: 1.88x the tokens in the same memory.

The C++ kernels (csrc/decode_attention.cpp, csrc/prefill_attention.cpp, csrc/decoder_stack.cpp) read and write
the same rows: each scale, absmax / 127 rounded to float16 first, divides its group's values before they round
to nearest even, so the torch and C++ writers store the same bytes.
"""
from __future__ import annotations

import torch

KV_INT8_GROUP = 32
KV_INT8_SCALE_BYTES = 2  # per group
_FLOAT16_MAX = 65504.0


def kv_int8_groups(head_dim: int) -> int:
    return -(-head_dim // KV_INT8_GROUP)


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements in one (token, head) row of a cache of this dtype: head_dim, plus the scales' bytes for int8."""
    return head_dim + KV_INT8_SCALE_BYTES * kv_int8_groups(head_dim) if dtype == torch.int8 else head_dim


def cache_head_dim(kv_cache: torch.Tensor) -> int:
    """The head_dim a cache tensor stores (its last dimension less an int8 cache's scale bytes)."""
    width = kv_cache.shape[-1]
    if kv_cache.dtype != torch.int8:
        return width
    # width = D + 2 * ceil(D / 32) = 34 * ceil(D / 32) - (32 * ceil(D / 32) - D), the second term below 32: so
    # ceil(D / 32) = ceil(width / 34)
    head_dim = width - KV_INT8_SCALE_BYTES * -(-width // (KV_INT8_GROUP + KV_INT8_SCALE_BYTES))
    if kv_row_width(head_dim, torch.int8) != width:
        raise ValueError(f"an int8 KV cache row of {width} bytes holds no whole head")
    return head_dim


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [..., groups, 32], a last partial group padded with zeros."""
    pad = kv_int8_groups(x.shape[-1]) * KV_INT8_GROUP - x.shape[-1]
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.unflatten(-1, (-1, KV_INT8_GROUP))


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) as int8 rows: values, then a float16 scale per 32 of them."""
    head_dim = x.shape[-1]
    groups = _grouped(x.float())
    scale = (groups.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(max=_FLOAT16_MAX).to(torch.float16)
    wide = scale.float()
    q = torch.where(wide > 0, groups / wide, torch.zeros_like(groups)).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([q.flatten(-2)[..., :head_dim], scale.squeeze(-1).contiguous().view(torch.int8)], dim=-1)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., width] back to values [..., head_dim] in `dtype` (products in float32)."""
    head_dim = cache_head_dim(rows)
    scale = rows[..., head_dim:].contiguous().view(torch.float16).float()
    values = _grouped(rows[..., :head_dim].float()) * scale.unsqueeze(-1)
    return values.flatten(-2)[..., :head_dim].to(dtype)


def kv_values(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as values in `dtype`: an int8 cache's dequantized, a float cache's converted."""
    return dequantize_kv_rows(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)
