"""Gemma 2: Gemma 3's layer without q/k head norms and with soft-capped attention scores.

Embeddings scaled by sqrt(hidden); RMSNorms that scale by (1 + w) (folded into w at load); norms
before and after attention and the MLP; GELU-tanh; attention scaled by query_pre_attn_scalar ** -0.5
with every score capped as cap * tanh(score / cap) (`attn_logit_softcapping`, in every attention path:
see layers/attention.py); local sliding-window layers alternating with global ones (`layer_types`),
all with one rotary table; final logits capped the same way (`final_logit_softcapping`).
"""
from __future__ import annotations

from tokenmill.model.causal_lm import DecoderForCausalLM
from tokenmill.model.layers.decoder import DecoderSpec


class Gemma2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def build_spec(cls, config) -> DecoderSpec:
        return DecoderSpec.from_config(
            config,
            activation=config.hidden_activation,
            sandwich_norms=True,
            norm_weight_offset=1.0,
            embed_scale=config.hidden_size ** 0.5,
            attn_scale=config.query_pre_attn_scalar ** -0.5,
            attn_softcap=getattr(config, "attn_logit_softcapping", None),
            final_logit_softcap=getattr(config, "final_logit_softcapping", None),
        )
