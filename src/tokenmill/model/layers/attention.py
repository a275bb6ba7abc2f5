"""Attention over the paged KV cache for a flat, mixed batch of prefill chunks and decodes.

The batch is one flat list of tokens (no padding). Single-token requests (decodes) come first,
sorted by context length, then prefill chunks:

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]
              decodes    chunk of p0   chunk of p1

Each layer first writes the new tokens' K/V into their cache slots (slot = block_id * block_size +
offset), then every query attends to its request's cached context, which now includes itself.

Decodes are attended in a few buckets of similar context length: each bucket gathers its blocks
into one padded [batch, ctx, heads, dim] tensor (a masked tail hides the padding) and runs one
SDPA call. Bucketing bounds the padding; gathering whole blocks with index_select into a buffer
reused by every layer keeps the copy at memory speed.

A backend is picked once at startup: `TorchAttentionBackend` is portable (CPU or any GPU);
`CpuPagedAttentionBackend` (the default on CPU when tokenmill's C++ kernels build) attends decodes
straight from the paged cache through `block_tables` and `context_lens`, with no gather and no
padding; its prefill kernel does the same for chunks shorter than CPU_PREFILL_KERNEL_MAX_TOKENS,
visiting only the key tiles a causal (or windowed) query can see. Longer chunks take the torch path.

Sliding-window layers (Mistral, Gemma 3's local layers) pass `window`: a query at position p then
sees only keys at positions p - window < k <= p (transformers' convention). The torch paths add it
to their masks. The C++ decode kernel has no window: while every decoding row's context fits in the
window (the window then hides nothing) windowed layers use it all the same; beyond that each decode
row goes through the prefill kernel as a one-token chunk, which takes a window. The torch backend
(and the C++ one where the prefill kernel does not fit: a block size not a multiple of 8) runs
`windowed_paged_decode`, which gathers only the blocks the window (or the longest context) can touch.

Layers with attention logit soft-capping (Gemma 2) pass `softcap`: every score becomes
cap * tanh(score / cap) before the softmax. SDPA cannot do that, so the torch paths then run
`softcapped_attention` (the same attention in plain torch ops), and the C++ decode kernel caps the
scores itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from tokenmill.config import ATTENTION_BACKENDS
from tokenmill.model.layers.kv_write import write_kv
from tokenmill.model.layers.paged_tables import padded_block_table

if TYPE_CHECKING:
    from tokenmill.model.layers.triton_attention import PrefillTables


@dataclass
class DecodeBucket:
    start: int  # first decode token of the bucket in the flat batch
    end: int
    block_ids: torch.Tensor  # [batch * max_blocks] long, row-major, padded with block 0
    max_blocks: int
    mask: torch.Tensor  # [batch, 1, 1, max_blocks * block_size] bool, True = attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot of each new token
    num_decodes: int  # the first num_decodes tokens are single-token requests
    decode_buckets: list[DecodeBucket] = field(default_factory=list)  # torch backend
    # Paged-kernel backends: [num_decodes, max_blocks] int32 (padded with 0) and [num_decodes] int32.
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    # Prefill chunks: one entry per request, host-side ints (few per step).
    prefill_query_ranges: list[tuple[int, int]] = field(default_factory=list)  # [start, end) in the flat batch
    prefill_context_lens: list[int] = field(default_factory=list)  # tokens of context incl. the chunk
    prefill_block_ids: list[torch.Tensor] = field(default_factory=list)  # [num_blocks] long per request
    # Scratch for gathered K/V, shared by all layers of one step (allocated on first use).
    gather_buffer: torch.Tensor | None = None
    # The prefill chunks as padded tables for the triton kernels, built by the first layer of the step.
    prefill_tables: PrefillTables | None = None
    # The same for the C++ prefill kernel (CpuPagedAttentionBackend), built by the first layer of the step.
    cpu_prefill_tables: CpuPrefillTables | None = None
    # Each decode row as a one-token chunk, [num_decodes, 2] int32, for windowed decodes through the C++
    # prefill kernel (CpuPagedAttentionBackend); built by the first windowed layer of the step.
    cpu_decode_ranges: torch.Tensor | None = None


@dataclass
class CpuPrefillTables:
    """The prefill chunks the C++ kernel attends (`kernel_chunks`, indices into the metadata's lists) as
    its int32 inputs; the other chunks (`torch_chunks`) take the torch path."""

    kernel_chunks: list[int]
    torch_chunks: list[int]
    block_table: torch.Tensor  # [len(kernel_chunks), max_blocks] int32, padded with 0
    query_ranges: torch.Tensor  # [len(kernel_chunks), 2] int32: each chunk's [start, end) rows in the batch
    context_lens: torch.Tensor  # [len(kernel_chunks)] int32


class AttentionBackend(Protocol):
    name: str
    # True: decodes arrive as padded, masked buckets; False: as block tables + context lengths.
    uses_decode_buckets: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor: ...


class TorchAttentionBackend:
    """Gathers each request's blocks and runs scaled_dot_product_attention."""

    name = "torch"
    uses_decode_buckets = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        self.decode_into(out, q, kv_cache, meta, scale, window, softcap)
        self.prefill_into(out, q, kv_cache, meta, scale, window, softcap)
        return out

    def decode_into(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
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
    def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """K and V of the given blocks, as [2, len(block_ids) * block_size, Hkv, D] (a view of scratch)."""
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

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, bucket: DecodeBucket, meta: AttentionMetadata,
                scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        batch, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[3]
        group = num_heads // num_kv_heads
        kv = self._gather(kv_cache, bucket.block_ids, meta)
        keys = kv[0].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, ctx, D]
        values = kv[1].view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
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
            out = softcapped_attention(query, keys.to(q.dtype), values.to(q.dtype), scale, softcap, mask=mask)
            return out.reshape(batch, num_heads, head_dim)
        out = F.scaled_dot_product_attention(query, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask,
                                             scale=scale)
        return out.reshape(batch, num_heads, head_dim)

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, ctx_len: int,
                 scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        kv = self._gather_prefill(kv_cache, block_ids)
        keys = kv[0][:ctx_len].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, ctx, D]
        values = kv[1][:ctx_len].transpose(0, 1).unsqueeze(0).to(q.dtype)
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


# Prefill chunks of fewer queries than this go through the C++ float32 prefill kernel, longer ones through
# SDPA: the kernel skips the key tiles a causal query cannot see and reads the cache in place, which wins on
# short and medium chunks; on chunks of about a thousand tokens SDPA's large tiles through MKL's GEMM catch
# up and then outrun it (the README and docs/benchmarks.md have the measurements).
CPU_PREFILL_KERNEL_MAX_TOKENS = 768


class CpuPagedAttentionBackend(TorchAttentionBackend):
    """Decodes and short prefill chunks through the C++ paged kernels (csrc/decode_attention.cpp, csrc/prefill_attention.cpp), which read the
    cache in place through the block tables; KV writes and long prefill chunks as the torch backend."""

    name = "cpu"
    uses_decode_buckets = False

    def __init__(self, kernels) -> None:
        self.kernels = kernels
        # Set by the runner under `--block-matmul bfloat16` / `bfloat16-int8` on AMX: every prefill chunk goes
        # through paged_prefill_attention_bf16 (SDPA's float32 GEMMs no longer win on long chunks).
        self.bf16_prefill = False
        # Over a bfloat16 cache, whose keys and values are bfloat16 already, prefill chunks take the bfloat16
        # kernel wherever it runs (AMX tiles, or AVX-512 BF16 dot products): its scores keep float32's precision
        # (q as high and low bfloat16 parts) and only the probabilities are rounded, faster than the float32
        # kernel (docs/benchmarks.md, "Every family on the fused decode stack").
        path = getattr(kernels, "bf16_attention_path", lambda: "")()
        self.bf16_cache_prefill_path = path

    def describe_prefill(self, cache_dtype: torch.dtype) -> str:
        """How prefill chunks attend over a cache of this dtype (for the start-up log)."""
        if self.bf16_cache_prefill_path and cache_dtype == torch.bfloat16:
            products = {"amx": "AMX bfloat16 tiles", "avx512_bf16": "AVX-512 BF16 dot products"}
            return (f"prefill attention on {products.get(self.bf16_cache_prefill_path, self.bf16_cache_prefill_path)}"
                    " over the bfloat16 cache")
        return f"prefill attention in float32 (C++ kernel below {CPU_PREFILL_KERNEL_MAX_TOKENS} tokens, SDPA above)"

    def _bf16_prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, softcap: float | None) -> bool:
        if softcap or q.shape[-1] % 32:
            return False
        return self.bf16_prefill or (bool(self.bf16_cache_prefill_path) and kv_cache.dtype == torch.bfloat16)

    @staticmethod
    def _prefill_kernel_fits(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether paged_prefill_attention takes these tensors: the query in the cache's dtype or float32 over a
        16-bit cache, blocks of a multiple of 8 tokens, heads contiguous, a contiguous output."""
        dtypes_fit = q.dtype == kv_cache.dtype or (q.dtype == torch.float32 and
                                                   kv_cache.dtype in (torch.float16, torch.bfloat16))
        return dtypes_fit and kv_cache.shape[2] % 8 == 0 and q.stride(-1) == 1 and q.stride(1) == q.shape[2] \
            and out.is_contiguous()

    def prefill_into(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, window: int | None = None, softcap: float | None = None) -> None:
        if not meta.prefill_query_ranges:
            return
        if not self._prefill_kernel_fits(out, q, kv_cache):
            super().prefill_into(out, q, kv_cache, meta, scale, window, softcap)
            return
        bf16 = self._bf16_prefill(q, kv_cache, softcap)
        tables = meta.cpu_prefill_tables
        if tables is None:
            tables = meta.cpu_prefill_tables = cpu_prefill_tables(meta, all_chunks=bf16)
        if tables.kernel_chunks and bf16:
            self.kernels.paged_prefill_attention_bf16(q, kv_cache, tables.block_table, tables.query_ranges,
                                                      tables.context_lens, scale, window or 0, out)
        elif tables.kernel_chunks:
            self.kernels.paged_prefill_attention(q, kv_cache, tables.block_table, tables.query_ranges,
                                                 tables.context_lens, scale, softcap or 0.0, window or 0, out)
        for chunk in tables.torch_chunks:
            self._prefill_chunk_into(out, q, kv_cache, meta, chunk, scale, window, softcap)

    def decode_into(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None, softcap: float | None = None) -> None:
        # The C++ decode kernel attends a whole context: a windowed layer uses it while the decode table's width
        # (the longest context, rounded up to whole blocks) fits in the window, and the prefill kernel beyond.
        windowed = window is not None and meta.num_decodes and \
            meta.decode_block_tables.shape[1] * kv_cache.shape[2] > window
        if windowed and self._prefill_kernel_fits(out, q, kv_cache):
            # The prefill kernel takes a window: each decode row is a one-token chunk at the end of its context,
            # and only the key tiles its window reaches are read.
            if meta.cpu_decode_ranges is None:
                rows = torch.arange(meta.num_decodes, dtype=torch.int32)
                meta.cpu_decode_ranges = torch.stack((rows, rows + 1), dim=1)
            self.kernels.paged_prefill_attention(q, kv_cache, meta.decode_block_tables, meta.cpu_decode_ranges,
                                                 meta.decode_context_lens, scale, softcap or 0.0, window, out)
        elif windowed:
            out[:meta.num_decodes] = windowed_paged_decode(q[:meta.num_decodes], kv_cache, meta.decode_block_tables,
                                                           meta.decode_context_lens, scale, window, softcap)
        elif meta.num_decodes:
            # The kernel reads a 16-bit cache under a float32 query directly; other mixes meet in the cache's dtype.
            mixed = q.dtype == torch.float32 and kv_cache.dtype in (torch.float16, torch.bfloat16)
            query = q[:meta.num_decodes].to(q.dtype if mixed else kv_cache.dtype).contiguous()
            out[:meta.num_decodes] = self.kernels.paged_decode_attention(
                query, kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale, softcap or 0.0)


def cpu_prefill_tables(meta: AttentionMetadata, all_chunks: bool = False) -> CpuPrefillTables:
    """Splits the step's prefill chunks between the C++ kernel (those under CPU_PREFILL_KERNEL_MAX_TOKENS, or
    all of them) and SDPA and packs the kernel's inputs."""
    ranges = meta.prefill_query_ranges
    max_tokens = None if all_chunks else CPU_PREFILL_KERNEL_MAX_TOKENS
    kernel = [i for i, (start, end) in enumerate(ranges) if max_tokens is None or end - start < max_tokens]
    others = [i for i, (start, end) in enumerate(ranges) if max_tokens is not None and end - start >= max_tokens]
    table = padded_block_table([meta.prefill_block_ids[i] for i in kernel], torch.device("cpu"))
    return CpuPrefillTables(kernel, others, table,
                            torch.tensor([ranges[i] for i in kernel], dtype=torch.int32).view(-1, 2),
                            torch.tensor([meta.prefill_context_lens[i] for i in kernel], dtype=torch.int32))


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
    blocks = kv_cache.view(2, num_blocks, block_size * num_kv_heads * head_dim)
    kv = blocks[:, ids.flatten()].view(2, rows, span * block_size, num_kv_heads, head_dim)
    # Positions from the unclamped columns: a clamped duplicate lies past the context and is masked.
    key_pos = (cols.unsqueeze(-1) * block_size + torch.arange(block_size, device=q.device)).view(rows, -1)
    mask = (key_pos < lengths) & (key_pos >= lengths - window)
    keys = kv[0].transpose(1, 2).to(q.dtype)  # [rows, Hkv, span * block_size, D]
    values = kv[1].transpose(1, 2).to(q.dtype)
    query = q.reshape(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if softcap is not None:
        out = softcapped_attention(query, keys, values, scale, softcap, mask=mask.view(rows, 1, 1, -1))
    else:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask.view(rows, 1, 1, -1), scale=scale)
    return out.reshape(rows, num_heads, head_dim)


def get_attention_backend(device: torch.device, name: str = "auto") -> AttentionBackend:
    """`auto`: the triton kernels on CUDA when triton imports; on CPU the C++ paged kernels when they
    build here; else the portable torch backend. An explicit choice that cannot run raises, naming why.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(ATTENTION_BACKENDS)}")
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from tokenmill.model.layers import triton_attention

        if name == "triton" or triton_attention.triton_unavailable_reason(device) is None:
            return triton_attention.make_triton_backend(device)
    if name == "torch" or device.type != "cpu":
        if name == "cpu":
            raise ValueError("the cpu attention backend runs only on the CPU device")
        return TorchAttentionBackend()
    from tokenmill.model.layers import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        if name == "cpu":
            raise RuntimeError(f"the cpu attention backend is unavailable: {cpu_kernels.build_error()}")
        return TorchAttentionBackend()
    return CpuPagedAttentionBackend(kernels)
