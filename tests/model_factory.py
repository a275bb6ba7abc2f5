"""Tiny random models for tests, saved locally as safetensors."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def build_tiny_llama(directory: Path, tokenizer, *, seed: int = 0, **overrides) -> Path:
    """A random LlamaForCausalLM small enough for CPU tests, saved as safetensors with a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


# Prompts of mixed lengths for greedy parity tests against HF transformers.
GOLDEN_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a king who had three daughters. The eldest was",
    "1, 2, 3, 4, 5,",
    "Q: What is the boiling point of water at sea level?\nA:",
    "List three primary colors:",
    "In machine learning, a transformer is a deep learning architecture that relies on the attention mechanism, "
    "first described in the 2017 paper. Unlike recurrent networks, transformers process all tokens of a sequence "
    "in parallel, which makes them efficient to train on modern hardware. Explain why:",
    "Hi",
]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy `generate` that, like ignore_eos, neither stops at nor suppresses EOS."""
    # generate() falls back to the model's own EOS ids wherever the config leaves them unset.
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)
    tokens = out[0, len(prompt_ids):].tolist()
    assert len(tokens) == max_new_tokens
    return tokens


# ---- GGUF files written the way llama.cpp's converter writes them --------------------------------

def gguf_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows: per head, [x0..x{d/2-1}, y0..] -> [x0, y0, x1, y1, ...]."""
    head_dim = weight.shape[0] // num_heads
    per_head = weight.reshape(num_heads, head_dim, *weight.shape[1:])
    out = torch.empty_like(per_head)
    out[:, 0::2] = per_head[:, : head_dim // 2]
    out[:, 1::2] = per_head[:, head_dim // 2 :]
    return out.reshape(weight.shape)


_GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    stem = hf_name.removesuffix(".weight")
    if stem.startswith("model.layers."):
        layer, module = stem.removeprefix("model.layers.").split(".", 1)
        return f"blk.{layer}.{_GGUF_NAMES[module]}.weight"
    return f"{_GGUF_NAMES[stem]}.weight"


def default_tensor_type(hf_name: str):
    from gguf import GGMLQuantizationType as T

    if hf_name.endswith("norm.weight"):
        return T.F32
    if "embed_tokens" in hf_name or "lm_head" in hf_name:
        return T.F16
    if "mlp." in hf_name:
        return T.BF16
    return T.Q8_0  # attention projections, q/k included, so the unpermute runs after dequantization


def _gguf_writer(path: Path, arch: str, config: dict):
    """A GGUF writer with the shape metadata every family shares."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    return writer


def write_gguf(path: Path, hf_dir: Path, *, arch: str = "llama", rope_linear: float | None = None,
               tensor_type=None) -> dict:
    """Convert a tiny HF checkpoint the way llama.cpp would (names, permuted q/k, quantized).

    tensor_type(hf_name) picks each tensor's GGML type (default_tensor_type when None).
    """
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    writer = _gguf_writer(path, arch, config)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    if rope_linear is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_linear)
    # no vocab_size and no tokenizer metadata: the loader must count the embedding rows
    for name, tensor in tensors.items():
        weight = tensor.float()
        if name.endswith("q_proj.weight"):
            weight = gguf_permute(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = gguf_permute(weight, config["num_key_value_heads"])
        kind = (tensor_type or default_tensor_type)(name)
        array = gguf.quants.quantize(weight.numpy(), kind)
        writer.add_tensor(_gguf_name(name), array, raw_dtype=kind)
    finish_gguf(writer)
    return tensors


def finish_gguf(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# A GGUF mixing every block type the int8 kernels keep (q/k with mins and permuted rows, v and gate
# without), as llama.cpp's mixed "_M" files do; norms and the embedding stay float.
MIXED_GGUF_TYPES = {"q_proj": "Q4_1", "k_proj": "Q5_1", "v_proj": "Q5_0", "o_proj": "Q4_1",
                    "gate_proj": "Q4_0", "up_proj": "Q4_1", "down_proj": "Q8_0", "lm_head": "Q4_1",
                    "embed_tokens": "Q8_0"}


def mixed_gguf_type(hf_name: str):
    from gguf import GGMLQuantizationType

    module = hf_name.removesuffix(".weight").rsplit(".", 1)[-1]
    return GGMLQuantizationType[MIXED_GGUF_TYPES.get(module, "F32")]


# ---- other families --------------------------------------------------------------------------

# Tiny configs shaped like the real ones (Qwen2.5-0.5B and Gemma 3 tie their embeddings, Qwen3-8B
# does not); Gemma 3's window is shorter than the golden prompts so local layers really slide.
TINY_FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, sliding_window=32,
                                                     use_sliding_window=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=16)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        # GGUF carries neither the layer pattern nor query_pre_attn_scalar: llama.cpp and transformers
        # assume Gemma 3's (five local layers, then a global one; 256), so the tiny model keeps them.
        tie_word_embeddings=True, head_dim=16, query_pre_attn_scalar=256, sliding_window=12, num_hidden_layers=6,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, hidden_activation="gelu_pytorch_tanh")),
    # Every layer windowed (Mistral), with a window far shorter than the long prompts.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=12)),
}


def build_tiny_family(directory: Path, tokenizer, family: str, *, seed: int = 0) -> Path:
    """A random model of `family` (TINY_FAMILIES), saved as safetensors with a tokenizer.

    Norm weights and biases are randomized too (HF initializes them to constants), so a mix-up of
    norms, a missing (1 + w) or a dropped bias changes the tokens.
    """
    import transformers

    config_name, model_name, extra = TINY_FAMILIES[family]
    settings = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    settings.update(extra)
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**settings)
    config.architectures = [model_name]
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


_FAMILY_GGUF_NAMES = {
    **_GGUF_NAMES, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
_GEMMA_GGUF_NAMES = {
    **_FAMILY_GGUF_NAMES, "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}


def family_tensor_type(hf_name: str):
    """Q8_0 for the projections (kept as int8 blocks where the kernels run), F32 for the rest."""
    from gguf import GGMLQuantizationType as T

    return T.Q8_0 if hf_name.endswith("proj.weight") else T.F32


def write_family_gguf(path: Path, hf_dir: Path, arch: str) -> dict[str, torch.Tensor]:
    """Convert a tiny Qwen2/Qwen3/Gemma 3 checkpoint as llama.cpp does (no q/k permutation for these;
    Gemma's norms stored as 1 + w). Returns the HF tensors holding the values the file stores, for an
    HF model to run the same weights."""
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    names = _GEMMA_GGUF_NAMES if arch == "gemma3" else _FAMILY_GGUF_NAMES
    writer = _gguf_writer(path, arch, config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config["rope_parameters"]
    writer.add_rope_freq_base((rope["full_attention"] if arch == "gemma3" else rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        weight = tensor.float()
        if arch == "gemma3" and name.endswith("norm.weight"):
            weight = weight + 1
        kind = family_tensor_type(name)
        array = gguf.quants.quantize(weight.numpy(), kind)
        values = torch.from_numpy(gguf.quants.dequantize(array, kind).reshape(weight.shape).copy())
        stored[name] = values - 1 if arch == "gemma3" and name.endswith("norm.weight") else values
        stem, _, suffix = name.rpartition(".")
        stem = stem.removeprefix("model.")
        if stem.startswith("layers."):
            layer, module = stem.removeprefix("layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{names[module]}.{suffix}"
        else:
            gguf_name = f"{names['model.' + stem] if 'model.' + stem in names else names[stem]}.{suffix}"
        writer.add_tensor(gguf_name, array, raw_dtype=kind)
    finish_gguf(writer)
    return stored
