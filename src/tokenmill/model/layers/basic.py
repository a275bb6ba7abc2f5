"""Norm, rotary embedding and activation layers shared by decoder models.

Each layer has a torch implementation and, when the runner hands it tokenmill's C++ CPU kernels
(`use_cpu_kernels`), a fused one that does the same arithmetic in one pass over memory.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("tokenmill")

_NO_RESIDUAL = torch.empty(0)


class RMSNorm(nn.Module):
    """RMSNorm; called with a residual, it first adds x into it (x + residual) and normalizes the sum.

    The fused form returns (normed, new residual), so a decoder layer carries the residual stream
    without a separate add op (the sums are the same fp32 adds as `x = x + f(x)`).
    """

    kernels: Optional[Any] = None

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if self.kernels is not None and x.dim() == 2:
            out = self.kernels.rms_norm(x.contiguous(), _NO_RESIDUAL if residual is None else residual,
                                        self.weight, self.eps)  # residual is updated in place
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 as the reference implementations do, then return to the input dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SiluAndMul(nn.Module):
    """silu(gate) * up for the fused [rows, 2 * intermediate] gate/up projection output."""

    kernels: Optional[Any] = None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and gate_up.dim() == 2:
            return self.kernels.silu_and_mul(gate_up.contiguous())
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up (Gemma's MLP); no fused kernel, so it always runs the torch ops."""

    kernels: Optional[Any] = None  # accepted for symmetry with SiluAndMul; unused

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def make_gated_activation(name: str) -> nn.Module:
    """The `act(gate) * up` layer for an HF `hidden_act` / `hidden_activation` name."""
    if name == "silu":
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return GeluTanhAndMul()
    raise ValueError(f"unsupported activation {name!r}")


def rope_parameters(config, layer_type: Optional[str] = None) -> tuple[str, float]:
    params = _rope_dict(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    return rope_type, float(theta)


def _rope_dict(config, layer_type: Optional[str] = None) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    # Families with several attention kinds (Gemma 3) keep one rope dict per layer type.
    return params[layer_type] if layer_type is not None else params


def rotary_dim(config, head_dim: int, layer_type: Optional[str] = None) -> int:
    """How many leading dimensions of each head the rotary turns (`partial_rotary_factor`, Phi-4-mini's
    0.75); the rest pass through unrotated, as transformers' apply_rotary_pos_emb leaves them."""
    factor = _rope_dict(config, layer_type).get("partial_rotary_factor",
                                                 getattr(config, "partial_rotary_factor", None) or 1.0)
    dim = int(head_dim * factor)
    if dim <= 0 or dim % 2 or dim > head_dim:
        raise ValueError(f"unsupported partial_rotary_factor {factor} for head_dim {head_dim}")
    return dim


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with a precomputed cos/sin table indexed by position.

    The table covers the rotated width (`rotary_dim`, head_dim unless the rotary is partial).
    LongRoPE (Phi-3's `longrope`/`su`) has two sets of frequencies: positions below
    original_max_position_embeddings use the short factors, positions from there on the long ones,
    each scaled by the attention factor. transformers switches the whole sequence to the long set
    once a forward pass reaches past that length; per position, every token's rotation depends on
    its position only, so prefix-cached keys stay valid. Both agree whenever a sequence stays within
    the original length.
    """

    kernels: Optional[Any] = None

    def __init__(self, config, head_dim: int, max_positions: int, device: torch.device,
                 layer_type: Optional[str] = None) -> None:
        super().__init__()
        rope_type, theta = rope_parameters(config, layer_type)
        self.rotary_dim = dim = rotary_dim(config, head_dim, layer_type)
        scaling = 1.0
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        extra = {} if layer_type is None else {"layer_type": layer_type}
        if rope_type == "default":
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
            freqs = torch.outer(positions, inv_freq.float())
        elif rope_type in ("longrope", "su"):
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            original = _rope_dict(config, layer_type).get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings")
            short, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, device, **extra)
            long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, device, seq_len=original + 1, **extra)
            freqs = torch.where((positions < original).unsqueeze(1), torch.outer(positions, short.float()),
                                torch.outer(positions, long.float()))
            if max_positions > original:
                logger.info("LongRoPE: positions below %d rotate with the short factors, later ones with the long "
                            "factors (transformers rotates a whole forward pass longer than %d with the long ones)",
                            original, original)
        else:
            # Scaled variants (llama3, linear, dynamic, yarn ...) come from transformers' own formulas.
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"unsupported rope type {rope_type!r}")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device, **extra)
            freqs = torch.outer(positions, inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def apply_inplace(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, head_dim: int) -> bool:
        """Rotate the first num_heads heads (q then k) of each [tokens, ...] row in place, if fused.

        The kernel turns whole heads; a partial rotary takes the torch path."""
        if self.kernels is None or qkv.dim() != 2 or qkv.stride(1) != 1 or self.rotary_dim != head_dim:
            return False
        self.kernels.rotary_inplace(qkv, positions, self.cos, self.sin, num_heads, head_dim)
        return True

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D]
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        dim = self.rotary_dim
        if dim == q.shape[-1]:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q_rot, k_rot = q[..., :dim], k[..., :dim]
        return (torch.cat([q_rot * cos + _rotate_half(q_rot) * sin, q[..., dim:]], dim=-1),
                torch.cat([k_rot * cos + _rotate_half(k_rot) * sin, k[..., dim:]], dim=-1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def use_cpu_kernels(model: nn.Module, kernels: Any) -> int:
    """Route every norm, activation and rotary layer of `model` through the fused CPU kernels."""
    count = 0
    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul, RotaryEmbedding)):
            module.kernels = kernels
            count += 1
    keep_rotary_tables_float(model)
    return count


def keep_rotary_tables_float(model: nn.Module) -> None:
    """cos/sin tables stay float32 (and contiguous, as the kernels read them) under any model dtype:
    `model.to(dtype)` casts buffers too, and bf16 positions tables lose the rotation's precision."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cos = module.cos.float().contiguous()
            module.sin = module.sin.float().contiguous()
