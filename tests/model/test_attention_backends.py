"""The attention backends against a plain reference: softmax(q k^T * scale) v per request, with
GQA, contexts that end mid-block, scattered block tables, and decodes mixed with prefill chunks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from step_rows import Row, prepare_rows
from tokenmill.model.layers.attention import (
    AttentionInputs,
    CpuPagedAttentionBackend,
    TorchAttentionBackend,
    get_attention_backend,
    torch_backend,
)
from tokenmill.model.layers.attention.torch_backend import chunk_after_prefix_attention

BLOCK = 4


def reference(q, keys, values, scale, causal_offset=None, softcap=None):
    """q [n, Hq, D], keys/values [ctx, Hkv, D]; query i sees keys < causal_offset + i + 1; scores capped
    as softcap * tanh(score / softcap) when softcap is given."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).float()
    v = values.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("nhd,thd->nht", q.float(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal_offset is not None:
        t = torch.arange(keys.shape[0])
        allowed = t[None, :] <= (causal_offset + torch.arange(q.shape[0]))[:, None]
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("nht,thd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 1, 24)])
def test_paged_decode_kernel_matches_reference(kernels, dtype, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    num_blocks = 64
    cache = torch.randn(2, num_blocks, BLOCK, num_kv_heads, head_dim, generator=gen).to(dtype)
    lengths = [1, 3, 4, 5, 17, 33]  # one token, mid-block ends, exact block multiples
    max_blocks = -(-max(lengths) // BLOCK)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
    used = 0
    for row, length in enumerate(lengths):
        n = -(-length // BLOCK)
        tables[row, :n] = perm[used:used + n].int()
        used += n
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(dtype)
    out = kernels.paged_decode_attention(q, cache, tables, torch.tensor(lengths, dtype=torch.int32), 0.3)
    for row, length in enumerate(lengths):
        blocks = tables[row, :-(-length // BLOCK)].long()
        keys = cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:length]
        values = cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:length]
        expected = reference(q[row:row + 1], keys, values, 0.3)[0]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[row].float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_paged_decode_kernel_gives_each_request_the_same_bits_in_any_batch(kernels, cache_dtype):
    """Enough requests that a work item is a whole request and threads take the longest first: every
    row equals the reference and, bit for bit, the same request decoded alone (block size 16, so
    keys are scored four at a time with one-at-a-time tails)."""
    gen = torch.Generator().manual_seed(3)
    block, num_heads, num_kv_heads, head_dim = 16, 9, 3, 64
    lengths = [5, 300, 17, 64, 1, 150, 33, 250, 90, 16, 47, 200]
    max_blocks = -(-max(lengths) // block)
    num_blocks = len(lengths) * max_blocks
    cache = torch.randn(2, num_blocks, block, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    tables = torch.randperm(num_blocks, generator=gen).int().view(len(lengths), max_blocks)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen)
    lens = torch.tensor(lengths, dtype=torch.int32)
    out = kernels.paged_decode_attention(q, cache, tables, lens, 0.125)
    for row, length in enumerate(lengths):
        alone = kernels.paged_decode_attention(q[row:row + 1].contiguous(), cache, tables[row:row + 1].contiguous(),
                                               lens[row:row + 1], 0.125)
        assert torch.equal(out[row], alone[0])
        blocks = tables[row, :-(-length // block)].long()
        keys = cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:length]
        values = cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:length]
        torch.testing.assert_close(out[row], reference(q[row:row + 1], keys, values, 0.125)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 1, 24), (16, 2, 128)])
def test_paged_decode_kernel_reads_a_16_bit_cache_as_its_float32_values(kernels, cache_dtype, num_heads,
                                                                        num_kv_heads, head_dim):
    """A float32 query over a float16/bfloat16 cache gives the same bits as over that cache widened to
    float32 (the kernel widens 8 values at a time, exactly), and the output stays float32. (Over a bfloat16 cache
    on CPUs with AVX-512 BF16 the kernel multiplies in bfloat16 products instead: test_bf16_attention.py.)"""
    if cache_dtype == torch.bfloat16 and head_dim % 32 == 0 and kernels.bf16_decode_attention_available():
        pytest.skip("bfloat16 products over a bfloat16 cache here (test_bf16_attention.py)")
    gen = torch.Generator().manual_seed(2)
    num_blocks = 48
    cache = torch.randn(2, num_blocks, BLOCK, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    lengths = [1, 2, 7, 16, 29]  # odd lengths leave a last token for the one-at-a-time path
    max_blocks = -(-max(lengths) // BLOCK)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lengths) * max_blocks].int().view(len(lengths), -1)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen)
    lens = torch.tensor(lengths, dtype=torch.int32)
    out = kernels.paged_decode_attention(q, cache, tables, lens, 0.2)
    assert out.dtype == torch.float32
    assert torch.equal(out, kernels.paged_decode_attention(q, cache.float(), tables, lens, 0.2))
    with pytest.raises(RuntimeError):  # a 16-bit query over a float32 cache is not a supported mix
        kernels.paged_decode_attention(q.to(cache_dtype), cache.float(), tables, lens, 0.2)


def _scheduled(rid: str, prompt_len: int, start: int, count: int, blocks: list[int]) -> Row:
    return Row(start, count, blocks)


def _model_inputs(items: list[Row], backend):
    return prepare_rows(items, BLOCK, torch.device("cpu"), backend)


@pytest.mark.skipif(torch_backend._FLASH_WITH_LSE is None, reason="this torch has no CPU flash kernel with log-sum-exp")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 1, 24)])
@pytest.mark.parametrize("prefix_len,num_q", [(1, 1), (1, 7), (37, 5), (300, 64), (64, 300)])
def test_chunk_after_prefix_matches_causal_reference(dtype, num_heads, num_kv_heads, head_dim, prefix_len, num_q):
    """A chunk's attention as prefix part + causal square merged by log-sum-exp equals one causal
    softmax over the whole context, with GQA and any prefix/chunk proportions."""
    gen = torch.Generator().manual_seed(prefix_len * 1000 + num_q)
    ctx = prefix_len + num_q
    q = torch.randn(num_q, num_heads, head_dim, generator=gen).to(dtype)
    keys = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
    values = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
    # The layouts _prefill passes: transposed views, not contiguous copies.
    out = chunk_after_prefix_attention(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                                       values.transpose(0, 1).unsqueeze(0), 0.3)
    assert out.shape == (1, num_heads, num_q, head_dim) and out.dtype == dtype
    expected = reference(q, keys, values, 0.3, causal_offset=prefix_len)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.squeeze(0).transpose(0, 1).float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_backends_agree_on_a_mixed_batch(kernels, backend_name, cache_dtype, chunk_path):
    """Two decodes and two prefill chunks (one continuing a cached prefix) in one flat batch, with
    float32 activations over a float32 or float16 cache; the continuing chunk both ways."""
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim, num_blocks = 6, 2, 8, 32
    cache = torch.randn(2, num_blocks, BLOCK, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    items = [
        _scheduled("d0", 10, 9, 1, [5, 9, 2]),  # decode at position 9: context 10
        _scheduled("p0", 7, 0, 7, [11, 12]),  # whole prompt
        _scheduled("d1", 3, 2, 1, [20]),  # decode at position 2: context 3
        _scheduled("p1", 12, 8, 4, [3, 4, 6]),  # chunk 8..11 after 8 cached tokens
    ]
    backend = get_attention_backend(torch.device("cpu"), backend_name)
    assert isinstance(backend, CpuPagedAttentionBackend if backend_name == "cpu" else TorchAttentionBackend)
    inputs, meta = _model_inputs(items, backend)
    num_tokens = inputs.input_ids.numel()
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    out = backend.forward(q, k, v, cache, meta, 0.5)
    assert out.dtype == torch.float32
    tol = 1e-5 if cache_dtype == torch.float32 else 2e-3

    flat = 0
    order = [2, 0, 1, 3]  # decodes first, shortest context first (d1, d0), then prefills in order
    for index in order:
        item = items[index]
        ctx = item.start_position + item.num_new_tokens
        slots = [item.block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)]
        keys = cache[0].reshape(-1, num_kv_heads, head_dim)[slots]
        values = cache[1].reshape(-1, num_kv_heads, head_dim)[slots]
        n = item.num_new_tokens
        expected = reference(q[flat:flat + n], keys, values, 0.5, causal_offset=item.start_position)
        torch.testing.assert_close(out[flat:flat + n], expected, atol=1e-5, rtol=1e-5)  # over the cached values
        # The new tokens' K/V were written to their slots (rounded to the cache's dtype) before attending.
        torch.testing.assert_close(keys[item.start_position:].float(), k[flat:flat + n], atol=tol, rtol=tol)
        assert torch.equal(keys[item.start_position:], k[flat:flat + n].to(cache_dtype))
        flat += n
        assert inputs.last_token_index[index] == flat - 1


@pytest.mark.parametrize("softcap", [None, 0.7])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_windowed_decodes_through_the_cpu_kernels_match_reference(kernels, cache_dtype, softcap):
    """Gemma 3's local layers: decodes whose contexts outrun the window (one-token chunks through the
    prefill kernel), one that does not, and a step whose contexts all fit (the whole-context kernel)."""
    gen = torch.Generator().manual_seed(3)
    block, num_heads, num_kv_heads, head_dim, window, scale = 16, 4, 1, 32, 20, 0.4
    cache = (torch.randn(2, 40, block, num_kv_heads, head_dim, generator=gen) * 2).to(cache_dtype)
    backend = CpuPagedAttentionBackend(kernels)
    for lengths in ([50, 7, 33, 20], [9, 16]):
        max_blocks = -(-max(lengths) // block)
        tables = torch.stack([torch.randperm(40, generator=gen)[:max_blocks] for _ in lengths]).to(torch.int32)
        meta = backend.prepare_metadata(AttentionInputs(
            slot_mapping=torch.zeros(len(lengths), dtype=torch.long), block_size=block, num_decodes=len(lengths),
            decode_block_table=tables.numpy(), decode_context_lens=np.array(lengths, dtype=np.int32)))
        q = torch.randn(len(lengths), num_heads, head_dim, generator=gen) * 2
        out = torch.full_like(q, float("nan"))
        backend.decode_into(out, q, cache, meta, scale, window, softcap)
        # Where the CPU has AVX-512 BF16 the whole-context kernel over a bfloat16 cache multiplies in bfloat16 (q *
        # scale rounded; the probabilities too: 2^-9 of the values, measured up to 6e-4); the prefill kernel in
        # float32.
        rounds = lengths == [9, 16] and cache_dtype == torch.bfloat16 and kernels.bf16_decode_attention_available()
        for row, length in enumerate(lengths):
            slots = [int(tables[row, p // block]) * block + p % block for p in range(max(0, length - window), length)]
            keys = cache[0].reshape(-1, num_kv_heads, head_dim)[slots]
            values = cache[1].reshape(-1, num_kv_heads, head_dim)[slots]
            if rounds:
                query = (q[row:row + 1] * scale).bfloat16().float()
                expected = reference(query, keys, values, 1.0, softcap=softcap)
                torch.testing.assert_close(out[row:row + 1], expected, atol=2e-3 * values.abs().max(), rtol=0)
            else:
                expected = reference(q[row:row + 1], keys, values, scale, softcap=softcap)
                torch.testing.assert_close(out[row:row + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5, 64])
@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_softcapped_attention_matches_reference(kernels, backend_name, window):
    """Gemma 2's score capping in every path of both backends: decodes (the C++ kernel, the torch
    buckets, windowed decodes), a whole prompt and a chunk after cached context, full and windowed.
    A window of 64 holds every context here: the cpu backend's windowed decodes then take the C++ kernel."""
    gen = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, head_dim, scale, cap = 6, 2, 8, 0.5, 0.7
    cache = torch.randn(2, 32, BLOCK, num_kv_heads, head_dim, generator=gen) * 2
    items = [_scheduled("d0", 10, 9, 1, [5, 9, 2]), _scheduled("p0", 7, 0, 7, [11, 12]),
             _scheduled("d1", 3, 2, 1, [20]), _scheduled("p1", 12, 8, 4, [3, 4, 6])]
    backend = get_attention_backend(torch.device("cpu"), backend_name)
    inputs, meta = _model_inputs(items, backend)
    num_tokens = inputs.input_ids.numel()
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen) * 2
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    out = backend.forward(q, k, v, cache, meta, scale, window=window, softcap=cap)
    flat = 0
    for index in [2, 0, 1, 3]:  # decodes first, shortest context first, then prefills in order
        item = items[index]
        ctx = item.start_position + item.num_new_tokens
        slots = [item.block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)]
        keys = cache[0].reshape(-1, num_kv_heads, head_dim)[slots]
        values = cache[1].reshape(-1, num_kv_heads, head_dim)[slots]
        for i in range(item.num_new_tokens):
            p = item.start_position + i  # the query's position: it sees keys (p - window, p]
            first = 0 if window is None else max(0, p - window + 1)
            expected = reference(q[flat:flat + 1], keys[first:p + 1], values[first:p + 1], scale, softcap=cap)
            torch.testing.assert_close(out[flat:flat + 1], expected, atol=1e-5, rtol=1e-5)
            flat += 1
