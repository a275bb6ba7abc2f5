"""Q8_0 weight-only quantization: the format, the int8 kernel, and greedy parity with HF transformers
running the very same (dequantized) weights."""
from __future__ import annotations

import pytest
import torch

from fused_decode import decode_step_both_ways
from model_factory import GOLDEN_PROMPTS, hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.errors import TokenmillError
from tokenmill.model.layers.linear import (
    BLOCK_KERNEL_MAX_ROWS,
    BlockQuantLinear,
    Int8Blocks,
    dequantize_q8_0,
    pack_blocks,
    quantize_q8_0,
    unpack_blocks,
)


def pack_int8_blocks(q, scales, mins=None):
    return pack_blocks(Int8Blocks(q, scales, mins), bits=8)


def test_quantize_q8_0_format():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 64, generator=gen)
    weight[1, :32] = 0.0  # an all-zero block
    q, scales = quantize_q8_0(weight)
    assert q.dtype == torch.int8 and q.shape == (5, 64) and scales.shape == (5, 2)
    assert int(q.abs().max()) == 127  # each block's largest magnitude maps to +-127
    assert scales[1, 0] == 0 and torch.all(q[1, :32] == 0)
    blocks = weight.reshape(5, 2, 32)
    torch.testing.assert_close(scales, (blocks.abs().amax(-1) / 127).half().float(), rtol=0, atol=0)
    error = (dequantize_q8_0(q, scales) - weight).reshape(5, 2, 32).abs()
    # Round-to-nearest on the unrounded scale, then the scale rounded to float16 (2^-11 relative, x127).
    assert torch.all(error <= scales.unsqueeze(-1) * (0.5 + 127 * 2**-11) + 1e-7)
    with pytest.raises(ValueError):
        quantize_q8_0(torch.randn(4, 48))


def test_quantize_q8_0_writes_what_gguf_writes():
    """The same integers and float16 scales as gguf-py's Q8_0 quantizer (llama.cpp's reference): a dense model
    served with --quantization q8_0 runs the weights its Q8_0 GGUF would hold."""
    import gguf
    import numpy as np

    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    weight[3, 64:96] = 0.0
    q, scales = quantize_q8_0(weight)
    raw = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(48, 8, 34)
    assert torch.equal(scales, torch.from_numpy(raw[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)))
    assert torch.equal(q, torch.from_numpy(raw[:, :, 2:].copy().view(np.int8).reshape(48, 256)))


def test_pack_int8_blocks_panels_of_sixteen_features():
    q = (torch.arange(21 * 64) % 255 - 127).reshape(21, 64).to(torch.int8)  # distinct rows
    scales = torch.arange(1, 21 * 2 + 1, dtype=torch.float32).reshape(21, 2)
    assert pack_int8_blocks(q, scales)[2] is None
    packed_q, packed_scales, packed_mins = pack_int8_blocks(q, scales, -scales)
    assert packed_q.shape == (2, 2, 32, 16) and packed_scales.shape == (2, 2, 16)  # 21 features -> 2 panels
    assert torch.equal(packed_mins, -packed_scales)  # mins share the scales' layout
    for n in range(32):
        panel, j = divmod(n, 16)
        for block in range(2):
            column = packed_q[panel, block, :, j]
            if n < 21:  # input k of feature n sits at [panel][block][k % 32][n % 16]
                assert torch.equal(column, q[n, block * 32:(block + 1) * 32])
                assert packed_scales[panel, block, j] == scales[n, block]
            else:  # the last panel is zero-padded
                assert not column.any() and packed_scales[panel, block, j] == 0


@pytest.mark.parametrize("rows", [1, 3, 16, BLOCK_KERNEL_MAX_ROWS, BLOCK_KERNEL_MAX_ROWS + 1])
def test_q8_0_linear_both_paths_compute_the_dequantized_weights(kernels, rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 128, generator=gen), torch.randn(96, generator=gen)
    layer = BlockQuantLinear.from_weight(weight, bias, kernels=kernels)
    x = torch.randn(rows, 128, generator=gen)
    expected = x @ dequantize_q8_0(*quantize_q8_0(weight)).T + bias
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)
    assert layer.bits == 8 and not any(t.dtype == torch.float32 and t.numel() >= 96 * 128 for t in vars(layer).values()
                                       if isinstance(t, torch.Tensor))  # no float copy of the weights


# Tiles of 1-4 (AVX2) or 1-8 (AVX-512) rows: every remainder up to the row path's 64 rows; then tiles.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 17, 63, 64, 65, 70])
def test_q8_0_kernel_tiles_do_not_change_results(kernels, rows):
    """The row path tiles rows by 4 or 8; 99 features leave a partial last panel. Up to 64 rows each
    output must be the same bits as computing its row alone; every output matches x @ W^T."""
    gen = torch.Generator().manual_seed(100 + rows)
    q, scales = quantize_q8_0(torch.randn(99, 96, generator=gen))
    packed = pack_int8_blocks(q, scales)
    bias = torch.randn(99, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    y = kernels.block_linear(x, *packed, bias, 99)
    for r in range(rows) if rows <= BLOCK_KERNEL_MAX_ROWS else ():
        assert torch.equal(y[r:r + 1], kernels.block_linear(x[r:r + 1].contiguous(), *packed, bias, 99))
    torch.testing.assert_close(y, x @ dequantize_q8_0(q, scales).T + bias, atol=1e-4, rtol=1e-5)
    no_bias = kernels.block_linear(x, *packed, None, 99)
    torch.testing.assert_close(no_bias, x @ dequantize_q8_0(q, scales).T, atol=1e-4, rtol=1e-5)


def test_q8_0_kernel_rejects_bad_shapes(kernels):
    packed = pack_int8_blocks(*quantize_q8_0(torch.randn(8, 64)))
    with pytest.raises(RuntimeError):  # K of x does not match the weights
        kernels.block_linear(torch.randn(1, 32), *packed, None, 8)
    with pytest.raises(RuntimeError):  # more features than the packed panels hold
        kernels.block_linear(torch.randn(1, 64), *packed, None, 17)
    with pytest.raises(RuntimeError):  # bias of the wrong length
        kernels.block_linear(torch.randn(1, 64), *packed, torch.zeros(9), 8)


def test_q8_0_engine_matches_hf_on_the_dequantized_weights(kernels, tiny_llama_dir, smollm2_tokenizer):
    """Greedy tokens equal HF generate on the same Q8_0-rounded weights (the projections, the LM head and the
    token embedding, as a Q8_0 GGUF holds them): decode steps with few requests take the kernel's row path, long
    prefill chunks its dequantized tiles; both must agree with HF."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in hf.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.copy_(dequantize_q8_0(*quantize_q8_0(module.weight)))
    llm = LLM(str(tiny_llama_dir), max_num_batched_tokens=24, num_kv_blocks=64, max_model_len=512,
              quantization="q8_0", numerics="exact")
    prompts = [smollm2_tokenizer.encode(p) for p in GOLDEN_PROMPTS[:5]]
    lengths = [12, 20, 5, 16, 24]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                           [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths],
                           use_tqdm=False)
    for ids, m, out in zip(prompts, lengths, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, m)


def test_q8_0_needs_cpu_kernels(tiny_llama_dir):
    with pytest.raises(TokenmillError, match="q8_0"):
        LLM(str(tiny_llama_dir), num_kv_blocks=16, quantization="q8_0", attention_backend="torch")


@pytest.mark.parametrize("weights,kv_cache_dtype", [("q8_0", "float32"), ("q8_0", "float16"), ("q8_0", "bfloat16"),
                                                    ("q8_0", "int8"), ("gguf", "auto")])
def test_int8_fused_decode_stack_is_bit_identical_to_the_layers(request, kernels, tiny_llama_dir, smollm2_tokenizer,
                                                                weights, kv_cache_dtype):
    """Decode-only steps of up to BLOCK_KERNEL_MAX_ROWS rows run the whole decoder stack in one C++ call;
    it must produce the very same hidden states and cache writes as the per-layer modules (same
    kernels, same order), here on a decode step of three requests whose contexts end mid-block, with
    a float32 cache, with 16-bit ones (rounded as torch rounds) and an int8 one (quantized as kv_int8 does), and
    with a GGUF's own blocks
    (scales and mins: tests/conftest.py's mixed file)."""
    if weights == "gguf":
        llm = LLM(str(request.getfixturevalue("tiny_gguf_path")), tokenizer=str(tiny_llama_dir), num_kv_blocks=64,
                  max_model_len=512, quantization="gguf", numerics="exact")
    else:
        llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=512, quantization="q8_0",
                  kv_cache_dtype=kv_cache_dtype, dtype="float32", block_matmul="float32")
    model = llm.llm_engine.core.core.runner.model
    assert model._int8_decode is not None
    expected_dtype = torch.float32 if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype)
    head_dim = model.layers[0].self_attn.head_dim
    assert all(cache.shape[-1] == (head_dim + 2 if kv_cache_dtype == "int8" else head_dim)
               for cache in llm.llm_engine.core.core.runner.kv_caches)
    assert all(cache.dtype == expected_dtype for cache in llm.llm_engine.core.core.runner.kv_caches)
    step = decode_step_both_ways(llm, [smollm2_tokenizer.encode(p) for p in GOLDEN_PROMPTS[:3]], max_tokens=6)
    assert step.fused_calls >= 5  # every decode step after the prefills
    assert step.metas[0].num_decodes == 3
    assert torch.equal(step.fused_hidden, step.layered_hidden)
    # the same K/V written to the same slots
    assert all(torch.equal(a, b) for a, b in zip(step.fused_caches, step.layered_caches))


def test_q8_0_rounds_each_matrix_as_the_checkpoint_streams_in(tiny_llama_dir):
    """--quantization q8_0 on a dense checkpoint: every projection (fused ones from their parts), the LM head and
    the embedding hold the checkpoint's tensors rounded to Q8_0, and the model keeps no float parameter of
    them (each was passed on as a shape-only tensor, never written)."""
    from safetensors.torch import load_file

    from tokenmill.model.layers.linear import BlockQuantEmbedding

    llm = LLM(str(tiny_llama_dir), quantization="q8_0", num_kv_blocks=16)
    runner = llm.llm_engine.core.core.runner
    model = runner.model
    assert not [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    assert isinstance(model.embed_tokens, BlockQuantEmbedding)
    assert runner.linear_layers.startswith("Q8_0 weights rounded as they loaded")
    float_matrices = [name for name, p in model.named_parameters() if p.dim() == 2]
    assert float_matrices == [], float_matrices
    stored = load_file(str(tiny_llama_dir / "model.safetensors"))
    layer = model.layers[0]
    for fused, parts in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
        module = next(m for n, m in getattr(layer, fused).named_children() if isinstance(m, BlockQuantLinear))
        expected = torch.cat([stored[f"model.layers.0.{fused}.{part}.weight"] for part in parts])
        q, scales = quantize_q8_0(expected)
        blocks = module.blocks()
        assert torch.equal(blocks.q, q) and torch.equal(blocks.scales, scales)


def test_round_while_loading_passes_on_what_it_does_not_round(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), quantization="none", num_kv_blocks=16)
    methods = llm.llm_engine.core.core.runner.linear_methods
    q_proj, norm, odd = torch.randn(64, 64), torch.randn(64), torch.randn(64, 48)
    blocks = {}
    out = dict(methods.round_while_loading([("model.layers.0.self_attn.q_proj.weight", q_proj),
                                            ("model.layers.0.input_layernorm.weight", norm),
                                            ("model.layers.0.mlp.down_proj.weight", odd)], blocks))
    assert out["model.layers.0.self_attn.q_proj.weight"].device.type == "meta"
    assert out["model.layers.0.input_layernorm.weight"] is norm  # not a matrix of a linear layer
    assert out["model.layers.0.mlp.down_proj.weight"] is odd  # 48 inputs: not whole 32-value blocks
    assert list(blocks) == ["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(blocks["model.layers.0.self_attn.q_proj.weight"].q, quantize_q8_0(q_proj)[0])


@pytest.mark.parametrize("layout", ["rows", "dot"])
@pytest.mark.parametrize("bits", [4, 8])
def test_rounding_and_packing_in_several_passes_equal_one(monkeypatch, layout, bits):
    """Load rounds and packs a large matrix a run of rows at a time (100 x 8192: four passes, the last one
    padded); the bytes are those of one pass over the whole matrix."""
    import tokenmill.model.layers.linear as linear

    weight = torch.randn(100, 8192, generator=torch.Generator().manual_seed(bits))
    q, scales = quantize_q8_0(weight)
    if bits == 4:
        q = (q // 16).clamp(-8, 7)  # the integers of a 4-bit type without mins
    blocks = Int8Blocks(q, scales)
    in_passes = pack_blocks(blocks, bits, layout)
    monkeypatch.setattr(linear, "_VALUES_PER_PASS", 1 << 30)
    if bits == 8:  # rounded in one pass
        assert all(torch.equal(a, b) for a, b in zip((q, scales), quantize_q8_0(weight)))
    in_one = pack_blocks(blocks, bits, layout)
    assert all(torch.equal(a, b) for a, b in zip(in_passes, in_one) if a is not None)
    assert torch.equal(unpack_blocks(*in_passes, 100).q, q)
