"""Qwen2 / Qwen2.5 (biases on the q/k/v projection) and Qwen3 (an RMSNorm over each q and k head).

Both are the shared decoder otherwise: pre-norms, SiLU MLP, one rotary table. Sliding windows come
from the config's `layer_types` (none unless `use_sliding_window`).
"""
from __future__ import annotations

from tokenmill.model.causal_lm import DecoderForCausalLM
from tokenmill.model.layers.decoder import DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def build_spec(cls, config) -> DecoderSpec:
        return DecoderSpec.from_config(config, qkv_bias=True, activation=config.hidden_act)


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def build_spec(cls, config) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec.from_config(config, qkv_bias=bias, o_bias=bias, qk_norm=True,
                                       activation=config.hidden_act)
