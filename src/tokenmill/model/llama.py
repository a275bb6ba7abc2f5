"""The Llama family (Llama 2/3, SmolLM/SmolLM2, TinyLlama), Mistral (sliding window on every layer) and
Mixtral (Mistral's attention with a sparse mixture-of-experts MLP in every layer).

The plain shared decoder: pre-norms, SiLU MLP, one rotary table; optional biases from the config.
Mixtral's MoE block is Qwen3-MoE's (layers/moe.py) with its top-k weights always renormalized, as
transformers' MixtralTopKRouter does; its checkpoints' names (block_sparse_moe, experts.N.w1/w2/w3) are
renamed as they are read (registry.CHECKPOINT_RENAMES).
"""
from __future__ import annotations

from tokenmill.model.causal_lm import DecoderForCausalLM
from tokenmill.model.layers.decoder import DecoderSpec


def _silu(config) -> str:
    """The config's activation, which must be SiLU (ValueError otherwise: the model is refused)."""
    activation = getattr(config, "hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"unsupported activation {activation!r}")
    return activation


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def build_spec(cls, config) -> DecoderSpec:
        _silu(config)
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec.from_config(config, qkv_bias=bias, o_bias=bias,
                                       mlp_bias=bool(getattr(config, "mlp_bias", False)))


class MixtralForCausalLM(DecoderForCausalLM):
    @classmethod
    def build_spec(cls, config) -> DecoderSpec:
        return DecoderSpec.from_config(
            config, activation=_silu(config), layer_sparse=(True,) * config.num_hidden_layers,
            num_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.intermediate_size, norm_topk_prob=True)
