"""Write a random-weight checkpoint in the exact shape of a published model, for measuring engines at real sizes.

    python -m benchmarks.make_checkpoint --shape llama-3.2-1b --format safetensors OUT_DIR
    python -m benchmarks.make_checkpoint --shape llama-3.1-8b --format gguf-q4_k_m OUT_DIR
    python -m benchmarks.make_checkpoint --list

The weights are noise (outputs are meaningless); what they measure is an engine's speed and memory at
exactly-`max_tokens` outputs, as vLLM's `--load-format dummy` does. Every shape is its family's published
config (layers, widths, heads, vocabulary, tied or untied embeddings, biases, windows, rope scaling); the
tokenizer is the embedded SmolLM2's (49,152 tokens), whose ids are all below every shape's vocabulary.

Formats, each as its community ships it:
- safetensors: bfloat16, sharded with `model.safetensors.index.json` as HF publishes checkpoints
  (`--shard-size`), config.json and the tokenizer's files;
- gguf-q8_0, gguf-q4_0, gguf-q4_k_m: one GGUF with llama.cpp's tensor names and metadata, the tokenizer's
  metadata padded with unused tokens to the shape's vocabulary (llama.cpp wants one token per embedding row).
  Q4_K_M follows llama.cpp's mix: Q6_K for the output matrix (the embedding where it is tied) and for
  attn_v / ffn_down in its "more bits" layers, Q4_K elsewhere; Q4_0 keeps a Q6_K output as llama.cpp does.
  Blocks are random bytes with scales chosen so the weights have a standard deviation near 0.02.

`--layers N` and `--vocab-size V` shrink a shape (tests load 2-layer copies); the file is written in one
pass with one tensor (or one shard) in memory at a time.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)


@dataclass(frozen=True)
class Shape:
    """One published model's shape: its HF architecture, config fields and published parameter count."""

    architecture: str
    config: dict[str, Any]
    published_parameters: int | None  # None for a shape no published model has
    source: str  # where the numbers come from


SHAPES: dict[str, Shape] = {
    "llama-3.2-1b": Shape("LlamaForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_theta=500000.0, factor=32.0, **LLAMA3_ROPE)),
        1_235_814_400, "meta-llama/Llama-3.2-1B config.json"),
    "llama-3.2-3b": Shape("LlamaForCausalLM", dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_theta=500000.0, factor=32.0, **LLAMA3_ROPE)),
        3_212_749_824, "meta-llama/Llama-3.2-3B config.json"),
    "llama-3.1-8b": Shape("LlamaForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_theta=500000.0, factor=8.0, **LLAMA3_ROPE)),
        8_030_261_248, "meta-llama/Llama-3.1-8B config.json"),
    "qwen2.5-1.5b": Shape("Qwen2ForCausalLM", dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0), use_sliding_window=False),
        1_543_714_304, "Qwen/Qwen2.5-1.5B config.json"),
    "qwen2.5-7b": Shape("Qwen2ForCausalLM", dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1000000.0), use_sliding_window=False),
        7_615_616_512, "Qwen/Qwen2.5-7B config.json"),
    "gemma-3-1b": Shape("Gemma3ForCausalLM", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, vocab_size=262144, tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
        sliding_window=512, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
        rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1000000.0),
                             sliding_attention=dict(rope_type="default", rope_theta=10000.0))),
        999_885_952, "google/gemma-3-1b-pt config.json"),
    # No published MoE of this size runs on every engine here; this is Mixtral's layout (8 experts, 2 per
    # token, no window) at 2.8B parameters, 0.9B of them active per token.
    "mixtral-style-3b": Shape("MixtralForCausalLM", dict(
        hidden_size=2048, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-5,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
        None, "Mixtral-8x7B's layout at a smaller width"),
}
FORMATS = ("safetensors", "gguf-q8_0", "gguf-q4_0", "gguf-q4_k_m")
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the checkpoint: its HF name, shape, and what it is (a matrix, norm, bias or router)."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "matrix", "norm", "bias", "router"


def shape_config(name: str, layers: int | None = None, vocab_size: int | None = None) -> dict[str, Any]:
    """The HF config.json fields of a shape (optionally at fewer layers or a smaller vocabulary)."""
    shape = SHAPES[name]
    config = dict(shape.config, architectures=[shape.architecture], model_type=_MODEL_TYPES[shape.architecture],
                  torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    if layers is not None:
        config["num_hidden_layers"] = layers
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    if shape.architecture == "Gemma3ForCausalLM":
        config["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                 for i in range(config["num_hidden_layers"])]
    return config


_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Gemma3ForCausalLM": "gemma3_text",
                "MixtralForCausalLM": "mixtral"}


def _head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def tensor_specs(config: dict[str, Any]) -> list[TensorSpec]:
    """Every tensor of the checkpoint, with HF's names in HF's order (Mixtral's as its checkpoints name them)."""
    arch = config["architectures"][0]
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = _head_dim(config)
    specs = [TensorSpec("model.embed_tokens.weight", (config["vocab_size"], hidden), "matrix")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs.append(TensorSpec(p + "input_layernorm.weight", (hidden,), "norm"))
        for proj, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            specs.append(TensorSpec(f"{p}self_attn.{proj}_proj.weight", (rows, hidden), "matrix"))
            if arch == "Qwen2ForCausalLM":
                specs.append(TensorSpec(f"{p}self_attn.{proj}_proj.bias", (rows,), "bias"))
        specs.append(TensorSpec(p + "self_attn.o_proj.weight", (hidden, heads * head_dim), "matrix"))
        if arch == "Gemma3ForCausalLM":
            specs += [TensorSpec(p + "self_attn.q_norm.weight", (head_dim,), "norm"),
                      TensorSpec(p + "self_attn.k_norm.weight", (head_dim,), "norm"),
                      TensorSpec(p + "pre_feedforward_layernorm.weight", (hidden,), "norm"),
                      TensorSpec(p + "post_feedforward_layernorm.weight", (hidden,), "norm")]
        specs.append(TensorSpec(p + "post_attention_layernorm.weight", (hidden,), "norm"))
        if arch == "MixtralForCausalLM":
            specs.append(TensorSpec(p + "block_sparse_moe.gate.weight", (config["num_local_experts"], hidden),
                                    "router"))
            for e in range(config["num_local_experts"]):
                q = f"{p}block_sparse_moe.experts.{e}."
                specs += [TensorSpec(q + "w1.weight", (inter, hidden), "matrix"),
                          TensorSpec(q + "w2.weight", (hidden, inter), "matrix"),
                          TensorSpec(q + "w3.weight", (inter, hidden), "matrix")]
        else:
            specs += [TensorSpec(p + "mlp.gate_proj.weight", (inter, hidden), "matrix"),
                      TensorSpec(p + "mlp.up_proj.weight", (inter, hidden), "matrix"),
                      TensorSpec(p + "mlp.down_proj.weight", (hidden, inter), "matrix")]
    specs.append(TensorSpec("model.norm.weight", (hidden,), "norm"))
    if not config["tie_word_embeddings"]:
        specs.append(TensorSpec("lm_head.weight", (config["vocab_size"], hidden), "matrix"))
    return specs


def parameter_count(config: dict[str, Any]) -> int:
    return sum(math.prod(spec.shape) for spec in tensor_specs(config))


# ---- safetensors ------------------------------------------------------------------------------------------

def write_safetensors(out: Path, config: dict[str, Any], seed: int, shard_bytes: int) -> list[Path]:
    """bfloat16 shards of at most `shard_bytes` each (a tensor larger than that gets a shard of its own)."""
    import torch
    from safetensors.torch import save_file

    specs = tensor_specs(config)
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = 2 * math.prod(spec.shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for name, shard in zip(names, shards):
        tensors = {spec.name: _torch_values(spec, generator, config) for spec in shard}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update({spec.name: name for spec in shard})
        del tensors
    if len(names) > 1:
        total = sum(2 * math.prod(spec.shape) for spec in specs)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return [out / name for name in names]


def _torch_values(spec: TensorSpec, generator, config: dict[str, Any]):
    import torch

    if spec.kind == "norm":
        # Gemma scales by (1 + w): zeros there are the identity, as ones are elsewhere.
        gemma = config["architectures"][0].startswith("Gemma")
        return (torch.zeros if gemma else torch.ones)(spec.shape, dtype=torch.bfloat16)
    std = 1.0 if spec.kind == "router" else WEIGHT_STD  # a router's distinct scores pick distinct experts
    return (torch.randn(spec.shape, generator=generator) * std).to(torch.bfloat16)


# ---- GGUF ---------------------------------------------------------------------------------------------------

_GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "block_sparse_moe.gate": "ffn_gate_inp",
}
# Gemma's four norms: llama.cpp's ffn_norm is the one before the MLP there.
_GEMMA_BLOCK_NAMES = {**_GGUF_BLOCK_NAMES, "post_attention_layernorm": "post_attention_norm",
                      "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_EXPERT_NAMES = {"w1": "ffn_gate_exps", "w2": "ffn_down_exps", "w3": "ffn_up_exps"}
_FILE_TYPES = {"gguf-q8_0": "MOSTLY_Q8_0", "gguf-q4_0": "MOSTLY_Q4_0", "gguf-q4_k_m": "MOSTLY_Q4_K_M"}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: [experts,] rows (outputs), columns (inputs)
    qtype: str  # a GGMLQuantizationType name
    kind: str


def gguf_tensors(config: dict[str, Any], fmt: str) -> list[GgufTensor]:
    """The GGUF's tensors in llama.cpp's names, experts stacked, each with the type `fmt` gives it."""
    gemma = config["architectures"][0] == "Gemma3ForCausalLM"
    names = _GEMMA_BLOCK_NAMES if gemma else _GGUF_BLOCK_NAMES
    layers = config["num_hidden_layers"]
    out: list[GgufTensor] = []
    experts: dict[str, list[TensorSpec]] = {}
    for spec in tensor_specs(config):
        stem, _, suffix = spec.name.rpartition(".")
        if stem == "model.embed_tokens":
            gguf_name, layer, role = "token_embd", None, "output" if config["tie_word_embeddings"] else "embedding"
        elif stem == "lm_head":
            gguf_name, layer, role = "output", None, "output"
        elif stem == "model.norm":
            gguf_name, layer, role = "output_norm", None, "norm"
        else:
            index, module = stem.removeprefix("model.layers.").split(".", 1)
            layer = int(index)
            if ".experts." in module:
                expert_kind = module.rsplit(".", 1)[-1]
                experts.setdefault(f"blk.{layer}.{_EXPERT_NAMES[expert_kind]}", []).append(spec)
                continue
            gguf_name = f"blk.{layer}.{names[module]}"
            role = names[module]
        qtype = _gguf_type(fmt, spec.kind, role, layer, layers)
        out.append(GgufTensor(f"{gguf_name}.{suffix}", spec.shape, qtype, spec.kind))
    for name, parts in experts.items():
        layer = int(name.split(".")[1])
        role = "ffn_down" if name.endswith("ffn_down_exps") else "ffn"
        out.append(GgufTensor(f"{name}.weight", (len(parts), *parts[0].shape),
                              _gguf_type(fmt, "matrix", role, layer, layers), "matrix"))
    if config["architectures"][0] == "LlamaForCausalLM" and config["rope_parameters"].get("rope_type") == "llama3":
        out.append(GgufTensor("rope_freqs.weight", (_head_dim(config) // 2,), "F32", "rope"))
    return out


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for which layers' attn_v and ffn_down get Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _gguf_type(fmt: str, kind: str, role: str, layer: int | None, layers: int) -> str:
    if kind in ("norm", "bias", "router"):
        return "F32"
    if fmt == "gguf-q8_0":
        return "Q8_0"
    if fmt == "gguf-q4_0":
        return "Q6_K" if role == "output" else "Q4_0"
    if role == "output" or (role in ("attn_v", "ffn_down") and layer is not None and _more_bits(layer, layers)):
        return "Q6_K"
    return "Q4_K"


def write_gguf(path: Path, config: dict[str, Any], fmt: str, seed: int) -> Path:
    """One GGUF written tensor by tensor (gguf-py's writer, tensor infos first, then each tensor's data)."""
    import gguf

    arch = GGUF_ARCHITECTURES[config["architectures"][0]]
    tensors = gguf_tensors(config, fmt)
    writer = gguf_shape_writer(path, arch, config)
    _add_metadata(writer, arch, config, fmt)
    for tensor in tensors:
        qtype = gguf.GGMLQuantizationType[tensor.qtype]
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        *lead, cols = tensor.shape  # bytes per row: the blocks of its columns
        byte_shape = (*lead, cols // block * block_bytes)
        writer.add_tensor_info(tensor.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tensor in tensors:
        writer.write_tensor_data(_gguf_values(tensor, rng, config))
    writer.close()
    return path


# llama.cpp's `general.architecture` per HF architecture (it writes Mixtral as a Llama with experts).
GGUF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                      "Gemma3ForCausalLM": "gemma3"}


def gguf_shape_writer(path: Path, arch: str, config: dict[str, Any]):
    """A gguf-py writer holding the shape metadata every family's GGUF carries, from HF config fields."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    return writer


def _add_metadata(writer, arch: str, config: dict[str, Any], fmt: str) -> None:
    import gguf

    head_dim = _head_dim(config)
    rope = config["rope_parameters"]
    writer.add_name(f"random {config['architectures'][0]}")
    writer.add_file_type(gguf.LlamaFileType[_FILE_TYPES[fmt]])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"] if "full_attention" in rope else rope["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
    if "num_local_experts" in config:
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
    _add_tokenizer(writer, config["vocab_size"])


def _add_tokenizer(writer, vocab_size: int) -> None:
    """The embedded SmolLM2's tokenizer metadata, its token list padded with unused tokens to vocab_size."""
    import gguf

    from tokenmill.model.default_model import default_model_path

    reader = gguf.GGUFReader(str(default_model_path()))

    def strings(key: str) -> list[str]:
        f = reader.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def scalar(key: str):
        f = reader.fields[key]
        return f.parts[f.data[0]][0].item()

    tokens = strings("tokenizer.ggml.tokens")
    types = [int(reader.fields["tokenizer.ggml.token_type"].parts[i][0]) for i in
             reader.fields["tokenizer.ggml.token_type"].data]
    if vocab_size < len(tokens):
        raise ValueError(f"--vocab-size {vocab_size} is below the tokenizer's {len(tokens)} tokens")
    padding = vocab_size - len(tokens)
    writer.add_tokenizer_model(bytes(reader.fields["tokenizer.ggml.model"].parts[-1]).decode())
    writer.add_tokenizer_pre(bytes(reader.fields["tokenizer.ggml.pre"].parts[-1]).decode())
    writer.add_token_list(tokens + [f"<|unused_{i}|>" for i in range(padding)])
    writer.add_token_types(types + [gguf.TokenType.UNUSED] * padding)
    writer.add_token_merges(strings("tokenizer.ggml.merges"))
    writer.add_bos_token_id(scalar("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(scalar("tokenizer.ggml.eos_token_id"))
    writer.add_add_bos_token(False)
    template = reader.fields["tokenizer.chat_template"]
    writer.add_chat_template(bytes(template.parts[template.data[0]]).decode("utf-8"))


def _gguf_values(tensor: GgufTensor, rng: np.random.Generator, config: dict[str, Any]) -> np.ndarray:
    if tensor.kind == "rope":
        return _llama3_rope_factors(config).astype(np.float32)
    if tensor.kind == "norm":
        return np.ones(tensor.shape, dtype=np.float32)  # Gemma's are stored as 1 + w: ones = the identity there
    if tensor.kind in ("bias", "router"):
        return rng.normal(0.0, 1.0 if tensor.kind == "router" else WEIGHT_STD, tensor.shape).astype(np.float32)
    return random_blocks(rng, tensor.qtype, tensor.shape)


def random_blocks(rng: np.random.Generator, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random blocks of a GGML type, as uint8 [.., rows, bytes per row]: random quants and scales, with the
    float16 scales (d, dmin) set so the weights' standard deviation is near WEIGHT_STD."""
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    *lead, cols = shape
    count = math.prod(lead) * cols // block
    raw = np.frombuffer(rng.bytes(count * block_bytes), dtype=np.uint8).reshape(count, block_bytes).copy()

    def f16(offset: int, value: float) -> None:
        raw[:, offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)

    if qtype == "Q8_0":  # d, 32 int8 quants (-128 avoided: symmetric as llama.cpp's)
        raw[:, 2:][raw[:, 2:] == 128] = 129
        f16(0, WEIGHT_STD / 73.0)
    elif qtype == "Q4_0":  # d, 32 4-bit quants: w = d*(q - 8), q drawn from 1..15 so the weights' mean is 0
        low, high = rng.integers(1, 16, size=(2, count, 16), dtype=np.uint8)
        raw[:, 2:] = low | (high << 4)
        f16(0, WEIGHT_STD / 4.3)
    elif qtype == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of quants: w = d*s*q - dmin*m
        f16(0, WEIGHT_STD / 180.0)
        f16(2, 7.5 * WEIGHT_STD / 180.0)
    elif qtype == "Q6_K":  # 128 bytes low bits, 64 high bits, 16 int8 scales, d: w = d*s*(q - 32)
        raw[:, 192:208] = rng.integers(1, 32, size=(count, 16), dtype=np.uint8)
        f16(208, WEIGHT_STD / (17.0 * 18.5))
    else:
        raise ValueError(f"no random blocks for {qtype}")
    return raw.reshape(*lead, cols // block * block_bytes)


def _llama3_rope_factors(config: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores for llama3 rope scaling (rope_freqs)."""
    rope = config["rope_parameters"]
    head_dim = _head_dim(config)
    freqs = rope["rope_theta"] ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    original = rope["original_max_position_embeddings"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    smooth = (original / wavelen - low) / (high - low)
    return np.where(wavelen < original / high, 1.0,
                    np.where(wavelen > original / low, rope["factor"],
                             1.0 / ((1 - smooth) / rope["factor"] + smooth)))


# ---- the command --------------------------------------------------------------------------------------------

def make_checkpoint(out: Path, shape: str, fmt: str, *, layers: int | None = None, vocab_size: int | None = None,
                    seed: int = 0, shard_bytes: int = 2 * 1024**3) -> Path:
    """Writes the checkpoint into `out` (a directory) and returns what to pass as `--model`."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    config = shape_config(shape, layers, vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        write_safetensors(out, config, seed, shard_bytes)
        _tokenizer().save_pretrained(out)
        return out
    return write_gguf(out / f"{shape}-{fmt.removeprefix('gguf-')}.gguf", config, fmt, seed)


def _tokenizer():
    from tokenmill.model.loader import load_model_source

    return load_model_source(None).tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", help="output directory")
    parser.add_argument("--shape", choices=sorted(SHAPES))
    parser.add_argument("--format", choices=FORMATS, default="safetensors")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the shape has")
    parser.add_argument("--vocab-size", type=int, default=None, help="a smaller vocabulary (at least 49,152)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", type=float, default=2.0, help="GiB per safetensors shard (default 2)")
    parser.add_argument("--list", action="store_true", help="list the shapes with their parameter counts")
    args = parser.parse_args(argv)
    if args.list:
        for name, shape in SHAPES.items():
            print(f"{name:18s} {shape.architecture:20s} {parameter_count(shape_config(name)) / 1e9:6.2f}B  "
                  f"({shape.source})")
        return 0
    if args.out is None or args.shape is None:
        parser.error("OUT and --shape are required (or --list)")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be positive")
    try:
        path = make_checkpoint(args.out, args.shape, args.format, layers=args.layers, vocab_size=args.vocab_size,
                               seed=args.seed, shard_bytes=int(args.shard_size * 1024**3))
    except ValueError as exc:
        parser.error(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
