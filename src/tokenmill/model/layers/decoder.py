"""The decoder block every dense family is built from: attention + gated MLP between RMSNorms.

Families differ in a handful of switches, gathered in `DecoderSpec`: biases on the q/k/v projection
(Qwen2), a per-head RMSNorm on q and k before the rotary (Qwen3, Gemma 3), norms after attention and
after the MLP as well as before them (Gemma), the activation (SiLU, GELU-tanh), the attention scale,
per-layer sliding windows and rotary tables (Mistral, Gemma 3's local layers), attention logit
soft-capping (Gemma 2), and a sparse mixture-of-experts MLP in some or all layers (Qwen3-MoE,
layers/moe.py). A partial rotary (Phi-4-mini) is the config's, read by RotaryEmbedding. A family reads its
HF config into a spec; the modules here keep HF's parameter names (`self_attn.q_norm`,
`pre_feedforward_layernorm` ...) so checkpoints map onto them with only the q/k/v and gate/up fusion.

Runs on a flat token batch: hidden states are [num_tokens, hidden] with no batch dimension, and
attention reads/writes the paged KV cache through AttentionMetadata.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from tokenmill.model.layers.attention import AttentionBackend, AttentionMetadata
from tokenmill.model.layers.basic import RMSNorm, RotaryEmbedding, make_gated_activation
from tokenmill.model.layers.moe import SparseMoeBlock


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k, before the rotary
    activation: str = "silu"
    sandwich_norms: bool = False  # also norm the attention and MLP outputs (Gemma)
    norm_weight_offset: float = 0.0  # Gemma's norms scale by (1 + w): folded into w at load
    embed_scale: Optional[float] = None  # Gemma: embeddings times sqrt(hidden)
    attn_scale: Optional[float] = None  # None: head_dim ** -0.5
    layer_windows: tuple[Optional[int], ...] = ()  # per layer: sliding window, or None for full attention
    layer_rope: tuple[Optional[str], ...] = ()  # per layer: key of its rotary table (None: the config's one)
    tie_word_embeddings: bool = False
    final_logit_softcap: Optional[float] = None
    attn_softcap: Optional[float] = None  # Gemma 2: attention scores capped as cap * tanh(score / cap)
    # Mixture of experts: per layer, whether its MLP is the sparse block (else the dense one).
    layer_sparse: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @classmethod
    def from_config(cls, config, **family: object) -> "DecoderSpec":
        """The fields every HF decoder config spells the same way; `family` sets the rest."""
        num_heads = config.num_attention_heads
        settings: dict = dict(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            layer_windows=layer_windows(config),
        )
        settings.update(family)
        if not settings.get("layer_rope"):
            settings["layer_rope"] = (None,) * settings["num_layers"]
        if not settings.get("layer_sparse"):
            settings["layer_sparse"] = (False,) * settings["num_layers"]
        return cls(**settings)


def layer_windows(config) -> tuple[Optional[int], ...]:
    """Each layer's sliding window as transformers applies it.

    Configs with `layer_types` (Qwen2/3, Gemma 3) window exactly the "sliding_attention" layers (Qwen
    lists none of them unless `use_sliding_window`); older ones (Mistral) window every layer when
    `sliding_window` is set.
    """
    count = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(window if kind == "sliding_attention" and window else None for kind in types)
    return (window or None,) * count


# Tensor parallelism: the sum over ranks of a row-parallel projection's partial outputs.
Reduce = Callable[[torch.Tensor], torch.Tensor]


class DecoderAttention(nn.Module):
    def __init__(self, spec: DecoderSpec, backend: AttentionBackend, rotary: RotaryEmbedding,
                 window: Optional[int], reduce: Optional[Reduce] = None) -> None:
        super().__init__()
        self.reduce = reduce
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v projections fused into one matmul (weights concatenated at load time).
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.scale = spec.scale
        self.window = window
        self.softcap = spec.attn_softcap
        self.backend = backend
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            rows = qkv.shape[0]
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(rows, self.q_size)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(rows, self.kv_size)
            # One contiguous row again, so the fused rotary can rotate q and k in place.
            qkv = torch.cat([q, k, v], dim=-1)
        rotated = self.rotary.apply_inplace(positions, qkv, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not rotated:
            q, k = self.rotary(positions, q, k)
        if self.softcap is not None:
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        elif self.window is None:
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        else:
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale, window=self.window)
        out = self.o_proj(out.reshape(-1, self.q_size))
        return out if self.reduce is None else self.reduce(out)


class DecoderMLP(nn.Module):
    def __init__(self, spec: DecoderSpec, reduce: Optional[Reduce] = None) -> None:
        super().__init__()
        self.reduce = reduce
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.act = make_gated_activation(spec.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act(self.gate_up_proj(x)))
        return out if self.reduce is None else self.reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, backend: AttentionBackend, rotary: RotaryEmbedding,
                 window: Optional[int], sparse: bool = False, reduce: Optional[Reduce] = None) -> None:
        """sparse: a mixture-of-experts MLP. reduce: under tensor parallelism, the all-reduce after
        o_proj and down_proj (row-parallel) and after the experts' routed sum."""
        super().__init__()
        self.self_attn = DecoderAttention(spec, backend, rotary, window, reduce)
        self.mlp: nn.Module
        if sparse:
            self.mlp = SparseMoeBlock(spec.hidden_size, spec.moe_intermediate_size, spec.num_experts,
                                      spec.num_experts_per_tok, spec.norm_topk_prob, spec.activation, reduce)
        else:
            self.mlp = DecoderMLP(spec, reduce)
        eps = spec.rms_norm_eps
        self.input_layernorm = RMSNorm(spec.hidden_size, eps)
        # Llama: the norm before the MLP. Gemma (sandwich): the norm of the attention output, with
        # pre_/post_feedforward_layernorm around the MLP.
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, eps)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input delta (or the embeddings for the first layer); residual: the stream.

        Returns (delta, residual); the stream after the layer is delta + residual. Carrying them apart
        lets the next norm fuse the add (same fp32 sums as x = x + f(x)).
        """
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta)
        if self.sandwich:
            h = self.post_attention_layernorm(h)
            h, residual = self.pre_feedforward_layernorm(h, residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual
