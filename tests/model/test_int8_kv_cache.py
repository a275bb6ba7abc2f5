"""The int8 KV cache (model/layers/kv_int8.py): its rows against the values they stand for, both writers (torch
and the C++ decoder stack's) storing the same bytes, and the decode and prefill kernels against a float64
reference over the dequantized rows, on every SIMD path the kernels have (variant fixture)."""
from __future__ import annotations

import pytest
import torch

from attention_reference import windowed_causal_reference
from tokenmill.model.layers.kv_int8 import (
    KV_INT8_GROUP,
    KV_INT8_SCALE_BYTES,
    cache_head_dim,
    dequantize_kv_rows,
    kv_row_width,
    kv_values,
    quantize_kv_rows,
)
from tokenmill.model.layers.kv_write import write_kv


def _int8_cache(gen, num_blocks, block_size, num_kv_heads, head_dim, spread=3.0):
    # Rows of very different magnitudes (each row has its own scale), one all-zero row.
    values = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    values *= spread ** torch.randn(2, num_blocks, block_size, num_kv_heads, 1, generator=gen)
    values[0, 0, 0, 0] = 0.0
    return quantize_kv_rows(values)


@pytest.mark.parametrize("head_dim", [48, 64, 256])
def test_rows_hold_each_value_within_half_a_step_of_its_groups_scale(head_dim):
    """Scales per 32 values (48: a last group of 16), rows of very different magnitudes, an all-zero row."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, head_dim, generator=gen) * 10.0 ** torch.randint(-2, 3, (64, 4, 1), generator=gen).float()
    x[0, 0] = 0.0
    x[1, 1] = torch.randn(head_dim, generator=gen)
    x[1, 1, 5] = 1000.0  # an outlier flattens only its own group
    groups = -(-head_dim // KV_INT8_GROUP)
    rows = quantize_kv_rows(x)
    width = head_dim + KV_INT8_SCALE_BYTES * groups
    assert rows.dtype == torch.int8 and rows.shape == (64, 4, width) and kv_row_width(head_dim, torch.int8) == width
    assert kv_row_width(head_dim, torch.bfloat16) == head_dim and cache_head_dim(rows) == head_dim
    scale = rows[..., head_dim:].contiguous().view(torch.float16).float()  # [64, 4, groups]
    padded = torch.nn.functional.pad(x, (0, groups * KV_INT8_GROUP - head_dim)).unflatten(-1, (groups, -1))
    # Each scale is its group's absmax / 127 rounded to float16, and a group's largest value lands on +-127 (or one
    # off where the scale's rounding went up).
    assert torch.equal(scale, (padded.abs().amax(-1) / 127).half().float())
    q = torch.nn.functional.pad(rows[..., :head_dim].float(), (0, groups * KV_INT8_GROUP - head_dim))
    assert int(q.unflatten(-1, (groups, -1)).abs().amax(-1)[1:].min()) >= 126 and int(q.abs().max()) <= 127
    back = dequantize_kv_rows(rows, torch.float64)
    assert back.shape == x.shape
    step = scale.repeat_interleave(KV_INT8_GROUP, dim=-1)[..., :head_dim].double()
    assert bool(((back - x.double()).abs() <= step / 2 * (1 + 1e-6)).all())
    assert torch.equal(back[0, 0], torch.zeros(head_dim, dtype=torch.float64))  # a zero row: scales 0, values 0
    assert float((back[1, 1, 32:] - x[1, 1, 32:].double()).abs().max()) < 0.03  # 1000 / 254 in its own group only
    torch.testing.assert_close(kv_values(rows, torch.float32), back.float())
    assert torch.equal(kv_values(x.bfloat16(), torch.float32), x.bfloat16().float())  # a float cache: converted


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float32, torch.float16, torch.bfloat16])
def test_the_stack_writer_stores_the_torch_writers_bytes(kernels, cache_dtype):
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim, block, num_blocks = 6, 2, 40, 8, 5
    qkv = torch.randn(7, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 4
    qkv[3, num_heads * head_dim:] = 0.0  # a token whose K and V rows are all zero
    slots = torch.randperm(num_blocks * block, generator=gen)[:7]
    row = kv_row_width(head_dim, cache_dtype)
    by_torch = torch.zeros(2, num_blocks, block, num_kv_heads, row, dtype=cache_dtype)
    by_stack = torch.zeros_like(by_torch)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    k = qkv[:, q_size:q_size + kv_size].reshape(7, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].reshape(7, num_kv_heads, head_dim)
    write_kv(by_torch, k, v, slots)
    kernels.write_kv_cache(qkv, q_size, kv_size, by_stack, slots)
    assert torch.equal(by_torch.view(torch.uint8), by_stack.view(torch.uint8))
    assert bool(by_torch.view(torch.uint8).any())


def _tables(gen, lengths, block, num_blocks):
    max_blocks = -(-max(lengths) // block)
    return torch.randperm(num_blocks, generator=gen)[:len(lengths) * max_blocks].int().view(len(lengths), max_blocks)


def _context(values, table, length, block):
    """[2, length, Hkv, D] of one request's context through its block table."""
    blocks = table[:-(-length // block)].long()
    return values[:, blocks].flatten(1, 2)[:, :length]


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block", [(9, 3, 64, 4), (8, 1, 24, 8), (16, 2, 128, 16),
                                                                 (4, 2, 80, 16)])
def test_decode_kernel_over_an_int8_cache_matches_a_float64_reference(variant, query_dtype, num_heads, num_kv_heads,
                                                                      head_dim, block):
    """Contexts of one token, mid-block ends and whole blocks, enough requests for both work splits (a request per
    item, a (request, head) pair per item); head_dim 24 takes the scalar loops, 80 ends in a group of 16."""
    name, module = variant
    gen = torch.Generator().manual_seed(2)
    lengths = [1, 3, 4, 5, 17, 33, 70, 9, 2, 40]
    num_blocks = 256
    cache = _int8_cache(gen, num_blocks, block, num_kv_heads, head_dim)
    exact = dequantize_kv_rows(cache, torch.float64)
    tables = _tables(gen, lengths, block, num_blocks)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen).to(query_dtype)
    out = module.paged_decode_attention(q, cache, tables, torch.tensor(lengths, dtype=torch.int32), 0.3)
    assert out.dtype == query_dtype
    # Where the CPU has AVX-512 BF16 (and head_dim is a multiple of 32) the rows are dequantized to bfloat16 and
    # multiplied in bfloat16 products, q * scale rounded, as over a bfloat16 cache (test_bf16_attention.py).
    products_bf16 = head_dim % 32 == 0 and module.bf16_decode_attention_available()
    for row, length in enumerate(lengths):
        keys, values = _context(exact, tables[row], length, block)
        query, scale = q[row:row + 1].double(), 0.3
        if products_bf16:
            query, scale = (query * scale).bfloat16().double(), 1.0
            keys, values = keys.bfloat16().double(), values.bfloat16().double()
        expected = windowed_causal_reference(query, keys, values, scale, length - 1, dtype=torch.float64)[0]
        # float32 arithmetic over the stored values; a bfloat16 output rounds to 2^-8 of its magnitude; bfloat16
        # probabilities to 2^-9 of the values.
        tol = 1e-2 if query_dtype == torch.bfloat16 else 4e-3 if products_bf16 else 2e-5
        torch.testing.assert_close(out[row].double(), expected, atol=tol * values.abs().max(), rtol=tol)


@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block", [(4, 4, 16, 16), (9, 3, 64, 8), (16, 2, 128, 16)])
def test_prefill_kernel_over_an_int8_cache_matches_a_float64_reference(variant, window, num_heads, num_kv_heads,
                                                                       head_dim, block):
    """Two chunks in one call, one a whole prompt and one after cached context, full and windowed."""
    name, module = variant
    gen = torch.Generator().manual_seed(3)
    num_blocks = 64
    cache = _int8_cache(gen, num_blocks, block, num_kv_heads, head_dim)
    exact = dequantize_kv_rows(cache, torch.float64)
    chunks = [(0, 21, 21), (21, 41, 57)]  # [start, end) rows of the batch, context length
    tables = _tables(gen, [21, 57], block, num_blocks)
    q = torch.randn(41, num_heads, head_dim, generator=gen)
    out = torch.full_like(q, float("nan"))
    module.paged_prefill_attention(q, cache, tables, torch.tensor([c[:2] for c in chunks], dtype=torch.int32),
                                   torch.tensor([c[2] for c in chunks], dtype=torch.int32), 0.3, 0.0, window, out)
    for (start, end, ctx), table in zip(chunks, tables):
        keys, values = _context(exact, table, ctx, block)
        expected = windowed_causal_reference(q[start:end].double(), keys, values, 0.3, ctx - (end - start),
                                             window=window or None, dtype=torch.float64)
        torch.testing.assert_close(out[start:end].double(), expected, atol=2e-5 * values.abs().max(), rtol=2e-5)


def test_kernels_refuse_an_int8_cache_without_room_for_its_scales(kernels):
    gen = torch.Generator().manual_seed(4)
    cache = torch.zeros(2, 4, 8, 2, 66, dtype=torch.int8)  # rows with one scale where 64 values need two
    q = torch.randn(1, 4, 64, generator=gen)
    with pytest.raises(RuntimeError, match="head shapes"):
        kernels.paged_decode_attention(q, cache, torch.zeros(1, 1, dtype=torch.int32),
                                       torch.ones(1, dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="reads a float32, float16 or bfloat16 cache|needs a build"):
        good = torch.zeros(2, 4, 8, 2, 68, dtype=torch.int8)
        kernels.paged_prefill_attention_bf16(q, good, torch.zeros(1, 1, dtype=torch.int32),
                                             torch.tensor([[0, 1]], dtype=torch.int32),
                                             torch.ones(1, dtype=torch.int32),
                                             0.1, 0, torch.empty_like(q))
