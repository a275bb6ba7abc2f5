"""`--block-matmul int8`: activations rounded to int8 per block of 32 inputs and integer dot products
with the kept blocks (`block_linear_q8`). Per GGUF block type and row count against a float64
computation of the same rounding; the AVX-512 VNNI and AVX2 kernels against the portable C++ loop, bit
for bit;
and the engine's greedy tokens against HF transformers whose linear layers round their inputs the
same way."""
from __future__ import annotations

import pytest
import torch
from test_block_kernels import ROWS, file_blocks
from test_gguf_int8 import PROMPTS, hf_on_file_weights

from model_factory import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.model.gguf_loader import INT8_BLOCK_TYPES
from tokenmill.model.layers.linear import BlockQuantLinear, Int8ActivationKernels, pack_blocks, packed_layout


def round_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, K] per block of 32: the int8 values (as float) and their scales max|x| / 127."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127 / amax by true division (torch's scalar / tensor multiplies by a reciprocal instead)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(blocks * inverse).clamp(-127, 127), amax / 127.0


def expected_q8(x: torch.Tensor, blocks, bias: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: integer dot products scaled by both scales, the min term on
    the unrounded block sums of x."""
    xq, xd = round_activations(x)
    w = blocks.q.double().reshape(blocks.q.shape[0], -1, 32)
    dots = torch.einsum("rbk,nbk->rnb", xq.double(), w)
    y = (dots * blocks.scales.double().unsqueeze(0) * xd.double().squeeze(-1).unsqueeze(1)).sum(-1)
    if blocks.mins is not None:
        y = y + x.double().reshape(x.shape[0], -1, 32).sum(-1) @ blocks.mins.double().T
    return y + bias.double()


@pytest.fixture(scope="module")
def int8_simd(kernels):
    """The native build where it takes integer dot products with SIMD (AVX-512 VNNI or AVX2)."""
    if kernels.int8_dot == "portable":
        pytest.skip("this CPU has neither AVX2 nor AVX-512 VNNI + VBMI")
    return kernels


@pytest.fixture(scope="module")
def vnni(kernels):
    if kernels.int8_dot != "avx512_vnni":
        pytest.skip("this CPU has no AVX-512 VNNI + VBMI")
    return kernels


@pytest.fixture(scope="module")
def portable_kernels():
    from tokenmill.model.layers import cpu_kernels

    portable = cpu_kernels.load_variant("portable")
    assert portable.int8_dot == "portable"
    return portable


def assert_same_bits(fast, portable, type_name, row_counts=(1, 5, 9, 70)):
    """Both kernels, on the rows layout (repacked per step) and on the dot layout (read in place), give the
    portable loop's bits on that layout; for the 32-value block types, whose scales the dot layout holds
    exactly in float16, the two layouts' bits are the same (K-quants' scales are rounded there)."""
    blocks, _ = file_blocks(type_name, seed=4)
    packed = pack_blocks(blocks)
    dot = pack_blocks(blocks, layout="dot")
    gen = torch.Generator().manual_seed(2)
    bias = torch.randn(37, generator=gen)
    for rows in row_counts:
        x = torch.randn(rows, blocks.q.shape[1], generator=gen)
        x[0, :32] = 0.0
        if rows > 1:
            x[1, 32:64] = x[1, 32:64].sign() * 3.0  # every value of a block rounds to +-127: the largest sums
        expected = portable.block_linear_q8(x, *packed, bias, 37)
        expected_dot = portable.block_linear_q8(x, *dot, bias, 37)
        if not type_name.endswith("_K"):
            assert torch.equal(expected_dot, expected), f"{type_name} rows={rows}: the layouts differ"
        for kernels, weights, want, what in ((fast, packed, expected, "rows"), (fast, dot, expected_dot, "dot")):
            assert torch.equal(kernels.block_linear_q8(x, *weights, bias, 37), want), \
                f"{type_name} rows={rows} {what} layout"


@pytest.mark.parametrize("type_name", sorted(INT8_BLOCK_TYPES))
def test_int8_dot_kernel_per_block_type(int8_simd, type_name):
    blocks, dense = file_blocks(type_name, seed=len(type_name) + 1)
    gen = torch.Generator().manual_seed(11)
    bias = torch.randn(37, generator=gen)
    packed = pack_blocks(blocks)
    for rows in ROWS:
        x = torch.randn(rows, dense.shape[1], generator=gen)
        x[0, :32] = 0.0  # an all-zero block: scale 0, no division by zero
        y = int8_simd.block_linear_q8(x, *packed, bias, 37)
        expected = expected_q8(x, blocks, bias)
        # float32 accumulation over the blocks: errors scale with the outputs' magnitude
        torch.testing.assert_close(y.double(), expected, atol=2e-6 * expected.abs().max().item(), rtol=1e-5,
                                   msg=f"{type_name} rows={rows}")
        # and it is a matmul with these weights: within the activations' rounding of the float product
        exact = x.double() @ dense.double().T + bias.double()
        assert (y.double() - exact).abs().max() < 0.02 * exact.abs().max()
        # a row's result does not depend on the rows around it
        assert torch.equal(y[-1:], int8_simd.block_linear_q8(x[-1:].contiguous(), *packed, bias, 37))


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_every_output_tile_is_computed_once_whatever_the_threads(kernels, threads):
    """The block kernels split their (row chunk, panel) items between the threads, a thread that finishes its
    share taking items from the back of another's: with more threads than cores (shares stolen from while
    their owners wait for a core) every output is still written, once, with the bits one thread gives. Each
    call gets its own input and every result stays alive, so no output can come from a reused buffer."""
    blocks, _ = file_blocks("Q4_1", out_features=16 * 23 + 5, seed=7)  # 24 panels, the last one partial
    dot, rows_layout = pack_blocks(blocks, layout="dot"), pack_blocks(blocks)
    gen = torch.Generator().manual_seed(threads)
    bias = torch.randn(blocks.q.shape[0], generator=gen)
    previous = torch.get_num_threads()
    kept = []
    try:
        for rows in (1, 8, 9, 70, 130):  # one to three row chunks; the float kernel's single-panel and pair paths
            x = torch.randn(rows, blocks.q.shape[1], generator=gen)
            for linear, weights in ((kernels.block_linear_q8, dot), (kernels.block_linear, rows_layout)):
                torch.set_num_threads(1)
                alone = linear(x, *weights, bias, blocks.q.shape[0])
                torch.set_num_threads(threads)
                split = linear(x, *weights, bias, blocks.q.shape[0])
                kept += [alone, split]
                assert torch.equal(split, alone), f"rows={rows} {linear.__name__}"
        # and what they agree on is the int8 product (the last input, through block_linear_q8)
        int8_alone = kept[-4]
        torch.testing.assert_close(int8_alone.double(), expected_q8(x, blocks, bias),
                                   atol=2e-6 * int8_alone.abs().max().item(), rtol=1e-5)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("type_name", sorted(INT8_BLOCK_TYPES))
def test_int8_layers_keep_the_dot_layout_at_the_files_size(kernels, type_name):
    """Under `--block-matmul int8` a layer keeps its integers in the dot products' layout (no repacking per
    step) at the rows layout's size, and its scales and mins in float16: exactly the file's for GGUF's
    32-value block types (which store them so), rounded to float16 (2^-11 relative) for Q4_K's and Q5_K's
    products of two scales, read only with activations rounded to int8. Q4_1 and Q4_K then take 0.625 bytes
    per weight. Unpacked, it is the file's matrix, rows and all (within those roundings for K-quants)."""
    blocks, dense = file_blocks(type_name, out_features=48)
    layer = BlockQuantLinear(blocks, None, Int8ActivationKernels(kernels))
    rows_layout = pack_blocks(blocks)
    assert packed_layout(layer.q) == "dot" and packed_layout(rows_layout[0]) == "rows"
    assert layer.q.dtype == rows_layout[0].dtype and layer.q.numel() == rows_layout[0].numel()
    assert layer.scales.dtype == torch.float16 and (layer.mins is None or layer.mins.dtype == torch.float16)
    exact_in_half = all(torch.equal(t.half().float(), t) for t in (blocks.scales, blocks.mins) if t is not None)
    if type_name in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"):
        assert exact_in_half
    if type_name in ("Q4_1", "Q4_K"):
        assert layer.storage_bytes() == dense.numel() * 20 // 32  # Q4_1's 20 bytes per block of 32
    ids = torch.tensor([0, 7, 8, 15, 16, 47])
    if exact_in_half:
        assert torch.equal(layer.blocks().dequantize(), dense)
        assert torch.equal(layer.dequantize_rows(ids), dense[ids])
    else:  # each scale and min moved by at most 2^-11 of itself: a weight by q * that, plus the min's
        assert type_name in ("Q4_K", "Q5_K")
        bound = (blocks.q.abs().max() * blocks.scales.abs().max() + blocks.mins.abs().max()) * 2.0**-11
        assert 0 < (layer.blocks().dequantize() - dense).abs().max() <= bound
        torch.testing.assert_close(layer.dequantize_rows(ids), dense[ids], rtol=0, atol=bound.item())
    with pytest.raises(RuntimeError, match="dot layout"):  # the float32 kernels read the rows layout only
        kernels.block_linear(torch.zeros(1, dense.shape[1]), layer.q, layer.scales, layer.mins, None, 48)


@pytest.mark.slow
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q8_0", "Q5_1"])
def test_vnni_kernel_equals_the_portable_loop(vnni, portable_kernels, type_name):
    """The AVX-512 VNNI kernel and the portable C++ loop run the same float operations per block."""
    assert_same_bits(vnni, portable_kernels, type_name)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_1"])
def test_avx2_kernel_equals_the_portable_loop(kernels, portable_kernels, type_name):
    """The AVX2 kernel (int16 pair sums for 4-bit blocks, sign-folded signed bytes for 8-bit ones) takes
    the same integer dot products as the portable loop, so the same bits; built for AVX2 on wider CPUs."""
    from tokenmill.model.layers import cpu_kernels

    if kernels.simd == "portable":
        pytest.skip("this CPU has no AVX2")
    avx2 = kernels if kernels.int8_dot == "avx2" else cpu_kernels.load_variant("avx2")
    assert avx2.int8_dot == "avx2"
    assert_same_bits(avx2, portable_kernels, type_name)


class RoundedInputLinear(torch.nn.Module):
    """HF's nn.Linear with its input rounded as block_linear_q8 rounds it: the product of the rounded
    input with the weights, plus the kernel's min term on the unrounded block sums (the weights' mins
    [out, K / 32] as the engine's layer holds them)."""

    def __init__(self, linear: torch.nn.Linear, mins) -> None:
        super().__init__()
        self.linear, self.mins = linear, mins

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        xq, xd = round_activations(rows)
        rounded = xq * xd
        y = torch.nn.functional.linear(rounded.reshape(rows.shape), self.linear.weight, self.linear.bias)
        if self.mins is not None:
            y = y + (rows.reshape(rounded.shape).sum(-1) - rounded.sum(-1)) @ self.mins.T
        return y.reshape(*x.shape[:-1], -1)


def round_hf_linear_inputs(hf: torch.nn.Module, engine_model) -> None:
    """Every nn.Linear of `hf` as a RoundedInputLinear, with the mins of the engine's (fused) layer rows."""
    mins_by_name = {}
    for name, module in engine_model.named_modules():
        if isinstance(module, BlockQuantLinear):
            mins = module.blocks().mins
            if name.endswith("embed_tokens.table"):
                continue
            offset = 0
            for part, rows in zip(engine_model.checkpoint_weight_names(name), engine_model.checkpoint_part_rows(name)):
                mins_by_name[part.removesuffix(".weight")] = None if mins is None else mins[offset:offset + rows]
                offset += rows
    if "lm_head" not in mins_by_name and "model.embed_tokens" in mins_by_name:
        mins_by_name["lm_head"] = mins_by_name["model.embed_tokens"]
    for name, module in list(hf.named_modules()):
        if isinstance(module, torch.nn.Linear):
            parent, _, leaf = name.rpartition(".")
            setattr(hf.get_submodule(parent) if parent else hf, leaf, RoundedInputLinear(module, mins_by_name[name]))


def engine_with_block_matmul(gguf_path, tokenizer_dir, block_matmul: str, kernels_type: type,
                             max_num_batched_tokens: int):
    """An LLM on the tiny GGUF under `--block-matmul block_matmul`, and its runner, after checking that
    every kept layer got `kernels_type`."""
    llm = LLM(str(gguf_path), tokenizer=str(tokenizer_dir), max_num_batched_tokens=max_num_batched_tokens,
              num_kv_blocks=64, max_model_len=512, block_matmul=block_matmul,
              dtype="float32", kv_cache_dtype="float32")
    runner = llm.llm_engine.core.core.runner
    linears = [m for m in runner.model.modules() if isinstance(m, BlockQuantLinear)]
    assert linears and all(isinstance(m.kernels, kernels_type) for m in linears)
    return llm, runner


def test_engine_int8_matmul_matches_hf_with_rounded_activations(int8_simd, tiny_gguf_path, tiny_llama_dir,
                                                                smollm2_tokenizer):
    """Every kept layer (the head too) and the fused decode stack take the integer path; greedy tokens
    equal HF's on the file's weights with each linear layer's input rounded to int8 per block of 32."""
    llm, runner = engine_with_block_matmul(tiny_gguf_path, tiny_llama_dir, "int8", Int8ActivationKernels, 24)
    assert runner.model._int8_decode is not None and runner.model._int8_decode[0].int8_activations
    assert "int8" in runner.linear_layers
    hf = hf_on_file_weights(tiny_gguf_path, tiny_llama_dir)
    round_hf_linear_inputs(hf, runner.model)
    lengths = [12, 20, 7, 16]
    ids = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids],
                           [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths],
                           use_tqdm=False)
    for prompt, m, out in zip(ids, lengths, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, m)


def test_int8_matmul_option_is_validated():
    from tokenmill.errors import TokenmillError

    with pytest.raises(TokenmillError, match="block_matmul"):
        LLM(block_matmul="int4")


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float32", "int8"])
def test_fused_stack_runs_mixed_steps_of_the_embedded_model(int8_simd, smollm2_tokenizer, kv_cache_dtype):
    """The embedded model at its default int8 numerics: a mixed step (decode rows, then prefill chunks) runs
    through the one-call stack, its chunks through the bfloat16 prefill kernel over a bfloat16 cache (where the
    CPU has one) or the float32 kernel over a float32 or int8 cache, with the same hidden states and cache writes as the
    per-layer modules. A float32 chunk of CPU_PREFILL_KERNEL_MAX_TOKENS or more goes to SDPA: that step stays
    with the layers."""
    from fused_decode import decode_step_both_ways
    from model_factory import GOLDEN_PROMPTS
    from tokenmill.model.layers.attention.cpu_backend import CPU_PREFILL_KERNEL_MAX_TOKENS

    llm = LLM(max_model_len=1024, kv_cache_memory_bytes="64MiB", max_num_batched_tokens=48, max_num_seqs=3,
              enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    model = llm.llm_engine.core.core.runner.model
    attn = model.layers[0].self_attn
    step = decode_step_both_ways(llm, [smollm2_tokenizer.encode(p) for p in GOLDEN_PROMPTS[:6]], max_tokens=8,
                                 mixed=True)
    meta = step.metas[0]
    assert 0 < meta.num_decodes < step.args[0].numel() and step.fused_ran
    assert attn.backend.stack_prefill_tables(meta, attn.head_dim, attn.softcap)[1] == attn.backend.bf16_prefill
    assert attn.backend.bf16_prefill == (kv_cache_dtype == "bfloat16" and bool(attn.backend.bf16_path))
    assert torch.equal(step.fused_hidden, step.layered_hidden)
    assert all(torch.equal(a, b) for a, b in zip(step.fused_caches, step.layered_caches))
    if not attn.backend.bf16_prefill:
        # The short prompt decodes while the long one's second chunk (986 tokens) prefills.
        llm = LLM(max_model_len=2048, kv_cache_memory_bytes="96MiB", max_num_batched_tokens=1024, max_num_seqs=2,
                  max_mixed_prefill_tokens=1024, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
        long_prompt = smollm2_tokenizer.encode("The history of the Roman Empire spans many centuries. " * 180)
        assert 1024 + CPU_PREFILL_KERNEL_MAX_TOKENS <= len(long_prompt) <= 2000
        step = decode_step_both_ways(llm, [smollm2_tokenizer.encode(GOLDEN_PROMPTS[0]), long_prompt], max_tokens=4,
                                     mixed=True)
        assert step.metas[0].prefill_split.torch_chunks and not step.fused_ran
