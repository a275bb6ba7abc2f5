"""Writing a step's new keys and values into the paged KV cache, shared by the attention backends."""
from __future__ import annotations

import torch


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into the cache slots slot_mapping [T] (= block_id * block_size + offset) of
    kv_cache [2, num_blocks, block_size, Hkv, D], rounded to the cache's dtype."""
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    slots = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    slots[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    slots[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
