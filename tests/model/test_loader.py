"""Model loading: HF directories, the embedded GGUF checked against transformers, GGUFs written here."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from model_factory import build_tiny_llama, default_tensor_type, finish_gguf, gguf_permute, write_gguf
from tokenmill.errors import ModelLoadError
from tokenmill.model.default_model import DEFAULT_MODEL_NAME
from tokenmill.model.gguf_loader import unpermute_rotary_rows
from tokenmill.model.loader import load_model_source

# --------------------------------------------------------------------------- HF directories


def test_hf_dir_weights_config_tokenizer(tiny_llama_dir: Path, smollm2_tokenizer) -> None:
    source = load_model_source(str(tiny_llama_dir))
    assert not source.is_gguf
    assert source.architecture == "LlamaForCausalLM"
    assert source.served_model_name == tiny_llama_dir.name
    cfg = source.hf_config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.vocab_size == len(smollm2_tokenizer) and cfg.tie_word_embeddings is False
    assert cfg.rope_parameters["rope_theta"] == 10000.0

    expected = load_file(str(tiny_llama_dir / "model.safetensors"))
    got = dict(source.iter_weights(torch.float32))
    assert got.keys() == expected.keys()
    assert "lm_head.weight" in got and "model.layers.1.self_attn.k_proj.weight" in got
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor.float()), name

    text = "Hello, tokenmill!"
    assert source.tokenizer.encode(text) == smollm2_tokenizer.encode(text)
    assert source.tokenizer.decode(source.tokenizer.encode(text)) == text


def test_hf_dir_sharded_and_dtype(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Split the checkpoint into two shards with an index; the union must come back, in bf16."""
    for item in tiny_llama_dir.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, tmp_path / item.name)
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
        weight_map.update({k: file for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    got = dict(load_model_source(str(tmp_path)).iter_weights(torch.bfloat16))
    assert got.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], tensor.to(torch.bfloat16)), name


# --------------------------------------------------------------------------- the embedded GGUF


@pytest.fixture(scope="module")
def default_source():
    return load_model_source(None)


@pytest.fixture(scope="module")
def transformers_reference(smollm2_hf) -> dict[str, torch.Tensor]:
    """transformers' own GGUF conversion (dequantize + its reverse permutation), as the state dict of the
    model it loads from the file (the session's shared reference model)."""
    return smollm2_hf.state_dict()


def test_default_gguf_config(default_source) -> None:
    assert default_source.is_gguf and default_source.served_model_name == DEFAULT_MODEL_NAME
    assert default_source.architecture == "LlamaForCausalLM"
    cfg = default_source.hf_config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (576, 1536, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (49152, 8192)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_parameters["rope_theta"] == 100000.0
    assert cfg.tie_word_embeddings is True
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)


def test_default_gguf_tokenizer_and_chat_template(default_source) -> None:
    tok = default_source.tokenizer
    assert len(tok) == 49152 and tok.eos_token_id == 2
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("The capital of France")) == "The capital of France"


def test_default_gguf_weights_match_transformers(default_source, transformers_reference) -> None:
    cfg = default_source.hf_config
    seen = set()
    for name, tensor in default_source.iter_weights(torch.float32):
        seen.add(name)
        reference = transformers_reference[name]
        assert tensor.dtype == torch.float32 and tensor.shape == reference.shape, name
        # Both sides run gguf-py's dequantizer, so they agree bit for bit today; the tolerance
        # only absorbs a future switch of either side to another (float32) kernel.
        reference = reference.float()
        assert torch.equal(tensor, reference) or (tensor - reference).abs().max() <= 1e-6, name
    expected = {n for n in transformers_reference if n != "lm_head.weight"}
    assert seen == expected  # tied: the file has no output.weight, so no lm_head is yielded
    assert len(seen) == 2 + 9 * cfg.num_hidden_layers


# --------------------------------------------------------------------------- the permutation


def test_unpermute_makes_rotate_half_rope_equal_interleaved_rope() -> None:
    """The semantic check: HF rope on unpermuted rows == llama.cpp (pairwise) rope on the file's rows."""
    torch.manual_seed(0)
    heads, head_dim, pos = 3, 8, 7
    gguf_rows = torch.randn(heads * head_dim, 5)
    hf_rows = unpermute_rotary_rows(gguf_rows, heads)
    assert torch.equal(gguf_permute(hf_rows, heads), gguf_rows)

    freqs = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    cos, sin = torch.cos(pos * freqs), torch.sin(pos * freqs)
    x_hf = hf_rows.double().reshape(heads, head_dim, 5)
    a, b = x_hf[:, : head_dim // 2], x_hf[:, head_dim // 2 :]  # rotate_half pairs j with j + d/2
    hf_out = torch.cat([a * cos[:, None] - b * sin[:, None], b * cos[:, None] + a * sin[:, None]], dim=1)
    x_gg = gguf_rows.double().reshape(heads, head_dim, 5)
    a, b = x_gg[:, 0::2], x_gg[:, 1::2]  # llama.cpp's normal rope pairs 2j with 2j+1
    gg_out = torch.empty_like(x_gg)
    gg_out[:, 0::2] = a * cos[:, None] - b * sin[:, None]
    gg_out[:, 1::2] = b * cos[:, None] + a * sin[:, None]
    # Same rotated vectors, just in each layout's row order.
    assert torch.allclose(gguf_permute(hf_out.reshape(-1, 5), heads), gg_out.reshape(-1, 5))


# --------------------------------------------------------------------------- GGUFs written here

@pytest.mark.parametrize("tied", [False, True])
def test_written_gguf_round_trip(tmp_path: Path, smollm2_tokenizer, tied: bool) -> None:
    hf_dir = build_tiny_llama(tmp_path / "hf", smollm2_tokenizer, seed=3, tie_word_embeddings=tied)
    gguf_path = tmp_path / "tiny.gguf"
    tensors = write_gguf(gguf_path, hf_dir, rope_linear=2.0 if tied else None)

    source = load_model_source(str(gguf_path), tokenizer=str(hf_dir))
    assert source.is_gguf and source.served_model_name == "tiny"
    cfg = source.hf_config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.vocab_size == len(smollm2_tokenizer) and cfg.tie_word_embeddings is tied
    assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 1024
    if tied:
        assert cfg.rope_parameters == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    else:
        assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert source.tokenizer.encode("hi there") == smollm2_tokenizer.encode("hi there")

    got = dict(source.iter_weights(torch.float32))
    assert got.keys() == tensors.keys()  # save_pretrained drops a tied lm_head, and so does the GGUF
    for name, expected in tensors.items():
        expected = expected.float()
        tolerance = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 0.01}[default_tensor_type(name).name]
        scale = expected.abs().max().item()
        assert got[name].shape == expected.shape, name
        assert (got[name] - expected).abs().max().item() <= tolerance * scale, name
    # q/k must be un-permuted: the error is far below the difference a wrong row order would cause
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (got[q] - tensors[q]).abs().max() < (gguf_permute(tensors[q], 4) - tensors[q]).abs().max() / 10

    # a directory holding just that GGUF (and no config.json) is the same model
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(gguf_path, lone / "tiny.gguf")
    assert load_model_source(str(lone), tokenizer=str(hf_dir)).path == lone / "tiny.gguf"


# --------------------------------------------------------------------------- errors


def test_missing_path() -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_source("/nonexistent/model-dir")


def test_dir_without_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model_source(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="neither config.json nor a .gguf"):
        load_model_source(str(empty))


def test_unsupported_hf_architecture(tiny_llama_dir: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="unsupported architecture GPT2LMHeadModel"):
        load_model_source(str(tmp_path))


def test_unsupported_gguf_architecture_and_tensor_type(tmp_path: Path, smollm2_tokenizer) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    finish_gguf(writer)
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'mamba'"):
        load_model_source(str(tmp_path / "other.gguf"))

    # A llama GGUF whose projection is IQ4_NL (32 values in 18 bytes per block): config loads,
    # weight iteration names the type.
    hf_dir = build_tiny_llama(tmp_path / "hf", smollm2_tokenizer, num_hidden_layers=1)
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, 64),
                       (writer.add_feed_forward_length, 128), (writer.add_head_count, 4),
                       (writer.add_layer_norm_rms_eps, 1e-5)]:
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((len(smollm2_tokenizer), 64), dtype=np.float32))
    writer.add_tensor("blk.0.attn_v.weight", np.zeros((64, 2 * 18), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    finish_gguf(writer)
    source = load_model_source(str(path), tokenizer=str(hf_dir))
    assert source.hf_config.num_key_value_heads == 4 and not math.isnan(source.hf_config.rms_norm_eps)
    with pytest.raises(ModelLoadError, match="IQ4_NL"):
        list(source.iter_weights(torch.float32))


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_the_weights_source_a_worker_gets_is_plain_data_and_rebuilds_the_config(kind, tiny_llama_dir, smollm2_path):
    import dataclasses

    import msgspec

    source = load_model_source(str(tiny_llama_dir if kind == "safetensors" else smollm2_path))
    weights = source.for_weights()
    plain = dataclasses.asdict(weights)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(plain)) == plain  # builtin types only
    rebuilt = weights.model_source()
    assert type(rebuilt.hf_config) is type(source.hf_config)
    assert rebuilt.hf_config.to_dict() == source.hf_config.to_dict()
    assert (rebuilt.architecture, rebuilt.path, rebuilt.is_gguf, rebuilt.tokenizer) == (
        source.architecture, source.path, source.is_gguf, None)
