"""Which GGUF `general.architecture` values tokenmill serves, and how each maps onto a transformers model:
its config class, llama.cpp's tensor names per block, and the config fields only some families'
metadata (or tensor list) carries (`family_settings`). gguf_loader reads the file; this module holds
the per-family knowledge.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class GgufFamily:
    """How one `general.architecture` value maps onto a transformers model."""

    hf_architecture: str
    config_class_name: str  # attribute of `transformers`, resolved lazily (importing it is slow)
    unpermute_qk: bool  # llama.cpp reorders q/k rows only for some families (llama yes, qwen2 no)
    block_names: dict[str, str] = field(default_factory=lambda: _BLOCK_TENSOR_NAMES)
    # llama.cpp's converter stores Gemma's norm weights as 1 + w; transformers subtracts the 1 again
    # on load (and adds it per call), so the loader does the same to get the same float32 values.
    norm_offset: float = 0.0
    # A token that ends a chat turn and, like llama.cpp's end-of-generation set, stops generation
    # besides the file's EOS (HF lists it in eos_token_id, e.g. Gemma 3's [1, 106]).
    end_of_turn_token: str | None = None


_BLOCK_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's four norms per block: llama.cpp's ffn_norm is the one *before* the MLP there.
_GEMMA_NORM_NAMES = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                     "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}

# Phi-3 stores q/k/v and gate/up fused, as its HF checkpoints do (ffn_up holds gate rows, then up rows).
_PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
               "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# Qwen3-MoE: the router and every expert's matrices stacked into one [experts, out, in] tensor each.
_MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
              "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}

# Mixtral: llama.cpp writes it as `llama` with experts (`llama.expert_count`), q/k rows permuted as Llama's.
LLAMA_WITH_EXPERTS = GgufFamily("MixtralForCausalLM", "MixtralConfig", unpermute_qk=True,
                                block_names={**_BLOCK_TENSOR_NAMES, **_MOE_NAMES})

# Add a family here together with its tensor names and a model implementation (registry.py).
GGUF_FAMILIES: dict[str, GgufFamily] = {
    "llama": GgufFamily("LlamaForCausalLM", "LlamaConfig", unpermute_qk=True),
    "qwen2": GgufFamily("Qwen2ForCausalLM", "Qwen2Config", unpermute_qk=False),
    "qwen3": GgufFamily("Qwen3ForCausalLM", "Qwen3Config", unpermute_qk=False,
                        block_names={**_BLOCK_TENSOR_NAMES, **_QK_NORM_NAMES}),
    "qwen3moe": GgufFamily("Qwen3MoeForCausalLM", "Qwen3MoeConfig", unpermute_qk=False,
                           block_names={**_BLOCK_TENSOR_NAMES, **_QK_NORM_NAMES, **_MOE_NAMES}),
    "gemma2": GgufFamily("Gemma2ForCausalLM", "Gemma2Config", unpermute_qk=False,
                         block_names={**_BLOCK_TENSOR_NAMES, **_GEMMA_NORM_NAMES},
                         norm_offset=1.0, end_of_turn_token="<end_of_turn>"),
    "gemma3": GgufFamily("Gemma3ForCausalLM", "Gemma3TextConfig", unpermute_qk=False,
                         block_names={**_BLOCK_TENSOR_NAMES, **_QK_NORM_NAMES, **_GEMMA_NORM_NAMES},
                         norm_offset=1.0, end_of_turn_token="<end_of_turn>"),
    "phi3": GgufFamily("Phi3ForCausalLM", "Phi3Config", unpermute_qk=False, block_names=_PHI3_NAMES),
}


def block_tensor_names() -> dict[str, str]:
    """llama.cpp's names of a Llama block's tensors -> their HF module names."""
    return dict(_BLOCK_TENSOR_NAMES)


def family_settings(arch: str, settings: dict[str, Any], metadata: Callable[[str], Any], tensors: Sequence[Any],
                    path: Path) -> None:
    """The config fields only some families' metadata (or tensor list) carries, added to `settings`.

    metadata(key) reads the file's `{arch}.{key}` metadata (None when absent); tensors are the file's."""
    tensor_names = {tensor.name for tensor in tensors}
    if arch in ("gemma2", "gemma3", "phi3"):
        settings["sliding_window"] = metadata("attention.sliding_window")
    if arch == "gemma3":
        # Only the global layers' base is in the file; the local base, query_pre_attn_scalar and the
        # layer pattern take Gemma3TextConfig's defaults, as transformers' own GGUF loading does.
        settings["rope_theta"] = settings.pop("rope_parameters")["rope_theta"]
    elif arch == "gemma2":
        # The layer pattern (local first, alternating) is Gemma2Config's default, as llama.cpp assumes.
        # query_pre_attn_scalar is not stored: llama.cpp scales by head_dim except in the 27B model
        # (46 blocks), which scales by hidden / heads; the same rule here.
        heads = settings["num_attention_heads"]
        large = settings["num_hidden_layers"] == 46
        settings["query_pre_attn_scalar"] = settings["hidden_size"] // heads if large else settings["head_dim"]
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if metadata(key) is not None:
                settings[key] = float(metadata(key))
    elif arch == "phi3":
        settings["rope_parameters"].update(_phi3_rope(metadata, settings, tensors, path))
        if "original_max_position_embeddings" in settings["rope_parameters"]:
            settings["original_max_position_embeddings"] = settings["rope_parameters"][
                "original_max_position_embeddings"]
    elif arch == "llama" and metadata("expert_count"):
        # Mixtral: every block sparse, its top-k weights always renormalized; feed_forward_length is each
        # expert's width. No window (llama.cpp stores none for it).
        settings.update(num_local_experts=int(metadata("expert_count")),
                        num_experts_per_tok=int(metadata("expert_used_count")), sliding_window=None)
    elif arch == "qwen3moe":
        layers = settings["num_hidden_layers"]
        settings.update(
            num_experts=int(metadata("expert_count")), num_experts_per_tok=int(metadata("expert_used_count")),
            moe_intermediate_size=int(metadata("expert_feed_forward_length")),
            # llama.cpp always renormalizes Qwen3-MoE's top-k weights unless the file says otherwise.
            norm_topk_prob=bool(True if metadata("expert_weights_norm") is None else metadata("expert_weights_norm")),
            # A block without a router has a dense MLP (transformers' mlp_only_layers).
            mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names])


def _phi3_rope(metadata: Callable[[str], Any], settings: dict[str, Any], tensors: Sequence[Any],
               path: Path) -> dict[str, Any]:
    """Phi-3's partial rotary (rope.dimension_count) and LongRoPE factors (rope_factors_* tensors)."""
    params: dict[str, Any] = {}
    dims = metadata("rope.dimension_count")
    if dims is not None and int(dims) != settings["head_dim"]:
        params["partial_rotary_factor"] = int(dims) / settings["head_dim"]
    factors = {}
    for tensor in tensors:
        if tensor.name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            if tensor.tensor_type.name != "F32":
                raise ModelLoadError(f"{tensor.name} in {path.name} is {tensor.tensor_type.name}, expected F32")
            factors[tensor.name.split("_")[2].split(".")[0]] = [float(x) for x in np.asarray(tensor.data).ravel()]
    if "long" not in factors:
        return params
    original = metadata("rope.scaling.original_context_length")
    if original is None or "short" not in factors:
        raise ModelLoadError(f"{path.name} has LongRoPE factors without the short set or the original context length")
    params.update(rope_type="longrope", long_factor=factors["long"], short_factor=factors["short"],
                  original_max_position_embeddings=int(original))
    attn_factor = metadata("rope.scaling.attn_factor")
    scale = settings["max_position_embeddings"] / int(original)
    default = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1 else 1.0
    # The converter writes transformers' default factor, rounded to float32: leave it to the formula then.
    if attn_factor is not None and abs(float(attn_factor) - default) > 1e-6 * default:
        params["attention_factor"] = float(attn_factor)
    return params
