"""GGUF weights kept quantized: the file's blocks decoded to int8 + per-32 scales/mins reproduce
gguf-py's values bit for bit, the int8 kernel applies them, and the engine serves a block-quantized
GGUF with greedy tokens equal to HF transformers running the same (dequantized) weights."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from model_factory import hf_greedy, mixed_gguf_type, write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.errors import TokenmillError
from tokenmill.model.gguf_loader import INT8_BLOCK_TYPES, gguf_int8_blocks
from tokenmill.model.layers.linear import (
    BLOCK_KERNEL_MAX_ROWS,
    BlockQuantEmbedding,
    BlockQuantLinear,
    Int8Blocks,
    dense_linear,
    pack_blocks,
    quantize_q8_0,
)
from tokenmill.model.loader import load_model_source

# Offsets of the float16 scale fields in each block type (the rest of a block is arbitrary bits).
_F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}


def random_gguf_tensor(type_name: str, out_features: int, in_features: int, seed: int):
    """A GGUFReader-like tensor of random blocks: any bit pattern is a valid block once the float16
    scale fields hold finite values."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[type_name]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(out_features * in_features // block_size, type_size), dtype=np.uint8)
    for offset in _F16_FIELDS[type_name]:
        raw[:, offset:offset + 2] = rng.normal(0, 0.02, size=(len(raw), 1)).astype(np.float16).view(np.uint8)
    return SimpleNamespace(tensor_type=qtype, shape=np.array([in_features, out_features]),
                           data=raw.reshape(out_features, -1))


@pytest.mark.parametrize("type_name", sorted(INT8_BLOCK_TYPES))
def test_blocks_reproduce_gguf_py_values_bit_for_bit(type_name):
    from gguf import quants

    in_features = 512 if type_name.endswith("_K") else 96  # k-quants come in super-blocks of 256
    tensor = random_gguf_tensor(type_name, 6, in_features, seed=len(type_name))
    blocks = gguf_int8_blocks(tensor)
    expected = torch.from_numpy(quants.dequantize(tensor.data, tensor.tensor_type).reshape(6, in_features).copy())
    assert blocks.q.dtype == torch.int8 and blocks.q.shape == (6, in_features)
    assert blocks.scales.shape == (6, in_features // 32)
    assert (blocks.mins is not None) == (type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"))
    assert torch.equal(blocks.dequantize(), expected)


@pytest.mark.parametrize("out_features", [6, 2100])  # 2100 rows of 512: more than one decoding pass
def test_q6_k_decodes_to_gguf_py_values_bit_for_bit(out_features):
    """Q6_K (Q4_K_M's six-bit matrices) loads dense through tokenmill's own decoder."""
    from gguf import quants

    from tokenmill.model.gguf_loader import _DEQUANTIZERS, _in_chunks, _raw_blocks

    tensor = random_gguf_tensor("Q6_K", out_features, 512, seed=out_features)
    expected = quants.dequantize(tensor.data, tensor.tensor_type).reshape(out_features, 512)
    ours = _in_chunks(_DEQUANTIZERS["Q6_K"], _raw_blocks(tensor), 256).reshape(out_features, 512)
    assert np.array_equal(ours, expected)


@pytest.mark.parametrize("type_name", ["Q6_K", "F16"])
def test_the_reader_rounds_other_types_as_the_dense_matrix_rounds(type_name):
    """A matrix the file stores in a type not kept (Q6_K, F16) is rounded to Q8_0 by the reader, a run of rows
    at a time: the integers and scales of rounding its whole dequantized matrix."""
    from gguf import GGMLQuantizationType, quants

    from tokenmill.model.gguf_loader import _rounded_to_q8_0

    if type_name == "F16":
        values = np.random.default_rng(5).normal(0, 0.02, size=(2100, 512)).astype(np.float16)
        tensor = SimpleNamespace(tensor_type=GGMLQuantizationType.F16, shape=np.array([512, 2100]), data=values)
    else:
        tensor = random_gguf_tensor(type_name, 2100, 512, seed=7)
    dense = torch.from_numpy(np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
                             .reshape(2100, 512).copy())
    blocks = _rounded_to_q8_0(tensor, (2100, 512))
    q, scales = quantize_q8_0(dense)
    assert torch.equal(blocks.q, q) and torch.equal(blocks.scales, scales) and blocks.mins is None


@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0"])
def test_blocks_decoded_in_several_passes_equal_one(type_name):
    from gguf import quants

    tensor = random_gguf_tensor(type_name, 2100, 512, seed=3)
    blocks = gguf_int8_blocks(tensor)
    expected = torch.from_numpy(quants.dequantize(tensor.data, tensor.tensor_type).reshape(2100, 512).copy())
    assert torch.equal(blocks.dequantize(), expected)


def test_other_types_are_not_kept():
    from gguf import GGMLQuantizationType

    for type_name in ("F32", "F16", "Q6_K"):
        fake = SimpleNamespace(tensor_type=GGMLQuantizationType[type_name], shape=np.array([256, 4]), data=None)
        assert gguf_int8_blocks(fake) is None


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, BLOCK_KERNEL_MAX_ROWS, BLOCK_KERNEL_MAX_ROWS + 3])
def test_int8_kernel_with_mins(kernels, rows):
    """w = q * scale + min: the kernel adds min * sum(x over each block of 32); up to 64 rows (the row
    path) every row's result is the same bits alone or in a batch; above, dequantized tiles."""
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(0, 32, (37, 128), generator=gen, dtype=torch.int8)  # 37 features: a partial panel
    blocks = Int8Blocks(q, torch.rand(37, 4, generator=gen) * 0.01, -torch.rand(37, 4, generator=gen) * 0.1)
    packed = pack_blocks(blocks, bits=8)
    bias = torch.randn(37, generator=gen)
    x = torch.randn(rows, 128, generator=gen)
    y = kernels.block_linear(x, *packed, bias, 37)
    torch.testing.assert_close(y, x @ blocks.dequantize().T + bias, atol=1e-5, rtol=1e-5)
    for r in (0, rows - 1) if rows <= BLOCK_KERNEL_MAX_ROWS else ():
        assert torch.equal(y[r:r + 1], kernels.block_linear(x[r:r + 1].contiguous(), *packed, bias, 37))
    layer = BlockQuantLinear(blocks, bias, kernels=kernels)  # 0..31: stored at 8 bits, as given
    assert layer.bits == 8 and torch.equal(layer(x), y)


def test_cat_fills_missing_mins_with_zeros():
    a = Int8Blocks(torch.ones(2, 32, dtype=torch.int8), torch.full((2, 1), 0.5))
    b = Int8Blocks(torch.ones(3, 32, dtype=torch.int8), torch.full((3, 1), 0.25), torch.full((3, 1), -1.0))
    both = Int8Blocks.cat([a, b])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert torch.equal(both.mins[:2], torch.zeros(2, 1))


@pytest.mark.parametrize("rows_hint", [None, 16])
def test_dense_linear_for_matrices_not_kept(rows_hint):
    """A matrix no block type covers runs dense: oneDNN-packed given a row hint (where oneDNN is
    built in), else a plain nn.Linear over the very tensors."""
    gen = torch.Generator().manual_seed(1)
    weight, bias, x = (torch.randn(8, 64, generator=gen), torch.randn(8, generator=gen),
                       torch.randn(3, 64, generator=gen))
    layer = dense_linear(weight, bias, rows_hint)
    assert isinstance(layer, torch.nn.Linear) == (rows_hint is None or not torch.backends.mkldnn.is_available())
    torch.testing.assert_close(layer(x), x @ weight.T + bias, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense_linear(weight, None, rows_hint)(x), x @ weight.T, atol=1e-5, rtol=1e-5)


def hf_on_file_weights(path, tokenizer_dir):
    """HF's LlamaForCausalLM holding exactly the weights the file dequantizes to."""
    from transformers import LlamaForCausalLM

    source = load_model_source(str(path), tokenizer=str(tokenizer_dir))
    hf = LlamaForCausalLM(source.hf_config).eval()
    missing, unexpected = hf.load_state_dict(dict(source.iter_weights(torch.float32)), strict=False)
    assert not unexpected and all("rotary" in name for name in missing)
    return hf


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def greedy(llm, tokenizer, lengths):
    ids = [tokenizer.encode(p) for p in PROMPTS]
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids],
                           [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths],
                           use_tqdm=False)
    return ids, [out.outputs[0].token_ids for out in outputs]


def test_engine_keeps_every_block_type_and_matches_hf(kernels, tiny_gguf_path, tiny_llama_dir, smollm2_tokenizer):
    """By default a block-quantized GGUF stays quantized: every projection and the head are block
    layers (fused q/k/v and gate/up mix types with and without mins) and decode steps run the fused
    C++ stack; greedy tokens equal HF's on the dequantized weights and the dense float32 engine's."""
    llm = LLM(str(tiny_gguf_path), tokenizer=str(tiny_llama_dir), max_num_batched_tokens=24, num_kv_blocks=64,
              max_model_len=512, numerics="exact")
    model = llm.llm_engine.core.core.runner.model
    linears = [m for m in model.modules() if isinstance(m, BlockQuantLinear)]
    # every projection, the head, and the embedding table (the file's own Q8_0 blocks)
    assert len(linears) == 4 * len(model.layers) + 2 and model._int8_decode is not None
    assert isinstance(model.embed_tokens, BlockQuantEmbedding) and model.embed_tokens.table is not model.lm_head
    assert model.layers[0].self_attn.qkv_proj.mins is not None and model.layers[0].mlp.down_proj.mins is None
    hf = hf_on_file_weights(tiny_gguf_path, tiny_llama_dir)
    lengths = [12, 20, 7, 16]
    ids, tokens = greedy(llm, smollm2_tokenizer, lengths)
    for prompt, m, got in zip(ids, lengths, tokens):
        assert got == hf_greedy(hf, prompt, m)
    dense = LLM(str(tiny_gguf_path), tokenizer=str(tiny_llama_dir), max_num_batched_tokens=24, num_kv_blocks=64,
                max_model_len=512, quantization="none", numerics="exact")
    assert not any(isinstance(m, BlockQuantLinear) for m in dense.llm_engine.core.core.runner.model.modules())
    assert greedy(dense, smollm2_tokenizer, lengths)[1] == tokens


def test_kept_layers_hold_no_float_copy(kernels, tiny_gguf_path, tiny_llama_dir):
    """After load, a kept layer holds only its packed integers, scales, mins and bias; the embedding
    is looked up from the blocks (the tiny file's Q8_0 token embedding); no float32 tensor in the model
    is as large as a projection. Q4_* matrices are stored at 4 bits."""
    llm = LLM(str(tiny_gguf_path), tokenizer=str(tiny_llama_dir), num_kv_blocks=16, max_model_len=512,
              numerics="exact")
    model = llm.llm_engine.core.core.runner.model
    assert isinstance(model.embed_tokens, BlockQuantEmbedding)
    layers = [m for m in model.modules() if isinstance(m, BlockQuantLinear)]
    assert {layer.bits for layer in layers} == {4, 8}
    smallest = min(layer.in_features * layer.out_features for layer in layers)
    # parameters and the layers' own tensors (buffers are the rotary tables)
    tensors = list(model.parameters()) + [t for layer in layers for t in vars(layer).values()
                                          if isinstance(t, torch.Tensor)]
    floats = [t for t in tensors if t.dtype == torch.float32 and t.numel() >= smallest and t.dim() == 2]
    assert not floats, [tuple(t.shape) for t in floats]
    for layer in layers:
        assert all(not isinstance(v, torch.nn.Module) for v in vars(layer)["_modules"].values())


def test_embedding_rows_are_the_dequantized_table(kernels, tiny_gguf_path, tiny_llama_dir):
    """Embedding lookups from the blocks give exactly the dense table's rows (gguf-py's values)."""
    source = load_model_source(str(tiny_gguf_path), tokenizer=str(tiny_llama_dir))
    dense = dict(source.iter_weights(torch.float32))["model.embed_tokens.weight"]
    llm = LLM(str(tiny_gguf_path), tokenizer=str(tiny_llama_dir), num_kv_blocks=16, max_model_len=512,
              numerics="exact")
    embed = llm.llm_engine.core.core.runner.model.embed_tokens
    ids = torch.tensor([[0, 1, 15, 16, 17], [dense.shape[0] - 1, 31, 32, 100, 7]])
    assert torch.equal(embed(ids), dense[ids])


def test_tensors_of_other_types_stay_dense(kernels, tmp_path, tiny_llama_dir, smollm2_tokenizer):
    """A float16 down projection (as a Q6_K one would) stays a dense layer next to the kept ones; the
    fused decode stack needs every projection in int8, so it is off, and tokens still equal HF's."""
    from gguf import GGMLQuantizationType

    path = tmp_path / "partly.gguf"
    write_gguf(path, tiny_llama_dir, tensor_type=lambda name: GGMLQuantizationType.F16 if "down_proj" in name
               else mixed_gguf_type(name))
    llm = LLM(str(path), tokenizer=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=512, quantization="gguf",
              numerics="exact")
    model = llm.llm_engine.core.core.runner.model
    assert not isinstance(model.layers[0].mlp.down_proj, BlockQuantLinear)
    assert isinstance(model.layers[0].mlp.gate_up_proj, BlockQuantLinear) and model._int8_decode is None
    hf = hf_on_file_weights(path, tiny_llama_dir)
    ids, tokens = greedy(llm, smollm2_tokenizer, [10, 10, 10, 10])
    assert tokens == [hf_greedy(hf, prompt, 10) for prompt in ids]


def test_other_types_are_rounded_to_q8_0_under_int8_dot_products(kernels, tmp_path, tiny_llama_dir, caplog):
    """Where activations are rounded to int8 already, a matrix the kept blocks cannot hold as stored (float16
    here, as Q6_K's runs of 16 in Gemma 3's and Llama's Q4_K_M files) is rounded to Q8_0 at load: the same
    blocks as quantize_q8_0 of its dense values, so every projection is block-int8 and the fused decode stack
    runs."""
    from gguf import GGMLQuantizationType

    path = tmp_path / "partly.gguf"
    write_gguf(path, tiny_llama_dir, tensor_type=lambda name: GGMLQuantizationType.F16 if "down_proj" in name
               else mixed_gguf_type(name))
    with caplog.at_level("INFO", logger="tokenmill"):
        llm = LLM(str(path), tokenizer=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=512, dtype="float32",
                  block_matmul="int8", kv_cache_dtype="float32")
    model = llm.llm_engine.core.core.runner.model
    assert "rounded to Q8_0 at load" in caplog.text
    assert model._int8_decode is not None
    dense = hf_on_file_weights(path, tiny_llama_dir).model.layers[0].mlp.down_proj.weight.detach()
    down = model.layers[0].mlp.down_proj
    assert isinstance(down, BlockQuantLinear)
    q, scales = quantize_q8_0(dense)
    blocks = down.blocks()
    assert torch.equal(blocks.q, q) and torch.equal(blocks.scales, scales) and blocks.mins is None


def test_quantization_gguf_errors(tiny_gguf_path, tiny_llama_dir):
    with pytest.raises(TokenmillError, match="needs a GGUF model file"):
        LLM(str(tiny_llama_dir), num_kv_blocks=16, quantization="gguf")
    with pytest.raises(TokenmillError, match="gguf needs the CPU device"):
        LLM(str(tiny_gguf_path), tokenizer=str(tiny_llama_dir), num_kv_blocks=16, quantization="gguf",
            attention_backend="torch")
    # unset: without the CPU kernels the same file simply loads dense
    llm = LLM(str(tiny_gguf_path), tokenizer=str(tiny_llama_dir), num_kv_blocks=16, attention_backend="torch")
    assert not any(isinstance(m, BlockQuantLinear) for m in llm.llm_engine.core.core.runner.model.modules())


def test_embedded_model_holds_its_file_size_in_weights(kernels, smollm2_path):
    """The embedded Q4_1 GGUF's weights take at most 1.2x the file (nibbles, int8 Q8_0 embedding, float32
    scales and offsets; no float copy), and the startup report's KV cache is the cache's own bytes; the
    process holds at least both."""
    llm = LLM(kv_cache_memory_bytes=32 * 2**20, max_num_batched_tokens=64)
    core = llm.llm_engine.core.core
    report = core.memory
    assert report.weights <= 1.2 * smollm2_path.stat().st_size
    assert report.kv_cache == sum(t.numel() * t.element_size() for t in core.runner.kv_caches)
    assert report.rss is None or report.rss >= report.weights + report.kv_cache
    layers = [m for m in core.runner.model.modules() if isinstance(m, BlockQuantLinear)]
    assert sum(layer.bits == 4 for layer in layers) == 4 * len(core.runner.model.layers)  # every Q4_1 projection
