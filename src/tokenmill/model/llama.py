"""The Llama family (Llama 2/3, SmolLM/SmolLM2, TinyLlama, Mistral without sliding window).

Runs on a flat token batch: hidden states are [num_tokens, hidden] with no batch dimension, and
attention reads/writes the paged KV cache through AttentionMetadata.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn
import torch.nn.functional as F

from tokenmill.model.layers.attention import AttentionBackend, AttentionMetadata
from tokenmill.model.layers.basic import RMSNorm, RotaryEmbedding, SiluAndMul
from tokenmill.model.layers.linear import INT8_KERNEL_MAX_ROWS, Int8BlockLinear, LinearFactory, replace_linear_layers


class LlamaAttention(nn.Module):
    def __init__(self, config, backend: AttentionBackend, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        # q, k and v projections fused into one matmul (weights concatenated at load time).
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.scale = self.head_dim ** -0.5
        self.backend = backend
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        rotated = self.rotary.apply_inplace(positions, qkv, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not rotated:
            q, k = self.rotary(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r}")
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, backend: AttentionBackend, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, kv_cache, meta):
        """x: this layer's input delta (or the embeddings for the first layer); residual: the stream.

        Returns (delta, residual); the stream after the layer is delta + residual. Carrying them apart
        lets the next norm fuse the add (same fp32 sums as x = x + f(x)).
        """
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    # Checkpoint names that are fused into one of our parameters: (ours, theirs, shard index).
    _FUSED = (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
              ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def __init__(self, config, backend: AttentionBackend, max_positions: int, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary = RotaryEmbedding(config, head_dim, max_positions, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, backend, self.rotary)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._int8_decode: Optional[tuple[Any, list[torch.Tensor]]] = None  # (kernels, per-layer tensors)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        rows = input_ids.numel()
        if (self._int8_decode is not None and meta.num_decodes == rows <= INT8_KERNEL_MAX_ROWS
                and meta.decode_block_tables is not None):
            return self._forward_int8_decode(input_ids, positions, kv_caches, meta)
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.norm(x, residual)[0]

    def enable_int8_decode(self, kernels: Any) -> bool:
        """Run decode-only steps of up to INT8_KERNEL_MAX_ROWS rows as one C++ call over the whole stack
        (`llama_decode_int8`).

        Same kernels in the same order as the layers, so the same bits; it skips ~0.2 ms of Python and
        dispatch per layer, most of a small decode step's non-matmul time. Needs every projection in
        block-int8 form and the rotary/norm kernels (use_cpu_kernels); returns whether it was enabled.
        """
        params: list[torch.Tensor] = []
        none = torch.empty(0)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if (not all(isinstance(linear, Int8BlockLinear) for linear in linears)
                    or layer.input_layernorm.kernels is None):
                return False
            qkv, o, gate_up, down = ([linear.q, linear.scales, none if linear.mins is None else linear.mins,
                                      none if linear.bias is None else linear.bias] for linear in linears)
            params += [layer.input_layernorm.weight, *qkv, *o, layer.post_attention_layernorm.weight, *gate_up, *down]
        self._int8_decode = (kernels, params)
        return True

    def _forward_int8_decode(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                             meta: AttentionMetadata) -> torch.Tensor:
        kernels, params = self._int8_decode
        attn = self.layers[0].self_attn
        return kernels.llama_decode_int8(
            self.embed_tokens(input_ids), positions, meta.slot_mapping, meta.decode_block_tables,
            meta.decode_context_lens, kv_caches, params, self.norm.weight, self.rotary.cos, self.rotary.sin,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, self.norm.eps, attn.scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def convert_linear_layers(self, make: LinearFactory) -> None:
        """After loading: every projection and the LM head rebuilt by make(name, weight, bias) (packed,
        block-int8).

        A tied head gets its own converted copy; the embedding lookup keeps its plain weights.
        """
        replace_linear_layers(self, make)
        if self.lm_head is None:
            self.lm_head = make("lm_head", self.embed_tokens.weight, None)

    def checkpoint_weight_names(self, module_name: str) -> list[str]:
        """The checkpoint tensors whose rows, stacked in order, are this linear module's weight."""
        if module_name == "lm_head":
            return ["model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"]
        prefix, _, leaf = module_name.rpartition(".")
        parts = [theirs for ours, theirs, _ in self._FUSED if ours == leaf] or [leaf]
        return [f"model.{prefix}.{part}.weight" for part in parts]

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            target, shard = self._map_name(name)
            if target not in params:
                raise KeyError(f"unexpected weight {name}")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    param.copy_(tensor)
                else:
                    offset, size = self._shard_range(target, shard)
                    param[offset:offset + size].copy_(tensor)
            loaded.add(f"{target}#{shard}")
        missing = [n for n in params if not any(key.startswith(n + "#") for key in loaded)]
        if missing:
            raise KeyError(f"weights missing from the checkpoint: {missing[:5]}")

    def _map_name(self, name: str) -> tuple[str, int | None]:
        for ours, theirs, shard in self._FUSED:
            if f".{theirs}." in name:
                return name.replace(f".{theirs}.", f".{ours}."), shard
        return name, None

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        if ".qkv_proj." in target:
            attn = self.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]
