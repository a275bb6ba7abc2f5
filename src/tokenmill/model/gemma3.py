"""Gemma 3 (text): the shared decoder with Gemma's switches.

Embeddings scaled by sqrt(hidden); RMSNorms that scale by (1 + w) (folded into w at load); norms
before *and* after attention and the MLP; GELU-tanh; q/k head norms; attention scaled by
query_pre_attn_scalar ** -0.5; local layers with a sliding window and their own rotary base
(`rope_parameters["sliding_attention"]`) interleaved with global ones (`layer_types`).
"""
from __future__ import annotations

from tokenmill.model.causal_lm import DecoderForCausalLM
from tokenmill.model.layers.decoder import DecoderSpec


class Gemma3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def build_spec(cls, config) -> DecoderSpec:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("bidirectional (embedding) Gemma 3 models are not supported")
        return DecoderSpec.from_config(
            config,
            qk_norm=True,
            activation=config.hidden_activation,
            sandwich_norms=True,
            norm_weight_offset=1.0,
            embed_scale=config.hidden_size ** 0.5,
            attn_scale=config.query_pre_attn_scalar ** -0.5,
            layer_rope=tuple(config.layer_types),
            attn_softcap=getattr(config, "attn_logit_softcapping", None),
            final_logit_softcap=getattr(config, "final_logit_softcapping", None),
        )
