"""Tiny random models for tests, saved locally as safetensors."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.make_checkpoint import gguf_shape_writer


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


def build_thinking_llama(directory: Path, base_tokenizer, *, seed: int = 3):
    """A tiny random Llama whose tokenizer has `<think>` and `</think>` as tokens of their own (as reasoning
    models' tokenizers do); returns (directory, tokenizer)."""
    from transformers import AutoTokenizer

    base_tokenizer.save_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens(["<think>", "</think>"])
    return build_tiny_llama(directory, tokenizer, seed=seed), tokenizer


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
    return hf_greedy_batch(model, [prompt_ids], max_new_tokens)[0]


def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """`hf_greedy` of several prompts in one left-padded `generate` (HF derives each row's positions from
    its attention mask): the weights stream once per step for all of them, not once per prompt."""
    # generate() falls back to the model's own EOS ids wherever the config leaves them unset.
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    width = max(len(ids) for ids in prompts)
    padded = torch.tensor([[0] * (width - len(ids)) + list(ids) for ids in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], device=model.device)
    with torch.inference_mode():
        out = model.generate(padded, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)
    rows = [row[width:].tolist() for row in out]
    assert all(len(row) == max_new_tokens for row in rows)
    return rows


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


def write_gguf(path: Path, hf_dir: Path, *, arch: str = "llama", rope_linear: float | None = None,
               tensor_type=None) -> dict:
    """Convert a tiny HF checkpoint the way llama.cpp would (names, permuted q/k, quantized).

    tensor_type(hf_name) picks each tensor's GGML type (default_tensor_type when None).
    """
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf_shape_writer(path, arch, config)
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
    # A partial rotary (half of each head) under LongRoPE, as Phi-4-mini has: the golden prompts stay
    # below original_max_position_embeddings, so the short factors and the attention factor apply.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        tie_word_embeddings=False, max_position_embeddings=1024, original_max_position_embeddings=256,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                             short_factor=[1.0, 1.3, 2.1, 3.7], long_factor=[1.5, 4.0, 9.0, 20.0]),
        initializer_range=0.1)),
    # Caps small enough to bend these random weights' scores and logits (Gemma 2's own are 50 and 30).
    # query_pre_attn_scalar = head_dim: GGUF carries no scalar, and llama.cpp uses head_dim.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        tie_word_embeddings=True, head_dim=16, query_pre_attn_scalar=16, sliding_window=12, num_hidden_layers=4,
        attn_logit_softcapping=0.5, final_logit_softcapping=2.0, hidden_activation="gelu_pytorch_tanh",
        initializer_range=0.1)),
    # Sparse layers 0 and 2, a dense MLP in layer 1 (mlp_only_layers); 2 of 8 experts per token.
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        tie_word_embeddings=False, head_dim=16, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.1)),
    # Every layer sparse, 2 of 4 experts per token, no window (as Mixtral 8x7B's config has none).
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        tie_word_embeddings=False, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, sliding_window=None, initializer_range=0.1)),
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
            elif name.endswith(("mlp.gate.weight", "mlp.gate")):  # a router: distinct expert scores, no ties
                param.copy_(torch.randn_like(param))
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


_PHI3_GGUF_NAMES = {**_FAMILY_GGUF_NAMES, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_MOE_GGUF_NAMES = {**_FAMILY_GGUF_NAMES, "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
                   "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps"}
_FAMILY_NAMES = {"gemma2": _GEMMA_GGUF_NAMES, "gemma3": _GEMMA_GGUF_NAMES, "phi3": _PHI3_GGUF_NAMES,
                 "qwen3moe": _MOE_GGUF_NAMES, "mixtral": _MOE_GGUF_NAMES}
# llama.cpp writes Mixtral as a Llama with experts: its q/k rows permuted as Llama's.
_GGUF_ARCH = {"mixtral": "llama"}


def _add_family_metadata(writer, arch: str, config: dict, head_dim: int) -> None:
    """The keys llama.cpp's converter writes for these families beyond the shared shape."""
    import math

    import gguf

    rope = config["rope_parameters"]
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "phi3":
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if rope.get("rope_type") == "longrope":
            original = rope["original_max_position_embeddings"]
            factor = config["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(original)))
            writer.add_rope_scaling_orig_ctx_len(original)
            for kind in ("long", "short"):
                values = torch.tensor(rope[f"{kind}_factor"], dtype=torch.float32).numpy()
                writer.add_tensor(f"rope_factors_{kind}.weight", values, raw_dtype=gguf.GGMLQuantizationType.F32)
    if arch == "qwen3moe":
        writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])
    if arch == "mixtral":  # what llama.cpp's converter writes for Mixtral: the counts, nothing more
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert matrices (`...experts.3.gate_proj.weight`) stacked into one [E, out, in] tensor per
    layer and kind (`...experts.gate_proj.weight`), as GGUF stores them."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        prefix, sep, rest = name.partition(".mlp.experts.")
        if not sep:
            out[name] = tensor
            continue
        expert, _, part = rest.partition(".")
        stacks.setdefault(f"{prefix}.mlp.experts.{part}", {})[int(expert)] = tensor
    for name, experts in stacks.items():
        out[name] = torch.stack([experts[e] for e in sorted(experts)])
    return out


def _hf_expert_tensors(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked gate/up/down as the transformers 5 module holds them (gate_up_proj = gate rows, up rows)."""
    out = {name: value for name, value in stored.items() if ".experts." not in name}
    for name in stored:
        if name.endswith(".experts.gate_proj.weight"):
            prefix = name.removesuffix(".gate_proj.weight")
            out[f"{prefix}.gate_up_proj"] = torch.cat([stored[name], stored[f"{prefix}.up_proj.weight"]], dim=1)
            out[f"{prefix}.down_proj"] = stored[f"{prefix}.down_proj.weight"]
    return out


def write_family_gguf(path: Path, hf_dir: Path, arch: str) -> dict[str, torch.Tensor]:
    """Convert a tiny Qwen2/Qwen3/Qwen3-MoE/Gemma 2/Gemma 3/Phi-3/Mixtral checkpoint as llama.cpp does
    (q/k rows permuted for Mixtral only, a `llama` file with experts; Gemma's norms stored as 1 + w;
    experts stacked). Returns the HF tensors holding the values the file stores, for an HF model to run
    the same weights."""
    import re

    import gguf

    from tokenmill.model.registry import CHECKPOINT_RENAMES

    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    for pattern, replacement in CHECKPOINT_RENAMES.get(config["architectures"][0], ()):
        tensors = {re.sub(pattern, replacement, name): tensor for name, tensor in tensors.items()}
    tensors = _stack_experts(tensors)
    names = _FAMILY_NAMES.get(arch, _FAMILY_GGUF_NAMES)
    gemma = arch in ("gemma2", "gemma3")
    permuted = _GGUF_ARCH.get(arch) == "llama"
    writer = gguf_shape_writer(path, _GGUF_ARCH.get(arch, arch), config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config["rope_parameters"]
    writer.add_rope_freq_base((rope["full_attention"] if arch == "gemma3" else rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    _add_family_metadata(writer, arch, config, head_dim)
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        weight = tensor.float()
        if gemma and name.endswith("norm.weight"):
            weight = weight + 1
        kind = family_tensor_type(name)
        array = gguf.quants.quantize(weight.numpy(), kind)
        values = torch.from_numpy(gguf.quants.dequantize(array, kind).reshape(weight.shape).copy())
        stored[name] = values - 1 if gemma and name.endswith("norm.weight") else values
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            # Row blocks quantize alike in either order: the file holds the permuted rows of `values`.
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            array = gguf.quants.quantize(gguf_permute(weight, heads).numpy(), kind)
        stem, _, suffix = name.rpartition(".")
        stem = stem.removeprefix("model.")
        if stem.startswith("layers."):
            layer, module = stem.removeprefix("layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{names[module]}.{suffix}"
        else:
            gguf_name = f"{names['model.' + stem] if 'model.' + stem in names else names[stem]}.{suffix}"
        writer.add_tensor(gguf_name, array, raw_dtype=kind)
    finish_gguf(writer)
    return _hf_expert_tensors(stored)


# ---- LoRA adapters ------------------------------------------------------------------------------

def build_peft_adapter(directory: Path, base_dir: Path, *, seed: int, rank: int = 8, alpha: int = 16,
                       targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"), **lora_kwargs) -> Path:
    """A PEFT LoRA adapter with random A and B (B nonzero, unlike a fresh adapter's, so it changes the
    outputs) for the model in `base_dir`, saved as PEFT saves it."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                        **lora_kwargs)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.5 if "lora_B" in name else 1.0 / param.shape[-1] ** 0.5)
    model.save_pretrained(directory)
    return directory


def hf_with_adapter(base_dir: Path, adapter_dir: Path):
    """HF transformers' model of `base_dir` with the PEFT adapter applied (float32), the LoRA reference."""
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(base, adapter_dir).eval()
