"""The KV tensors: one per layer, [2, num_blocks, block_size, num_kv_heads, row] (row = head_dim, or an int8
cache's head_dim + its scale: model.layers.kv_int8); blocks as bytes for the prefix cache's second tier
(core.kv_tier)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.distributed.parallel_state import TensorParallelGroup
from tokenmill.model.layers.kv_int8 import kv_row_width

logger = logging.getLogger("tokenmill")


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def row_width(self) -> int:
        """Elements of one (token, head) row: head_dim, and an int8 cache's scale bytes."""
        return kv_row_width(self.head_dim, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.row_width * element

    def num_blocks_for(self, memory_bytes: int) -> int:
        return max(0, memory_bytes // self.bytes_per_block)


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.row_width)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]


def kv_block_bytes(caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """The blocks' K/V in every layer tensor as a uint8 [blocks, bytes] tensor on the caches' device, each
    row laid out [layers, 2, block_size, num_kv_heads, row] in the cache's dtype."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=caches[0].device)
    stacked = torch.stack([cache[:, ids] for cache in caches])  # [layers, 2, n, ...]
    per_block = stacked.transpose(0, 2).transpose(1, 2).contiguous()  # [n, layers, 2, ...]
    return per_block.view(torch.uint8).reshape(len(block_ids), -1)


def kv_blocks_out(caches: list[torch.Tensor], blocks: list[tuple[int, bytes]],
                  tp: Optional[TensorParallelGroup] = None) -> list[tuple[bytes, bytes]]:
    """(key, payload) for each (block id, key): kv_block_bytes' row as bytes. Under tensor parallelism every
    rank's shard is gathered to the driver, in rank order (one payload, one file, whatever the rank count);
    the other ranks return nothing."""
    raw = kv_block_bytes(caches, [block_id for block_id, _ in blocks])
    if tp is not None:
        raw = tp.all_gather_last_dim(raw)
        if not tp.is_driver:
            return []
    rows = _to_host(raw).numpy()
    return [(key, rows[i].tobytes()) for i, (_, key) in enumerate(blocks)]


def _host_buffer(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Host memory for a copy to or from `device`: pinned (page-locked) for an accelerator, so the copy is
    one DMA transfer (torch caches pinned allocations)."""
    return torch.empty(shape, dtype=torch.uint8, pin_memory=device.type == "cuda")


def _to_host(raw: torch.Tensor) -> torch.Tensor:
    if raw.device.type == "cpu":
        return raw
    host = _host_buffer(tuple(raw.shape), raw.device)
    host.copy_(raw)
    return host


def kv_blocks_in(caches: list[torch.Tensor], loads: list[tuple[int, bytes]], spec: KVCacheSpec,
                 rank: int = 0) -> None:
    """Copies each (block id, payload) (kv_blocks_out's layout) into the block in every layer tensor. Under
    tensor parallelism a payload holds every rank's shard in rank order; this rank's is the rank-th."""
    shape = (len(loads), spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.row_width)
    size = spec.bytes_per_block
    # (bytes arrive from a decoded message; torch reads only writable buffers without a warning)
    device = caches[0].device
    raw = torch.stack([torch.frombuffer(payload if isinstance(payload, bytearray) else bytearray(payload),
                                        dtype=torch.uint8)[rank * size:(rank + 1) * size] for _, payload in loads],
                      out=_host_buffer((len(loads), size), device))
    values = raw.view(spec.dtype).reshape(shape).to(device, non_blocking=True)
    ids = torch.tensor([block_id for block_id, _ in loads], dtype=torch.long, device=caches[0].device)
    for layer, cache in enumerate(caches):
        cache[:, ids] = values[:, layer].transpose(0, 1)


def swap_blocks(device_caches: list[torch.Tensor], host_caches: list[torch.Tensor],
                swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]], device: torch.device) -> None:
    """Swap preemption: all (device, host) copies out first (their device blocks may be reused this step),
    then the (host, device) copies in."""
    for pairs, to_host in ((swap_out, True), (swap_in, False)):
        if not pairs:
            continue
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        for device_cache, host_cache in zip(device_caches, host_caches):
            if to_host:
                host_cache[:, dst] = device_cache[:, src.to(device)].to("cpu")
            else:
                device_cache[:, dst.to(device)] = host_cache[:, src].to(device, non_blocking=True)


def copy_blocks(caches: list[torch.Tensor], copies: list[tuple[int, int]], device: torch.device) -> None:
    """Copy-on-write: duplicate shared (src, dst) blocks before anyone writes into their copies."""
    if not copies:
        return
    src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=device)
    dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=device)
    for cache in caches:
        cache[:, dst] = cache[:, src]
