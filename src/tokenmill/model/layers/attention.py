"""Attention over the paged KV cache for a flat, mixed batch of prefill chunks and decodes.

The batch is one flat list of tokens (no padding). Requests are ordered decodes first:

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     query_start_loc = [0, 1, 2, 3, 7, 9]
              decodes     prefill chunk 0  chunk 1

Each layer first writes the new tokens' K/V into their cache slots (slot = block_id * block_size +
offset), then every query attends to its request's cached context, which now includes itself. A
backend is picked once at startup; `TorchAttentionBackend` is portable (CPU or any GPU).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot of each new token
    num_decodes: int  # the first num_decodes requests (and tokens) are single-token decodes
    # Decodes: padded block tables and context lengths, for one batched SDPA call.
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] long
    decode_seq_lens: torch.Tensor  # [num_decodes] long
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_ctx] bool, True = attend
    # Prefill chunks: one entry per request, host-side ints (few per step).
    prefill_query_ranges: list[tuple[int, int]] = field(default_factory=list)  # [start, end) into the flat batch
    prefill_context_lens: list[int] = field(default_factory=list)  # tokens of context incl. the chunk
    prefill_block_ids: list[torch.Tensor] = field(default_factory=list)  # [num_blocks] long per request


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


class TorchAttentionBackend:
    """Gathers each request's blocks and runs scaled_dot_product_attention."""

    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]
        num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k.to(flat_k.dtype))
        flat_v.index_copy_(0, meta.slot_mapping, v.to(flat_v.dtype))

        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], key_cache, value_cache, meta, scale)
        for (start, end), ctx_len, block_ids in zip(meta.prefill_query_ranges, meta.prefill_context_lens,
                                                    meta.prefill_block_ids):
            out[start:end] = self._prefill(q[start:end], key_cache, value_cache, block_ids, ctx_len, scale)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        batch, max_blocks = meta.decode_block_tables.shape
        block_size, num_kv_heads, head_dim = key_cache.shape[1:]
        # [B, max_blocks, block_size, Hkv, D] -> [B, Hkv, ctx, D]
        keys = key_cache[meta.decode_block_tables].view(batch, max_blocks * block_size, num_kv_heads, head_dim)
        values = value_cache[meta.decode_block_tables].view(batch, max_blocks * block_size, num_kv_heads, head_dim)
        keys = keys.transpose(1, 2).to(q.dtype)
        values = values.transpose(1, 2).to(q.dtype)
        query = q.unsqueeze(2)  # [B, Hq, 1, D]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=meta.decode_mask, scale=scale,
                                             enable_gqa=True)
        return out.squeeze(2)

    @staticmethod
    def _prefill(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor,
                 ctx_len: int, scale: float) -> torch.Tensor:
        block_size, num_kv_heads, head_dim = key_cache.shape[1:]
        keys = key_cache[block_ids].view(-1, num_kv_heads, head_dim)[:ctx_len]
        values = value_cache[block_ids].view(-1, num_kv_heads, head_dim)[:ctx_len]
        num_q = q.shape[0]
        query = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        keys = keys.transpose(0, 1).unsqueeze(0).to(q.dtype)
        values = values.transpose(0, 1).unsqueeze(0).to(q.dtype)
        if num_q == ctx_len:
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query i sits at position ctx_len - num_q + i and sees keys up to that position.
            q_pos = torch.arange(ctx_len - num_q, ctx_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(ctx_len, device=q.device).unsqueeze(0)
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=k_pos <= q_pos, scale=scale,
                                                 enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)


def get_attention_backend(device: torch.device) -> AttentionBackend:
    # A CUDA-specific backend (FlashAttention/FlashInfer) plugs in here; the torch one runs everywhere.
    return TorchAttentionBackend()
