"""Phi-3 / Phi-3.5-mini / Phi-4-mini (`Phi3ForCausalLM`): the Llama layer with its projections fused
in the checkpoint.

Phi-3 stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (gate rows first), which are
exactly the shared decoder's fused layers, so they load as they are. Partial rotary
(`partial_rotary_factor`, Phi-4-mini) and LongRoPE (`rope_scaling` longrope / su, the 128k models)
are RotaryEmbedding's; a sliding window (Phi-3-mini's 2047) applies to every layer, as transformers
applies it.
"""
from __future__ import annotations

from tokenmill.model.causal_lm import DecoderForCausalLM
from tokenmill.model.layers.decoder import DecoderSpec


class Phi3ForCausalLM(DecoderForCausalLM):
    _FUSED = ()  # the checkpoint's qkv_proj and gate_up_proj are our layers' weights as they are

    @classmethod
    def build_spec(cls, config) -> DecoderSpec:
        activation = getattr(config, "hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"unsupported activation {activation!r}")
        return DecoderSpec.from_config(config, activation=activation)
