"""The portable attention backend: gathers each request's blocks and runs torch's scaled_dot_product_attention
(CPU or any GPU), and the torch attention paths the C++ backend falls back to.

Decodes are attended in a few buckets of similar context length: each bucket gathers its blocks into one
padded [batch, ctx, heads, dim] tensor (a masked tail hides the padding) and runs one SDPA call. Bucketing
bounds the padding; gathering whole blocks with index_select into a buffer reused by every layer keeps the
copy at memory speed.

Sliding windows are added to the masks. SDPA cannot soft-cap scores, so soft-capped layers run
`softcapped_attention` (the same attention in plain torch ops). `windowed_paged_decode` attends decode rows
through their block tables, gathering only the blocks a window can touch (the C++ backend's path where its
kernels do not fit).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.model.layers.attention.base import AttentionInputs, AttentionMetadata
from tokenmill.model.layers.kv_int8 import kv_values
from tokenmill.model.layers.kv_write import write_kv

# A decode bucket may pad its members up to this factor of their real total context.
MAX_PADDING_FACTOR = 1.25
MIN_BUCKET_SIZE = 8


@dataclass
class DecodeBucket:
    start: int  # first decode token of the bucket in the flat batch
    end: int
    block_ids: torch.Tensor  # [batch * max_blocks] long, row-major, padded with stale (valid) block ids
    max_blocks: int
    mask: torch.Tensor  # [batch, 1, 1, max_blocks * block_size] bool, True = attend


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    # Scratch for gathered K/V, shared by all layers of one step (allocated on first use).
    gather_buffer: Optional[torch.Tensor] = None


def bucket_decodes(lengths: list[int]) -> list[tuple[int, int]]:
    """Split ascending context lengths into [start, end) runs whose padding stays bounded."""
    buckets, start, total = [], 0, 0
    for i, length in enumerate(lengths):
        count = i - start + 1
        if count > MIN_BUCKET_SIZE and count * length > MAX_PADDING_FACTOR * (total + length):
            buckets.append((start, i))
            start, total = i, 0
        total += length
    if lengths:
        buckets.append((start, len(lengths)))
    return buckets


def _decode_bucket(table: np.ndarray, lengths: np.ndarray, start: int, end: int, block_size: int,
                   device: torch.device) -> DecodeBucket:
    """Members' tables padded to the longest: entries past a member's own blocks are whatever its row
    held before (valid block ids), hidden by the mask."""
    max_blocks = -(-int(lengths[start:end].max()) // block_size)
    block_ids = torch.from_numpy(table[start:end, :max_blocks].astype(np.int64).reshape(-1))
    key_pos = torch.arange(max_blocks * block_size)
    mask = key_pos.unsqueeze(0) < torch.from_numpy(lengths[start:end]).unsqueeze(1)
    return DecodeBucket(start=start, end=end, block_ids=block_ids.to(device), max_blocks=max_blocks,
                        mask=mask.view(end - start, 1, 1, -1).to(device))


class TorchAttentionBackend:
    """Gathers each request's blocks and runs scaled_dot_product_attention."""

    name = "torch"
    paged_decode = False
    kernels = None

    def describe(self) -> str:
        return "torch (scaled_dot_product_attention over gathered blocks)"

    def prepare_metadata(self, inputs: AttentionInputs) -> TorchAttentionMetadata:
        device = inputs.slot_mapping.device
        lengths = inputs.decode_context_lens
        buckets = [_decode_bucket(inputs.decode_block_table, lengths, lo, hi, inputs.block_size, device)
                   for lo, hi in bucket_decodes(lengths.tolist())]
        return TorchAttentionMetadata(**AttentionMetadata.common_fields(inputs), decode_buckets=buckets)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: TorchAttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        self.decode_into(out, q, kv_cache, meta, scale, window, softcap)
        self.prefill_into(out, q, kv_cache, meta, scale, window, softcap)
        return out

    def decode_into(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: TorchAttentionMetadata,
                    scale: float, window: int | None = None, softcap: float | None = None) -> None:
        for bucket in meta.decode_buckets:
            out[bucket.start:bucket.end] = self._decode(q[bucket.start:bucket.end], kv_cache, bucket, meta, scale,
                                                        window, softcap)

    def prefill_into(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, window: int | None = None, softcap: float | None = None) -> None:
        for chunk in range(len(meta.prefill_query_ranges)):
            self._prefill_chunk_into(out, q, kv_cache, meta, chunk, scale, window, softcap)

    def _prefill_chunk_into(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                            chunk: int, scale: float, window: int | None, softcap: float | None) -> None:
        start, end = meta.prefill_query_ranges[chunk]
        out[start:end] = self._prefill(q[start:end], kv_cache, meta.prefill_block_ids[chunk],
                                       meta.prefill_context_lens[chunk], scale, window, softcap)

    @staticmethod
    def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
        """K and V of the given blocks, as [2, len(block_ids) * block_size, Hkv, row] in the cache's dtype (a view of
        scratch; row = D, or an int8 cache's D + 2)."""
        num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
        per_block = block_size * num_kv_heads * head_dim
        needed = 2 * block_ids.numel() * per_block
        if meta.gather_buffer is None or meta.gather_buffer.numel() < needed or \
                meta.gather_buffer.dtype != kv_cache.dtype:
            meta.gather_buffer = torch.empty(needed, dtype=kv_cache.dtype, device=kv_cache.device)
        out = meta.gather_buffer[:needed].view(2, block_ids.numel(), per_block)
        blocks = kv_cache.view(2, num_blocks, per_block)
        torch.index_select(blocks[0], 0, block_ids, out=out[0])
        torch.index_select(blocks[1], 0, block_ids, out=out[1])
        return out.view(2, -1, num_kv_heads, head_dim)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, bucket: DecodeBucket, meta: TorchAttentionMetadata,
                scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        batch, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[3]
        group = num_heads // num_kv_heads
        kv = self._gather(kv_cache, bucket.block_ids, meta)
        keys = kv_values(kv[0], q.dtype).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, ctx, D]
        values = kv_values(kv[1], q.dtype).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        # The `group` query heads sharing a KV head act as `group` queries of length 1 each; with no
        # causal mask between them this equals grouped-query attention without repeating K/V.
        query = q.view(batch, num_kv_heads, group, head_dim)
        mask = bucket.mask
        if window is not None:
            # The bucket's mask is each row's context as a prefix of Trues; the row's query sits at its end.
            lengths = mask.sum(dim=-1, keepdim=True)
            key_pos = torch.arange(mask.shape[-1], device=mask.device)
            mask = mask & (key_pos >= lengths - window)
        if softcap is not None:
            out = softcapped_attention(query, keys, values, scale, softcap, mask=mask)
            return out.reshape(batch, num_heads, head_dim)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                             scale=scale)
        return out.reshape(batch, num_heads, head_dim)

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, ctx_len: int,
                 scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        kv = self._gather_prefill(kv_cache, block_ids)
        keys = kv_values(kv[0][:ctx_len], q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
        values = kv_values(kv[1][:ctx_len], q.dtype).transpose(0, 1).unsqueeze(0)
        num_q = q.shape[0]
        query = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if softcap is not None:
            # Query i sits at position ctx_len - num_q + i and sees keys up to it (and within the window).
            q_pos = torch.arange(ctx_len - num_q, ctx_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(ctx_len, device=q.device).unsqueeze(0)
            mask = (k_pos <= q_pos) if window is None else (k_pos <= q_pos) & (k_pos > q_pos - window)
            out = softcapped_attention(query, keys, values, scale, softcap, mask=mask)
            return out.squeeze(0).transpose(0, 1)
        # Only a context longer than the window hides any key from any of these queries.
        windowed = window is not None and ctx_len > window
        if windowed:
            q_pos = torch.arange(ctx_len - num_q, ctx_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(ctx_len, device=q.device).unsqueeze(0)
            mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        elif num_q == ctx_len:
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        elif num_q >= SPLIT_CHUNK_MIN_TOKENS and q.device.type == "cpu" and _FLASH_WITH_LSE is not None:
            out = chunk_after_prefix_attention(query, keys, values, scale)
        else:
            # Query i sits at position ctx_len - num_q + i and sees keys up to that position.
            q_pos = torch.arange(ctx_len - num_q, ctx_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(ctx_len, device=q.device).unsqueeze(0)
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=k_pos <= q_pos, scale=scale,
                                                 enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)

    @staticmethod
    def _gather_prefill(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
        blocks = kv_cache.view(2, num_blocks, block_size * num_kv_heads * head_dim)
        return blocks.index_select(1, block_ids).view(2, -1, num_kv_heads, head_dim)


def softcapped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                         softcap: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention whose scores are capped as cap * tanh(score / cap) before the softmax (Gemma 2).

    query [..., Hq, n, D]; keys, values [..., Hkv, ctx, D] with Hkv dividing Hq; mask broadcastable
    to [..., Hq, n, ctx], True = attend. The reference's order of operations: scaled scores, the
    cap, masked to -inf, a float32 softmax, the weighted sum of values.
    """
    heads, kv_heads = query.shape[-3], keys.shape[-3]
    shape = query.shape
    if heads != kv_heads:
        # The `group` query heads of a KV head as one extra axis, so K/V broadcast instead of repeating.
        query = query.unflatten(-3, (kv_heads, heads // kv_heads))
        keys, values = keys.unsqueeze(-3), values.unsqueeze(-3)
        if mask is not None and mask.dim() >= 3:
            mask = mask.unsqueeze(-3)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, values).reshape(shape)


# torch's CPU flash-attention kernel, which also returns each query's log-sum-exp of scores (the public
# SDPA does not); present in torch >= 2.3.
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# Below this many queries the split's extra calls and merge cost about what the mask costs (measurements in
# docs/performance.md, item 14); chunks of long prompts are far above it.
SPLIT_CHUNK_MIN_TOKENS = 768


def chunk_after_prefix_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                 scale: float) -> torch.Tensor:
    """Causal attention of a prefill chunk that follows cached context, on the CPU.

    query: [1, Hq, n, D], the chunk's queries at the last n of ctx positions; keys, values:
    [1, Hkv, ctx, D]. Returns [1, Hq, n, D].

    SDPA with a bottom-right causal mask adds the mask to every score tile and cannot skip the tiles
    it hides. Here the keys are split in two: every query sees all of the cached prefix (no mask), and
    the chunk's own keys form a square where SDPA's top-left `is_causal` is exactly right (and skips
    the upper triangle). The two partial softmaxes are merged with their log-sum-exps. For the
    prefix, the query heads that share a KV head are stacked along the sequence axis, so K/V are read
    once per KV head and never repeated. Faster than the masked call for chunks of about a thousand tokens
    and more after a cached prefix (docs/performance.md, item 14).
    """
    _, num_heads, num_q, head_dim = query.shape
    num_kv_heads, ctx_len = keys.shape[1], keys.shape[2]
    prefix_len = ctx_len - num_q
    group = num_heads // num_kv_heads
    # Heads h = kv * group + g share KV head kv, so [Hq, n] regroups as [Hkv, group * n].
    stacked = query.reshape(1, num_kv_heads, group * num_q, head_dim)
    out_prefix, lse_prefix = _FLASH_WITH_LSE(stacked, keys[:, :, :prefix_len], values[:, :, :prefix_len],
                                             scale=scale)
    own_keys = keys[:, :, prefix_len:]
    own_values = values[:, :, prefix_len:]
    if group > 1:
        own_keys = own_keys.repeat_interleave(group, dim=1)
        own_values = own_values.repeat_interleave(group, dim=1)
    out_own, lse_own = _FLASH_WITH_LSE(query, own_keys, own_values, is_causal=True, scale=scale)
    lse_prefix = lse_prefix.reshape(1, num_heads, num_q, 1)
    lse_own = lse_own.reshape(1, num_heads, num_q, 1)
    top = torch.maximum(lse_prefix, lse_own)
    weight_prefix = (lse_prefix - top).exp_()
    weight_own = (lse_own - top).exp_()
    total = weight_prefix + weight_own
    acc_dtype = torch.promote_types(query.dtype, torch.float32)
    out = out_prefix.reshape(1, num_heads, num_q, head_dim).to(acc_dtype) * (weight_prefix / total).to(acc_dtype)
    out.addcmul_(out_own.to(acc_dtype), (weight_own / total).to(acc_dtype))
    return out.to(query.dtype)


def windowed_paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                          context_lens: torch.Tensor, scale: float, window: int,
                          softcap: float | None = None) -> torch.Tensor:
    """Decode attention over the last `window` keys of each row, read through its block table.

    q: [rows, Hq, D]; block_tables: [rows, max_blocks]; context_lens: [rows] (incl. the query). Each row
    gathers the `span` blocks from the one holding its first visible key (a window touches at most
    ceil(window / block_size) + 1 blocks), so the work is bounded by the window, not the context:

        context: |b0|b1|b2|b3|b4|      window of 6, block_size 4, 19 keys (query at 18)
        gather:        b3 b4 (+b5 clamped, masked)  keys 13..18 visible
    """
    rows, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = kv_cache.shape[1:4]
    lengths = context_lens.long().unsqueeze(1)  # [rows, 1]
    max_blocks = block_tables.shape[1]
    # A window touches at most ceil(window / block_size) + 1 blocks, and no row more than the table holds.
    span = min(-(-window // block_size) + 1, max_blocks)
    cols = (lengths - window).clamp(min=0) // block_size + torch.arange(span, device=q.device)  # [rows, span]
    ids = block_tables.long().gather(1, cols.clamp(max=max_blocks - 1))
    blocks = kv_cache.view(2, num_blocks, block_size * num_kv_heads * kv_cache.shape[4])
    kv = blocks[:, ids.flatten()].view(2, rows, span * block_size, num_kv_heads, kv_cache.shape[4])
    # Positions from the unclamped columns: a clamped duplicate lies past the context and is masked.
    key_pos = (cols.unsqueeze(-1) * block_size + torch.arange(block_size, device=q.device)).view(rows, -1)
    mask = (key_pos < lengths) & (key_pos >= lengths - window)
    keys = kv_values(kv[0], q.dtype).transpose(1, 2)  # [rows, Hkv, span * block_size, D]
    values = kv_values(kv[1], q.dtype).transpose(1, 2)
    query = q.reshape(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if softcap is not None:
        out = softcapped_attention(query, keys, values, scale, softcap, mask=mask.view(rows, 1, 1, -1))
    else:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask.view(rows, 1, 1, -1), scale=scale)
    return out.reshape(rows, num_heads, head_dim)
