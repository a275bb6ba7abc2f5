"""The C++ paged prefill kernel (`paged_prefill_attention`) against a plain causal softmax: whole
prompts and chunks after cached context, GQA, windows, soft-capping, 16-bit caches, scattered blocks,
on every SIMD path; and the CPU backend's split between the kernel and SDPA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from attention_reference import windowed_causal_reference
from tokenmill.model.layers.attention import (
    AttentionInputs,
    AttentionMetadata,
    CpuPagedAttentionBackend,
    TorchAttentionBackend,
    cpu_backend,
)
from tokenmill.model.layers.attention.cpu_backend import cpu_prefill_tables


def make_step(chunks, num_heads, num_kv_heads, head_dim, block_size, cache_dtype, q_dtype, lead_rows=3, seed=0):
    """A flat batch of `lead_rows` decode rows then one prefill chunk per (ctx_len, num_q), each over a
    scattered block table; returns (q, cache, meta) with the fields every backend's metadata has."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per = [-(-ctx // block_size) for ctx, _ in chunks]
    num_blocks = sum(blocks_per) + 3
    cache = (torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 1.5).to(cache_dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    total = lead_rows + sum(n for _, n in chunks)
    q = (torch.randn(total, num_heads, head_dim, generator=gen) * 1.5).to(q_dtype)
    inputs = AttentionInputs(slot_mapping=torch.zeros(0, dtype=torch.long), block_size=block_size,
                             num_decodes=lead_rows, decode_block_table=np.zeros((lead_rows, 1), dtype=np.int32),
                             decode_context_lens=np.ones(lead_rows, dtype=np.int32))
    row, used = lead_rows, 0
    for (ctx, n), nb in zip(chunks, blocks_per):
        inputs.prefill_query_ranges.append((row, row + n))
        inputs.prefill_context_lens.append(ctx)
        inputs.prefill_block_ids.append(perm[used:used + nb].numpy().astype(np.int64))
        row += n
        used += nb
    return q, cache, AttentionMetadata(**AttentionMetadata.common_fields(inputs))


def kernel_tables(meta):
    return cpu_prefill_tables(meta.prefill_query_ranges, meta.prefill_context_lens, meta.prefill_block_ids,
                              cpu_backend.CPU_PREFILL_KERNEL_MAX_TOKENS)


def expected_rows(q, cache, meta, scale, window=None, softcap=None):
    block_size = cache.shape[2]
    out = []
    for (start, end), ctx, ids in zip(meta.prefill_query_ranges, meta.prefill_context_lens, meta.prefill_block_ids):
        slots = [int(ids[p // block_size]) * block_size + p % block_size for p in range(ctx)]
        keys = cache[0].reshape(-1, *cache.shape[3:])[slots]
        values = cache[1].reshape(-1, *cache.shape[3:])[slots]
        out.append(windowed_causal_reference(q[start:end], keys, values, scale, ctx - (end - start), window,
                                             softcap, dtype=torch.float64))
    return torch.cat(out)


def run_kernel(module, q, cache, meta, scale, window=None, softcap=None):
    tables = kernel_tables(meta)
    out = torch.full_like(q, 7.0)  # rows the kernel does not own must keep their values
    module.paged_prefill_attention(q, cache, tables.block_table, tables.query_ranges, tables.context_lens, scale,
                                   softcap or 0.0, window or 0, out)
    return out


CHUNKS = [(300, 300), (77, 77), (1000, 200), (33, 1), (16, 16), (40, 9)]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (8, 2, 80), (4, 1, 24)])
@pytest.mark.parametrize("block_size", [16, 8])
def test_kernel_matches_causal_reference(variant, num_heads, num_kv_heads, head_dim, block_size):
    """Whole prompts of 1..300 tokens and chunks after 20..800 cached tokens, contexts ending mid-block and
    mid-tile, GQA groups of 1, 3, 4 and 4 with head sizes that are and are not multiples of 16 or 64."""
    q, cache, meta = make_step(CHUNKS, num_heads, num_kv_heads, head_dim, block_size, torch.float32, torch.float32)
    out = run_kernel(variant[1], q, cache, meta, 0.3)
    assert torch.equal(out[:3], torch.full_like(out[:3], 7.0))
    torch.testing.assert_close(out[3:].double(), expected_rows(q, cache, meta, 0.3), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window,softcap", [(5, None), (64, None), (300, None), (None, 0.7), (17, 0.7)])
def test_kernel_windows_and_softcap(variant, window, softcap):
    """Sliding windows narrower than a key tile, a few tiles, or most of a prompt; Gemma 2's capping with
    and without one. Rows whose window starts past a whole tile must skip it, not add e^0 for it."""
    q, cache, meta = make_step(CHUNKS, 6, 2, 32, 16, torch.float32, torch.float32, seed=3)
    out = run_kernel(variant[1], q, cache, meta, 0.5, window, softcap)
    expected = expected_rows(q, cache, meta, 0.5, window, softcap)
    torch.testing.assert_close(out[3:].double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype,q_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
def test_kernel_reads_16_bit_caches_as_their_values(kernels, cache_dtype, q_dtype):
    q, cache, meta = make_step(CHUNKS[:4], 9, 3, 64, 16, cache_dtype, q_dtype, seed=1)
    out = run_kernel(kernels, q, cache, meta, 0.125)
    assert out.dtype == q_dtype
    # The reference over the cache's own values: only the output's rounding to a 16-bit query differs.
    tol = 1e-4 if q_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[3:].double(), expected_rows(q, cache, meta, 0.125), atol=tol, rtol=tol)


def test_kernel_refuses_what_it_cannot_read(kernels):
    q, cache, meta = make_step([(20, 20)], 4, 2, 16, 16, torch.float32, torch.float32)
    tables = kernel_tables(meta)
    args = (tables.block_table, tables.query_ranges, tables.context_lens, 0.5, 0.0, 0)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        odd = torch.zeros(2, 4, 12, 2, 16)
        kernels.paged_prefill_attention(q, odd, *args, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="query_ranges"):
        bad = torch.tensor([[3, 40]], dtype=torch.int32)  # past the query rows
        kernels.paged_prefill_attention(q, cache, tables.block_table, bad, tables.context_lens, 0.5, 0.0, 0,
                                        torch.empty_like(q))
    with pytest.raises(RuntimeError):  # a 16-bit query over a float32 cache is not a supported mix
        kernels.paged_prefill_attention(q.half(), cache, *args, torch.empty_like(q.half()))


def test_backend_routes_long_chunks_to_sdpa(kernels, monkeypatch):
    """The CPU backend sends chunks under CPU_PREFILL_KERNEL_MAX_TOKENS to the kernel and the rest (here
    the middle chunk) to the torch path, in one step; every row matches the torch backend."""
    monkeypatch.setattr(cpu_backend, "CPU_PREFILL_KERNEL_MAX_TOKENS", 100)
    q, cache, common = make_step([(90, 90), (500, 250), (130, 30)], 9, 3, 64, 16, torch.float32, torch.float32)
    tables = cpu_prefill_tables(common.prefill_query_ranges, common.prefill_context_lens, common.prefill_block_ids,
                                max_tokens=100)
    assert tables.kernel_chunks == [0, 2] and tables.torch_chunks == [1]
    calls = []
    backend = CpuPagedAttentionBackend(kernels)
    meta = backend.prepare_metadata(AttentionInputs(
        slot_mapping=common.slot_mapping, block_size=16, num_decodes=3,
        decode_block_table=np.zeros((3, 1), dtype=np.int32), decode_context_lens=np.ones(3, dtype=np.int32),
        prefill_query_ranges=common.prefill_query_ranges, prefill_context_lens=common.prefill_context_lens,
        prefill_block_ids=[ids.numpy() for ids in common.prefill_block_ids]))
    assert meta.prefill_split.kernel_chunks == [0, 2] and meta.prefill_all.kernel_chunks == [0, 1, 2]
    original = backend._prefill
    monkeypatch.setattr(backend, "_prefill",
                        lambda q_rows, *a, **k: calls.append(q_rows.shape[0]) or original(q_rows, *a, **k))
    out = torch.zeros_like(q)
    backend.prefill_into(out, q, cache, meta, 0.125)
    assert calls == [250]
    expected = torch.zeros_like(q)
    TorchAttentionBackend().prefill_into(expected, q, cache, common, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
