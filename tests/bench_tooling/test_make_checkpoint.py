"""benchmarks.make_checkpoint: its shapes against the published models' parameter counts and transformers' own
layout of each family, the types of llama.cpp's Q4_K_M mix, and 2-layer copies of the shapes loaded by
tokenmill in the exact mode against HF transformers token for token (sharded safetensors with an index file,
K-quant, Q4_0 and Q8_0 GGUFs)."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import make_checkpoint as mc
from model_factory import hf_greedy

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [42, 7, 99, 1200, 5000, 17, 3]]


@pytest.mark.parametrize("shape", [name for name, s in mc.SHAPES.items() if s.published_parameters])
def test_parameter_count_is_the_published_models(shape):
    assert mc.parameter_count(mc.shape_config(shape)) == mc.SHAPES[shape].published_parameters


def test_the_moe_shape_is_between_2_and_4_billion_parameters():
    assert 2e9 <= mc.parameter_count(mc.shape_config("mixtral-style-3b")) <= 4e9


@pytest.mark.parametrize("shape", sorted(mc.SHAPES))
def test_transformers_builds_the_same_tensors_from_the_config(shape):
    """The config is one transformers reads as the family (its model has exactly the tool's parameters)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = mc.shape_config(shape, layers=2)
    config = AutoConfig.for_model(**{k: v for k, v in values.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == mc.SHAPES[shape].architecture
    assert sum(p.numel() for p in model.parameters()) == mc.parameter_count(values)


def test_q4_k_m_follows_llama_cpps_mix():
    config = mc.shape_config("llama-3.1-8b")
    types = {t.name: t.qtype for t in mc.gguf_tensors(config, "gguf-q4_k_m")}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    # 32 layers: the first and last four, and every third between, give attn_v and ffn_down six bits.
    six_bit = sorted(int(n.split(".")[1]) for n, t in types.items() if n.endswith("attn_v.weight") and t == "Q6_K")
    assert six_bit == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert types["blk.5.attn_q.weight"] == "Q4_K" and types["blk.0.attn_norm.weight"] == "F32"
    tied = {t.name: t.qtype for t in mc.gguf_tensors(mc.shape_config("llama-3.2-1b"), "gguf-q4_k_m")}
    assert tied["token_embd.weight"] == "Q6_K" and "output.weight" not in tied  # tied: the embedding is the head
    assert tied["rope_freqs.weight"] == "F32"


def test_random_blocks_have_the_intended_spread():
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    for qtype in ("Q8_0", "Q4_0", "Q4_K", "Q6_K"):
        raw = mc.random_blocks(rng, qtype, (64, 512))
        values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
        assert values.shape == (64, 512) and np.isfinite(values).all()
        assert 0.5 * mc.WEIGHT_STD < values.std() < 2 * mc.WEIGHT_STD, qtype
        assert abs(values.mean()) < 0.1 * mc.WEIGHT_STD, qtype


def test_an_unknown_shape_is_a_one_line_usage_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        mc.main([str(tmp_path), "--shape", "llama-9b"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'llama-9b'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("shape,fmt", [
    ("llama-3.2-1b", "safetensors"),  # sharded, llama3 rope scaling
    ("qwen2.5-1.5b", "gguf-q4_k_m"),  # biases; Q4_K and Q6_K blocks
    ("llama-3.2-1b", "gguf-q4_0"),  # rope_freqs, Q4_0 with a tied Q6_K embedding
    ("gemma-3-1b", "gguf-q8_0"),  # windowed layers, four norms, a head size of 256
    ("mixtral-style-3b", "safetensors"),  # experts (transformers reads a Mixtral GGUF as a dense Llama)
])
def test_two_layer_copy_matches_transformers(tmp_path, shape, fmt):
    from transformers import AutoModelForCausalLM

    from gguf_compat import hf_model_from_gguf
    from tokenmill import LLM, SamplingParams

    path = mc.make_checkpoint(tmp_path, shape, fmt, layers=2, vocab_size=49152, shard_bytes=64 * 1024**2)
    if fmt == "safetensors":
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        hf = hf_model_from_gguf(path, dtype=torch.float32)
    expected = [hf_greedy(hf, prompt, 6) for prompt in PROMPTS]
    del hf
    llm = LLM(model=str(path), numerics="exact", kv_cache_memory_bytes=64 * 1024**2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
