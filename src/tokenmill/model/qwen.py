"""Qwen2 / Qwen2.5 (biases on the q/k/v projection), Qwen3 (an RMSNorm over each q and k head) and
Qwen3-MoE (Qwen3's attention with a sparse mixture-of-experts MLP, layers/moe.py).

All are the shared decoder otherwise: pre-norms, SiLU MLP, one rotary table. Sliding windows come
from the config's `layer_types` (none unless `use_sliding_window`). In Qwen3-MoE layer i's MLP is
sparse when i + 1 is a multiple of `decoder_sparse_step` and i is not in `mlp_only_layers` (as
transformers decides), dense otherwise.
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


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    @classmethod
    def build_spec(cls, config) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = tuple(i not in dense and config.num_experts > 0 and (i + 1) % step == 0
                       for i in range(config.num_hidden_layers))
        return DecoderSpec.from_config(
            config, qkv_bias=bias, o_bias=bias, qk_norm=True, activation=config.hidden_act, layer_sparse=sparse,
            num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob))
