"""Block tables as the paged attention kernels read them (C++ on the CPU, Triton on CUDA)."""
from __future__ import annotations

import torch


def padded_block_table(block_ids: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Requests' block ids as one [requests, max_blocks] int32 table, padded with block 0."""
    table = torch.zeros(len(block_ids), max((ids.numel() for ids in block_ids), default=0), dtype=torch.int32,
                        device=device)
    for row, ids in enumerate(block_ids):
        table[row, :ids.numel()] = ids
    return table
