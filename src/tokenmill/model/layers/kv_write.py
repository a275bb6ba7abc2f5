"""Writing a step's new keys and values into the paged KV cache, shared by the attention backends."""
from __future__ import annotations

import torch

from tokenmill.model.layers.kv_int8 import quantize_kv_rows


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into the cache slots slot_mapping [T] (= block_id * block_size + offset) of
    kv_cache [2, num_blocks, block_size, Hkv, row] (row = D, or D + 2 for an int8 cache: kv_int8), rounded to
    the cache's dtype (an int8 cache's rows quantized with their scales)."""
    num_blocks, block_size, num_kv_heads, row = kv_cache.shape[1:]
    slots = kv_cache.view(2, num_blocks * block_size, num_kv_heads, row)
    if kv_cache.dtype == torch.int8:
        k, v = quantize_kv_rows(k), quantize_kv_rows(v)
    slots[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    slots[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
