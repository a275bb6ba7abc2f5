"""What every attention backend shares: the step's layout through one KV cache group (`AttentionInputs`, built
by the runner's input batch), the metadata fields every backend reads, and the interface.

A step is one flat list of tokens (no padding). Single-token requests (decodes) come first, sorted by
context length, then prefill chunks:

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]
              decodes    chunk of p0   chunk of p1

Each layer first writes the new tokens' K/V into their cache slots (slot = block_id * block_size +
offset), then every query attends to its request's cached context, which now includes itself.

Once per step (and KV cache group) the runner hands the layout to the backend's `prepare_metadata`, which
returns the backend's own metadata (its tensors built once, on its device); every layer of the step then
calls `forward` with it. Sliding-window layers pass `window` (a query at position p sees keys at
p - window < k <= p, transformers' convention); soft-capped layers (Gemma 2) pass `softcap` (every score
becomes cap * tanh(score / cap) before the softmax).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import numpy as np
import torch


@dataclass
class AttentionInputs:
    """One step's attention layout through one KV cache group's block table, host-side except the slots."""

    slot_mapping: torch.Tensor  # [num_tokens] long, on the step's device: cache slot of each new token
    block_size: int
    num_decodes: int  # the first num_decodes tokens are single-token rows
    decode_block_table: np.ndarray  # [num_decodes, max_blocks] int32: each decode row's blocks (then stale ids)
    decode_context_lens: np.ndarray  # [num_decodes] int32, ascending: each row's context, itself included
    prefill_query_ranges: list[tuple[int, int]] = field(default_factory=list)  # [start, end) in the flat batch
    prefill_context_lens: list[int] = field(default_factory=list)  # tokens of context incl. the chunk
    prefill_block_ids: list[np.ndarray] = field(default_factory=list)  # [num_blocks] int64 per chunk


@dataclass
class AttentionMetadata:
    """The fields every backend reads; each backend's metadata adds its own."""

    slot_mapping: torch.Tensor
    num_decodes: int
    prefill_query_ranges: list[tuple[int, int]]
    prefill_context_lens: list[int]
    prefill_block_ids: list[torch.Tensor]  # [num_blocks] long per chunk, on the step's device

    @staticmethod
    def common_fields(inputs: AttentionInputs) -> dict:
        """The shared fields of `inputs`, on the slots' device, as keyword arguments of a metadata class."""
        device = inputs.slot_mapping.device
        return dict(slot_mapping=inputs.slot_mapping, num_decodes=inputs.num_decodes,
                    prefill_query_ranges=inputs.prefill_query_ranges,
                    prefill_context_lens=inputs.prefill_context_lens,
                    prefill_block_ids=[torch.from_numpy(ids).to(device) for ids in inputs.prefill_block_ids])


class AttentionBackend(Protocol):
    name: str
    # True: decode rows are attended through block tables, so a speculative verify may be laid out as one
    # decode row per position (the input batch reads this); False: decodes are gathered per bucket.
    paged_decode: bool
    # tokenmill's C++ CPU kernels when this backend runs on them (the model's norms, rotary and linear layers
    # then use them too), else None.
    kernels: Optional[object]

    def prepare_metadata(self, inputs: AttentionInputs) -> AttentionMetadata: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor: ...

    def describe(self) -> str:
        """What runs the attention, for the start-up log."""
        ...
