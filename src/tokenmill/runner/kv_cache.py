"""The KV tensors: one per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger("tokenmill")


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def num_blocks_for(self, memory_bytes: int) -> int:
        return max(0, memory_bytes // self.bytes_per_block)


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
