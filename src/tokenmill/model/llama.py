"""The Llama family (Llama 2/3, SmolLM/SmolLM2, TinyLlama) and Mistral (sliding window on every layer).

The plain shared decoder: pre-norms, SiLU MLP, one rotary table; optional biases from the config.
"""
from __future__ import annotations

from tokenmill.model.causal_lm import DecoderForCausalLM
from tokenmill.model.layers.decoder import DecoderSpec


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def build_spec(cls, config) -> DecoderSpec:
        activation = getattr(config, "hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"unsupported activation {activation!r}")
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec.from_config(config, qkv_bias=bias, o_bias=bias,
                                       mlp_bias=bool(getattr(config, "mlp_bias", False)))
