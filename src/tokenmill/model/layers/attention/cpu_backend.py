"""The C++ CPU backend (the default on CPU where tokenmill's kernels build): decodes and prefill chunks read
the paged cache in place through block tables (csrc/decode_attention.cpp, csrc/prefill_attention.cpp), with
no gather and no padding; the prefill kernel visits only the key tiles a causal (or windowed) query can see.

Which kernel a prefill chunk takes: over a bfloat16 cache, or under the bfloat16 block matmuls, the bfloat16
kernel (AMX tiles, or AVX-512 BF16 dot products) for every chunk; otherwise the float32 kernel for chunks
shorter than CPU_PREFILL_KERNEL_MAX_TOKENS and SDPA (the torch backend's path) for longer ones.

The C++ decode kernel has no window: while every decoding row's context fits in the window (the window then
hides nothing) windowed layers use it all the same; beyond that each decode row goes through the prefill
kernel as a one-token chunk, which takes a window. Where the prefill kernel does not fit (a block size not a
multiple of 8) windowed decodes run the torch `windowed_paged_decode`. The decode kernel soft-caps scores
itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.model.layers.attention.base import AttentionInputs, AttentionMetadata
from tokenmill.model.layers.attention.torch_backend import TorchAttentionBackend, windowed_paged_decode
from tokenmill.model.layers.paged_tables import padded_block_table

# Prefill chunks of fewer queries than this go through the C++ float32 prefill kernel, longer ones through
# SDPA: the kernel skips the key tiles a causal query cannot see and reads the cache in place, which wins on
# short and medium chunks; on chunks of about a thousand tokens SDPA's large tiles through MKL's GEMM catch
# up and then outrun it (the README and docs/benchmarks.md have the measurements).
CPU_PREFILL_KERNEL_MAX_TOKENS = 768

_PRODUCTS = {"amx": "AMX bfloat16 tiles", "avx512_bf16": "AVX-512 BF16 dot products"}


@dataclass
class CpuPrefillTables:
    """Prefill chunks the C++ kernel attends (`kernel_chunks`, indices into the metadata's lists) as its int32
    inputs; the other chunks (`torch_chunks`) take the torch path."""

    kernel_chunks: list[int]
    torch_chunks: list[int]
    block_table: torch.Tensor  # [len(kernel_chunks), max_blocks] int32, padded with 0
    query_ranges: torch.Tensor  # [len(kernel_chunks), 2] int32: each chunk's [start, end) rows in the batch
    context_lens: torch.Tensor  # [len(kernel_chunks)] int32


def cpu_prefill_tables(query_ranges: list[tuple[int, int]], context_lens: list[int], block_ids: list[torch.Tensor],
                       max_tokens: Optional[int]) -> CpuPrefillTables:
    """Splits prefill chunks between the C++ kernel (those under max_tokens; all of them when None) and SDPA
    and packs the kernel's inputs."""
    kernel = [i for i, (start, end) in enumerate(query_ranges) if max_tokens is None or end - start < max_tokens]
    others = [i for i, (start, end) in enumerate(query_ranges) if max_tokens is not None and end - start >= max_tokens]
    table = padded_block_table([block_ids[i] for i in kernel], torch.device("cpu"))
    return CpuPrefillTables(kernel, others, table,
                            torch.tensor([query_ranges[i] for i in kernel], dtype=torch.int32).view(-1, 2),
                            torch.tensor([context_lens[i] for i in kernel], dtype=torch.int32))


@dataclass
class CpuAttentionMetadata(AttentionMetadata):
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    # Each decode row as a one-token chunk, [num_decodes, 2] int32: windowed decodes through the prefill kernel.
    decode_ranges: torch.Tensor
    prefill_all: CpuPrefillTables  # every chunk to the kernel (the bfloat16 kernel's tables)
    prefill_split: CpuPrefillTables  # long chunks to SDPA (the float32 kernel's; prefill_all when none is long)


class CpuPagedAttentionBackend(TorchAttentionBackend):
    """Decodes and prefill chunks through the C++ paged kernels, which read the cache in place through the block
    tables; KV writes and long float32 prefill chunks as the torch backend.

    kernels: tokenmill's compiled C++ CPU kernels; cache_dtype: the KV cache's; bf16_block_matmul: the
    projections multiply prefill-sized steps in bfloat16 (`--block-matmul bfloat16` / `bfloat16-int8`), so
    prefill attention takes bfloat16 products over any cache dtype, where the CPU has them."""

    name = "cpu"
    paged_decode = True

    def __init__(self, kernels, cache_dtype: torch.dtype = torch.float32, bf16_block_matmul: bool = False) -> None:
        self.kernels = kernels
        self.cache_dtype = cache_dtype
        # The bfloat16 prefill kernel runs where the CPU has AMX tiles or AVX-512 BF16 dot products; over a
        # bfloat16 cache, whose keys and values are bfloat16 already, it takes every chunk, with q rounded to
        # bfloat16 as the keys were (vLLM's precision; perplexity within its noise) and the probabilities
        # rounded, about twice the float32 kernel's speed (docs/benchmarks.md). Under the bfloat16 block matmuls it
        # does so over any cache, scores there from high and low bfloat16 parts of q and k (float32's precision).
        self.bf16_path = getattr(kernels, "bf16_attention_path", lambda: "")()
        # An int8 cache's rows are dequantized by the float32 kernels, which every chunk then takes.
        self.bf16_prefill = bool(self.bf16_path) and (bf16_block_matmul or cache_dtype == torch.bfloat16) and \
            cache_dtype != torch.int8
        # The decode kernel takes the same precision over a bfloat16 cache, and over an int8 one widened to
        # bfloat16, on AVX-512 BF16 dot products (the kernel's own choice; recorded here for describe()).
        self.bf16_decode = cache_dtype in (torch.bfloat16, torch.int8) and \
            getattr(kernels, "bf16_decode_attention_available", lambda: False)()

    def describe(self) -> str:
        if self.cache_dtype == torch.int8:
            decode = "AVX-512 BF16 dot products (rows widened to bfloat16)" if self.bf16_decode else "float32"
            return (f"cpu (over the int8 cache, rows dequantized as they are read: decode attention on {decode}, "
                    f"prefill in float32, SDPA for chunks of {CPU_PREFILL_KERNEL_MAX_TOKENS} tokens and more)")
        products, decode_products = _PRODUCTS.get(self.bf16_path, self.bf16_path), _PRODUCTS["avx512_bf16"]
        if self.bf16_prefill:
            attention = f"prefill attention on {products}"
        else:
            attention = (f"prefill attention in float32 (C++ kernel below {CPU_PREFILL_KERNEL_MAX_TOKENS} tokens, "
                         "SDPA above)")
        if self.bf16_decode and self.bf16_prefill and products == decode_products:
            attention = f"prefill and decode attention on {products}"
        elif self.bf16_decode:
            attention += f" and decode attention on {decode_products}"
        bf16_cache = self.cache_dtype == torch.bfloat16 and (self.bf16_prefill or self.bf16_decode)
        return f"cpu ({attention}{' over the bfloat16 cache' if bf16_cache else ''})"

    def prepare_metadata(self, inputs: AttentionInputs) -> CpuAttentionMetadata:
        common = AttentionMetadata.common_fields(inputs)
        ranges, lens, ids = inputs.prefill_query_ranges, inputs.prefill_context_lens, common["prefill_block_ids"]
        every = cpu_prefill_tables(ranges, lens, ids, None)
        long_chunks = any(end - start >= CPU_PREFILL_KERNEL_MAX_TOKENS for start, end in ranges)
        rows = torch.arange(inputs.num_decodes, dtype=torch.int32)
        return CpuAttentionMetadata(
            **common, decode_block_tables=torch.from_numpy(inputs.decode_block_table),
            decode_context_lens=torch.from_numpy(inputs.decode_context_lens),
            decode_ranges=torch.stack((rows, rows + 1), dim=1),
            prefill_all=every,
            prefill_split=(cpu_prefill_tables(ranges, lens, ids, CPU_PREFILL_KERNEL_MAX_TOKENS) if long_chunks
                           else every))

    def _prefill_tables(self, meta: CpuAttentionMetadata, head_dim: int,
                        softcap: float | None) -> tuple[CpuPrefillTables, bool]:
        """Where a layer's prefill chunks go: (their tables, whether the bfloat16 kernel takes the tables' kernel
        chunks); the float32 kernel's tables send long chunks to SDPA (torch_chunks)."""
        bf16 = self.bf16_prefill and not softcap and head_dim % 32 == 0
        return (meta.prefill_all if bf16 else meta.prefill_split), bf16

    @staticmethod
    def _prefill_kernel_fits(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether paged_prefill_attention takes these tensors: the query in the cache's dtype, float32 over a
        16-bit cache or any float query over an int8 cache, blocks of a multiple of 8 tokens, heads contiguous, a
        contiguous output."""
        dtypes_fit = q.dtype == kv_cache.dtype or kv_cache.dtype == torch.int8 or (
            q.dtype == torch.float32 and kv_cache.dtype in (torch.float16, torch.bfloat16))
        return dtypes_fit and kv_cache.shape[2] % 8 == 0 and q.stride(-1) == 1 and q.stride(1) == q.shape[2] \
            and out.is_contiguous()

    def prefill_into(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: CpuAttentionMetadata,
                     scale: float, window: int | None = None, softcap: float | None = None) -> None:
        if not meta.prefill_query_ranges:
            return
        if not self._prefill_kernel_fits(out, q, kv_cache):
            super().prefill_into(out, q, kv_cache, meta, scale, window, softcap)
            return
        tables, bf16 = self._prefill_tables(meta, q.shape[-1], softcap)
        if tables.kernel_chunks and bf16:
            self.kernels.paged_prefill_attention_bf16(q, kv_cache, tables.block_table, tables.query_ranges,
                                                      tables.context_lens, scale, window or 0, out)
        elif tables.kernel_chunks:
            self.kernels.paged_prefill_attention(q, kv_cache, tables.block_table, tables.query_ranges,
                                                 tables.context_lens, scale, softcap or 0.0, window or 0, out)
        for chunk in tables.torch_chunks:
            self._prefill_chunk_into(out, q, kv_cache, meta, chunk, scale, window, softcap)

    def stack_prefill_tables(self, meta: CpuAttentionMetadata, head_dim: int,
                             softcap: float | None) -> Optional[tuple[CpuPrefillTables, bool]]:
        """For the fused decoder stack (`decoder_decode_int8`): the step's prefill chunks as prefill_into sends them,
        (tables, whether the bfloat16 kernel takes them), when every chunk takes a C++ kernel; None when some
        chunk goes to SDPA (a float32 chunk of CPU_PREFILL_KERNEL_MAX_TOKENS or more), which the stack does not
        run."""
        tables, bf16 = self._prefill_tables(meta, head_dim, softcap)
        return None if tables.torch_chunks else (tables, bf16)

    def decode_into(self, out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, meta: CpuAttentionMetadata,
                    scale: float, window: int | None = None, softcap: float | None = None) -> None:
        # The C++ decode kernel attends a whole context: a windowed layer uses it while the decode table's width
        # (the longest context, rounded up to whole blocks) fits in the window, and the prefill kernel beyond.
        windowed = window is not None and meta.num_decodes and \
            meta.decode_block_tables.shape[1] * kv_cache.shape[2] > window
        if windowed and self._prefill_kernel_fits(out, q, kv_cache):
            # The prefill kernel takes a window: each decode row is a one-token chunk at the end of its context,
            # and only the key tiles its window reaches are read.
            self.kernels.paged_prefill_attention(q, kv_cache, meta.decode_block_tables, meta.decode_ranges,
                                                 meta.decode_context_lens, scale, softcap or 0.0, window, out)
        elif windowed:
            out[:meta.num_decodes] = windowed_paged_decode(q[:meta.num_decodes], kv_cache, meta.decode_block_tables,
                                                           meta.decode_context_lens, scale, window, softcap)
        elif meta.num_decodes:
            # The kernel reads a 16-bit cache under a float32 query, and an int8 cache under any query, directly;
            # other mixes meet in the cache's dtype.
            mixed = (q.dtype == torch.float32 and kv_cache.dtype in (torch.float16, torch.bfloat16)) or \
                kv_cache.dtype == torch.int8
            query = q[:meta.num_decodes].to(q.dtype if mixed else kv_cache.dtype).contiguous()
            out[:meta.num_decodes] = self.kernels.paged_decode_attention(
                query, kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale, softcap or 0.0)
