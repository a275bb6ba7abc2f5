"""Prefill attention in bfloat16 products, AMX-BF16 tiles or AVX-512 BF16 dot products where there is no AMX
(`--block-matmul bfloat16` / `bfloat16-int8`, and every bfloat16 KV cache): paged_prefill_attention_bf16
(scores from high and low bfloat16 parts of q and k over a float32 or float16 cache, from q rounded once over a
bfloat16 one; v and the probabilities rounded to bfloat16) against a float64 attention, over chunks with cached
prefixes, sliding windows, every cache dtype and several head shapes; the decode kernel's bfloat16 products over
a bfloat16 cache (AVX-512 BF16); and the engine routing SmolLM2's prefill through it."""
from __future__ import annotations

import math

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.model.layers.linear import Bf16TileInt8RowKernels


@pytest.fixture(scope="module")
def bf16_attention(kernels):
    if not kernels.bf16_attention_available():
        pytest.skip("no AMX-BF16 tiles or AVX-512 BF16 on this CPU (or this build)")
    return kernels


def reference(q, kv, tables, ranges, lens, scale, window, rounded=(), softcap=0.0):
    """float64 causal attention per chunk over its gathered context, with the inputs named in `rounded`
    ("q" for q * scale, "k", "v") rounded to bfloat16 first; scores soft-capped where softcap > 0."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    head_dim, block_size, num_kv_heads = q.shape[2], kv.shape[2], kv.shape[3]
    group = q.shape[1] // num_kv_heads
    for c, length in enumerate(lens.tolist()):
        start, end = ranges[c].tolist()
        ids = tables[c][:-(-length // block_size)].long()
        keys = kv[0][ids].reshape(-1, num_kv_heads, head_dim)[:length].float()
        values = kv[1][ids].reshape(-1, num_kv_heads, head_dim)[:length].float()
        query = q[start:end].float() * scale
        keys = keys.bfloat16().float() if "k" in rounded else keys
        values = values.bfloat16().float() if "v" in rounded else values
        query = query.bfloat16().float() if "q" in rounded else query
        keys = keys.double().repeat_interleave(group, 1)
        values = values.double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", query.double(), keys)
        scores = torch.tanh(scores / softcap) * softcap if softcap else scores
        pos = torch.arange(length - (end - start), length)[:, None]
        key = torch.arange(length)[None]
        visible = (key <= pos) & ((key > pos - window) if window else True)
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, -math.inf).softmax(-1), values)
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 256), (4, 4, 32)])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [0, 40])
def test_bf16_prefill_attention_matches_float64(bf16_attention, heads, kv_heads, head_dim,
                                                              cache_dtype, window):
    gen = torch.Generator().manual_seed(heads * head_dim + window)
    block_size = 16
    chunks = [(70, 70), (33, 200), (1, 45), (130, 130), (17, 17)]  # (queries, context): prefixes, tails, one token
    num_blocks = sum(-(-length // block_size) for _, length in chunks) + 3
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    perm = torch.randperm(num_blocks, generator=gen).int()
    tables = torch.zeros(len(chunks), max(-(-length // block_size) for _, length in chunks), dtype=torch.int32)
    used, starts = 0, [0]
    for c, (num_q, length) in enumerate(chunks):
        n = -(-length // block_size)
        tables[c, :n] = perm[used:used + n]
        used += n
        starts.append(starts[-1] + num_q + 2)  # two rows between chunks that the kernel must not write
    q = torch.randn(starts[-1], heads, head_dim, generator=gen) * 2
    ranges = torch.tensor([[starts[c], starts[c] + num_q] for c, (num_q, _) in enumerate(chunks)], dtype=torch.int32)
    lens = torch.tensor([length for _, length in chunks], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    bf16_attention.paged_prefill_attention_bf16(q, kv, tables, ranges, lens, scale, window, out)
    rows = torch.cat([torch.arange(start, end) for start, end in ranges.tolist()])
    gaps = torch.ones(q.shape[0], dtype=torch.bool)
    gaps[rows] = False
    assert out[gaps].isnan().all()  # rows outside the chunks untouched
    # Over a bfloat16 cache q * scale is rounded to bfloat16 once, like the keys it meets; over the others q and k
    # keep a low part, for scores of about float32's precision.
    rounded = ("q", "v") if cache_dtype == torch.bfloat16 else ("v",)
    expected = reference(q, kv, tables, ranges, lens, scale, window, rounded=rounded)[rows]
    err = (out[rows].double() - expected).abs().max().item()
    # The probabilities' bfloat16 rounding (2^-9 relative) leaves ~3e-3 on outputs of unit values; rounding q
    # (or, over the wider caches, q and k) once more or less moves them ~1e-2 (the softmax amplifies its error).
    assert err < 6e-3, err
    other = ("v",) if cache_dtype == torch.bfloat16 else ("q", "k", "v")
    assert (reference(q, kv, tables, ranges, lens, scale, window, rounded=other)[rows] - expected).abs().max() > 2 * err


def test_bf16_prefill_attention_refuses_what_it_cannot_run(bf16_attention):
    kv = torch.zeros(2, 2, 16, 1, 48)
    q = torch.zeros(4, 2, 48)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        bf16_attention.paged_prefill_attention_bf16(q, kv, torch.zeros(1, 2, dtype=torch.int32),
                                                    torch.tensor([[0, 4]], dtype=torch.int32),
                                                    torch.tensor([4], dtype=torch.int32), 1.0, 0, torch.empty_like(q))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 256), (16, 2, 128)])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,softcap", [(16, 0.0), (5, 0.0), (16, 8.0)])
def test_bf16_decode_attention_matches_float64(kernels, heads, kv_heads, head_dim, q_dtype, block_size, softcap):
    """paged_decode_attention over a bfloat16 cache, where the CPU has AVX-512 BF16: q * scale rounded to bfloat16
    once as the bfloat16 prefill kernel rounds it, the probabilities rounded for P V. Contexts of 1 to 301 tokens
    (ends mid-block, mid-way through 16 keys, odd lengths whose last token has no partner; blocks of 5 put a
    pair's tokens in different blocks), a bfloat16 query (a bfloat16 model) too, soft-capped scores."""
    if not kernels.bf16_decode_attention_available():
        pytest.skip("no AVX-512 BF16 on this CPU (or this build)")
    gen = torch.Generator().manual_seed(heads * head_dim + block_size)
    lengths = [1, 2, 15, 16, 17, 33, 100, 301]
    max_blocks = -(-max(lengths) // block_size)
    num_blocks = len(lengths) * max_blocks + 3
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lengths) * max_blocks].int().view(len(lengths), -1)
    q = (torch.randn(len(lengths), heads, head_dim, generator=gen) * 4).to(q_dtype)
    lens = torch.tensor(lengths, dtype=torch.int32)
    scale = head_dim ** -0.5
    out = kernels.paged_decode_attention(q, kv, tables, lens, scale, softcap)
    assert out.dtype == q_dtype
    # A request alone (a work item per KV head) gets the bits it gets in the batch (a work item per request).
    for row in (0, 5, 7):
        alone = kernels.paged_decode_attention(q[row:row + 1].contiguous(), kv, tables[row:row + 1].contiguous(),
                                               lens[row:row + 1], scale, softcap)
        assert torch.equal(out[row], alone[0])
    rows = torch.arange(len(lengths), dtype=torch.int32)
    ranges = torch.stack((rows, rows + 1), dim=1)  # each request's token as a one-query chunk at its context's end
    expected = reference(q, kv, tables, ranges, lens, scale, 0, rounded=("q",), softcap=softcap)
    err = (out.double() - expected).abs().max().item()
    # The probabilities' rounding leaves up to ~3e-3 on these outputs, the bfloat16 output's own rounding up to
    # ~9e-3 (measured); scores from the unrounded q move a float32 query's outputs 9e-3 to 2.4e-2. (A bfloat16 q
    # times these heads' scales, powers of two but for 128's, is exact in bfloat16 already.)
    if q_dtype == torch.bfloat16:
        assert err < 1.5e-2, err
    else:
        assert err < 5e-3, err
        unrounded = reference(q, kv, tables, ranges, lens, scale, 0, softcap=softcap)
        assert (unrounded - expected).abs().max() > 2 * err


class CountingKernels:
    def __init__(self, module) -> None:
        self._module = module
        self.bf16_calls = 0

    def paged_prefill_attention_bf16(self, *args):
        self.bf16_calls += 1
        return self._module.paged_prefill_attention_bf16(*args)

    def __getattr__(self, name):
        return getattr(self._module, name)


@pytest.mark.parametrize("block_matmul,kv_cache_dtype", [("bfloat16-int8", "float32"), ("float32", "bfloat16")])
def test_engine_prefills_smollm2_through_the_bf16_kernel(bf16_attention, smollm2_path, smollm2_tokenizer,
                                                        block_matmul, kv_cache_dtype):
    """Under bfloat16-int8 (any cache), and over a bfloat16 cache (the default on CPUs with native bfloat16),
    every prefill chunk (a long one too, which float32 sends to SDPA) takes the bfloat16 kernel; greedy tokens
    equal those of the same engine with float32 prefill attention but where that engine's top two were within
    0.2 (a near-tie the rounded probabilities may flip), and the first token's logprob moves by the rounding
    only (0.019 under bfloat16-int8, 0.002 under float32 matmuls, measured).

    The bfloat16 cache runs under float32 matmuls: under int8 ones (the default) each attention output's
    ~1e-3 rounding also flips some activations' own 8-bit rounding, and these prompts' first logprob then
    moves by up to ~0.3 whichever way the attention rounds (with float32 attention, 0.18 between a bfloat16 and
    a float32 cache)."""
    llm = LLM(str(smollm2_path), block_matmul=block_matmul, max_model_len=2048, num_kv_blocks=160,
              enable_prefix_caching=False, max_num_batched_tokens=1024, dtype="float32", kv_cache_dtype=kv_cache_dtype)
    runner = llm.llm_engine.core.core.runner
    backend = runner.attention_backend
    products = {"amx": "AMX bfloat16 tiles", "avx512_bf16": "AVX-512 BF16 dot products"}[
        bf16_attention.bf16_attention_path()]
    if block_matmul == "bfloat16-int8":
        if not isinstance(runner.block_kernels, Bf16TileInt8RowKernels):
            pytest.skip("bfloat16-int8 fell back on this CPU")
        assert backend.bf16_prefill and backend.describe() == f"cpu (prefill attention on {products})"
    else:
        assert backend.bf16_prefill
        assert backend.bf16_decode  # every CPU with these products has AVX-512 BF16
        attention = f"prefill and decode attention on {products}" if products.startswith("AVX") else \
            f"prefill attention on {products} and decode attention on AVX-512 BF16 dot products"
        assert backend.describe() == f"cpu ({attention} over the bfloat16 cache)"
    runner.model._int8_decode = None  # the layers call the backend (the fused stack calls the kernels itself)
    counting = backend.kernels = CountingKernels(backend.kernels)
    prompts = ["The history of the Roman Empire spans many centuries. " * 12,
               "Write a short poem about the sea, the wind and the light on the water. " * 2,
               "A list of prime numbers: " + ", ".join(str(p) for p in (2, 3, 5, 7, 11, 13, 17, 19, 23)) * 30]
    ids = [smollm2_tokenizer.encode(p) for p in prompts]
    assert max(len(i) for i in ids) >= 800  # a chunk float32 attention gives to SDPA
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run():
        return [out.outputs[0] for out in llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)]

    bf16 = run()
    assert counting.bf16_calls >= 30  # every layer of the prefill steps
    backend.bf16_prefill, counting.bf16_calls = False, 0
    float32 = run()
    assert counting.bf16_calls == 0
    moved = 0.0
    for a, b in zip(bf16, float32):
        first = b.token_ids[0]
        moved = max(moved, abs(a.logprobs[0][first].logprob - b.logprobs[0][first].logprob))
        if a.token_ids != b.token_ids:
            # Only a near-tie may flip: the bfloat16 run's token was the float32 run's runner-up, within 0.2.
            i = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            chosen = b.logprobs[i]
            assert a.token_ids[i] in chosen, (i, a.token_ids[i], chosen)
            assert chosen[b.token_ids[i]].logprob - chosen[a.token_ids[i]].logprob < 0.2
    assert 0.0 < moved < 0.1
