"""Triton kernels for paged attention: decodes with split-K, prefill chunks with causal masking.

Imported only by `triton_backend.py` once the triton backend is chosen, so tokenmill imports
without triton. Whether kernels compile for the GPU or run in Triton's interpreter is fixed when this
module is imported (TRITON_INTERPRET=1 before the import: the interpreter, which takes CPU tensors).

Both kernels read K/V straight from the paged cache `[2, num_blocks, block_size, Hkv, D]`: key
position t of a request lives in block `table[t // block_size]` at offset `t % block_size`, looked up
per key, so any block size works. The `group` query heads that share a KV head are the rows of one
program's query tile, so each KV head's keys and values are read once for all of them (no
repeat_interleave):

    query tile rows (decode):   h0 h1 h2 h3 -- --  ... (padded to GROUP_P >= 16 for tl.dot)
    query tile rows (prefill):  t0h0 t0h1 t0h2 t0h3 t1h0 t1h1 ...  (BLOCK_Q tokens x GROUP_P heads)

Scores are float32 and the softmax is online (running max m, running sum l, rescaled accumulator),
flash-attention style. A decode's keys can be split over several programs ("split-K") whose partial
results carry their log-sum-exp; `_merge_splits` combines them:

    out = sum_s exp(lse_s - M) * out_s / sum_s exp(lse_s - M),   M = max_s lse_s
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

try:  # what triton.jit below decided
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # triton < 3.4 has no knobs and reads the variable as exactly "1"
    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _tanh(x):
    # tl has no tanh in every version the interpreter runs; this form never overflows.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # float32 operands stay float32 (no TF32), to match the torch reference's precision.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v, COMPUTE: tl.constexpr, IEEE: tl.constexpr):
    """One key tile: s [M, N] float32 scores (-inf where hidden), v [N, D]; returns the new m, l, acc.

    A row that has seen only hidden keys keeps m = -inf; subtracting 0 instead keeps exp() at 0, not nan.
    """
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(COMPUTE), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def paged_decode_kernel(
    q_ptr, k_cache, v_cache, block_tables, context_lens, out_ptr, part_out, part_lse,
    scale, softcap, window, block_size, split_tokens,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS_P: tl.constexpr, DIRECT: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, COMPUTE: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (row, kv_head, split): the row's query heads of this KV head over keys
    [base + split * split_tokens, base + (split + 1) * split_tokens) of its context, where base is 0 or,
    with a window, the window's first key (the row's query is its last key).

    DIRECT (one split): writes the normalized output. Otherwise writes the split's normalized partial
    output to part_out [rows, Hq, NUM_SPLITS_P, D] and its log-sum-exp to part_lse [rows, Hq, NUM_SPLITS_P]
    (-inf for a split past the context).
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens + row)
    base = 0
    if HAS_WINDOW:
        # The query at ctx - 1 sees keys (ctx - 1 - window, ctx - 1]: the splits divide those.
        base = tl.maximum(ctx - window, 0)
    lo = base + split * split_tokens
    hi = tl.minimum(lo + split_tokens, ctx)

    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_DIM_P)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE)

    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
    table = block_tables + row * stride_bt
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        visible = pos < hi
        block = tl.load(table + pos // block_size, mask=visible, other=0).to(tl.int64)
        offs = block * stride_kb + (pos % block_size) * stride_kt + kv_head * stride_kh
        kv_mask = visible[:, None] & d_ok[None, :]
        k = tl.load(k_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(COMPUTE)
        v = tl.load(v_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(COMPUTE)
        s = _dot(q, tl.trans(k), IEEE) * scale
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(visible[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, COMPUTE, IEEE)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DIRECT:
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :], out,
                 mask=head_ok[:, None] & d_ok[None, :])
    else:
        num_heads = tl.num_programs(1) * GROUP
        base = (row * num_heads + heads) * NUM_SPLITS_P + split  # [GROUP_P]
        tl.store(part_out + base[:, None] * HEAD_DIM_P + d[None, :], out, mask=head_ok[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse + base, lse, mask=head_ok)


@triton.jit
def merge_splits_kernel(
    part_out, part_lse, out_ptr, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SPLITS_P: tl.constexpr,
):
    """Program (row, head): the splits' partial outputs weighted by their share of the softmax mass."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    base = (row * tl.num_programs(1) + head) * NUM_SPLITS_P
    s = tl.arange(0, NUM_SPLITS_P)
    d = tl.arange(0, HEAD_DIM_P)
    lse = tl.load(part_lse + base + s, mask=s < num_splits, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, axis=0))  # split 0 always holds keys, so the max is finite
    parts = tl.load(part_out + (base + s)[:, None] * HEAD_DIM_P + d[None, :], mask=(s < num_splits)[:, None],
                    other=0.0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out, mask=d < HEAD_DIM)


@triton.jit
def paged_prefill_kernel(
    q_ptr, k_cache, v_cache, block_tables, query_starts, context_lens, tile_requests, tile_offsets, out_ptr,
    scale, softcap, window, block_size,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    COMPUTE: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (tile, kv_head): BLOCK_Q queries of one prefill chunk, tile_offsets[tile] onward.

    A chunk of n queries ends its request's context of ctx keys (cached context, then the chunk), so
    query i sits at position p = ctx - n + i and sees keys k <= p (and k > p - window):

        keys:     0 ........ ctx-n-1 | ctx-n ....... ctx-1
        query i:  all visible        | causal: k <= ctx-n+i
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_requests + tile)
    tile_start = tl.load(tile_offsets + tile)
    q_start = tl.load(query_starts + req)
    n = tl.load(query_starts + req + 1) - q_start
    ctx = tl.load(context_lens + req)

    r = tl.arange(0, BLOCK_Q * GROUP_P)
    qi = tile_start + r // GROUP_P
    g = r % GROUP_P
    heads = kv_head * GROUP + g
    row_ok = (qi < n) & (g < GROUP)
    pos = ctx - n + qi
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM
    q_offs = (q_start + qi)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE)

    # Keys up to the tile's last query; with a window, from the tile holding its first query's first key.
    hi = ctx - n + tl.minimum(tile_start + BLOCK_Q, n)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - n + tile_start - window + 1, 0) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM_P], tl.float32)
    table = block_tables + req * stride_bt
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        in_ctx = kpos < hi
        block = tl.load(table + kpos // block_size, mask=in_ctx, other=0).to(tl.int64)
        offs = block * stride_kb + (kpos % block_size) * stride_kt + kv_head * stride_kh
        kv_mask = in_ctx[:, None] & d_ok[None, :]
        k = tl.load(k_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(COMPUTE)
        v = tl.load(v_cache + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(COMPUTE)
        s = _dot(q, tl.trans(k), IEEE) * scale
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        visible = (kpos[None, :] <= pos[:, None]) & in_ctx[None, :]
        if HAS_WINDOW:
            visible = visible & (kpos[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v, COMPUTE, IEEE)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_offs = (q_start + qi)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, out, mask=row_ok[:, None] & d_ok[None, :])
