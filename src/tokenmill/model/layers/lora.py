"""LoRA adapters on the decoder's projections: PEFT's files read, and the low-rank deltas of a whole step's
rows, whatever their adapters, computed in one batched pass per projection.

A projection with LoRA holds `num_slots` adapters side by side. Its A matrices are stacked into one
[slots * parts * rank, in] matrix, so one matmul gives every row its x·Aᵀ under every slot; a one-hot of
each row's slot (zero for rows of the base model) keeps its own, and one matmul per fused part (q, k, v
of qkv_proj; gate, up of gate_up_proj) adds (x·Aᵀ)·Bᵀ into that part's columns:

    x [T, in] -> x·Aᵀ [T, slots, parts, rank] * onehot(slot)[T, slots] -> per part: [T, slots * rank]·B_partᵀ

(B holds each slot's rank columns side by side and carries PEFT's scaling, alpha / rank, or alpha / √rank
with rsLoRA). Two small matmuls per part for any number of adapters in the step, in place of a pass per
adapter; rows of the base model add exact zeros. The base projection runs as before (dense, packed or kept
quantized blocks): the adapter's delta is added on top. Under tensor parallelism a column-parallel
projection holds its rows of B, a row-parallel one its columns of A (its partial delta is summed with
the base's partial output by the same all-reduce).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from tokenmill.lora_request import check_adapter

# HF module names -> (our fused projection, part index within it).
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1), "down_proj": ("mlp.down_proj", 0)}
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass
class PeftAdapter:
    """One PEFT LoRA adapter as tokenmill applies it: per (layer, projection, part), A [r, in] and B [out, r]
    with the scaling folded into B."""

    path: str
    rank: int
    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's alpha_pattern: the value of the first key matching the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def read_peft_adapter(path: str, num_layers: int, max_rank: int) -> PeftAdapter:
    """A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors), checked by `check_adapter`
    (InvalidRequestError naming what tokenmill cannot apply), its scaling folded into B."""
    from safetensors import safe_open

    layout = check_adapter(path, num_layers, max_rank)
    config = layout.config
    alpha = float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora"))
    adapter = PeftAdapter(str(layout.directory), layout.rank)
    with safe_open(str(layout.directory / "adapter_model.safetensors"), framework="pt") as handle:
        for (layer, module), rank in layout.ranks.items():
            a = handle.get_tensor(layout.names[(layer, module, "A")]).float()
            b = handle.get_tensor(layout.names[(layer, module, "B")]).float()
            module_alpha = float(_pattern_value(config.get("alpha_pattern") or {}, f"model.layers.{layer}.{module}",
                                                alpha))
            scaling = module_alpha / (math.sqrt(rank) if rslora else rank)
            projection, part = TARGETS[module]
            adapter.weights[(layer, projection, part)] = (a.contiguous(), (b * scaling).contiguous())
    return adapter


@dataclass
class LoRAStepState:
    """The step's rows' adapters, shared by every LoRA projection of a model: None when no row has one
    (the projections then add nothing and the fused decode stack may run); else [T, slots], one-hot."""

    onehot: Optional[torch.Tensor] = None


class LoRALinear(nn.Module):
    """A projection plus the LoRA deltas of the adapters in its `num_slots` slots.

    parts: the output sizes of the fused parts, in order (q, k, v; gate, up; or one). shard: under tensor
    parallelism, (rank, size, "column" | "row") as the base projection is split; A and B are sliced to match
    when an adapter is loaded into a slot."""

    def __init__(self, base: nn.Module, in_features: int, parts: list[int], num_slots: int, max_rank: int,
                 state: LoRAStepState, dtype: torch.dtype, device: torch.device,
                 shard: Optional[tuple[int, int, str]] = None) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.state = state
        self.shard = shard
        self.offsets = [sum(parts[:i]) for i in range(len(parts))]
        self.register_buffer("lora_a", torch.zeros(num_slots * len(parts) * max_rank, in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.lora_b = [torch.zeros(size, num_slots * max_rank, dtype=dtype, device=device) for size in parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        onehot = self.state.onehot
        if onehot is None:
            return y
        rows = x.shape[0]
        xa = F.linear(x, self.lora_a).view(rows, self.num_slots, len(self.parts), self.max_rank)
        xa = xa * onehot.to(xa.dtype)[:, :, None, None]
        for part, (offset, size) in enumerate(zip(self.offsets, self.parts)):
            delta = F.linear(xa[:, :, part].reshape(rows, -1), self.lora_b[part])
            y[:, offset:offset + size] += delta.to(y.dtype)
        return y

    def load_slot(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The slot's A and B from an adapter's {part: (A, B)} (parts it lacks left zero)."""
        num_parts, rank = len(self.parts), self.max_rank
        start = slot * num_parts * rank
        self.lora_a[start:start + num_parts * rank].zero_()
        for part, b_all in enumerate(self.lora_b):
            b_all[:, slot * rank:(slot + 1) * rank].zero_()
            if part not in weights:
                continue
            a, b = self._slice(*weights[part])
            r = a.shape[0]
            self.lora_a[start + part * rank:start + part * rank + r] = a.to(self.lora_a.dtype)
            b_all[:, slot * rank:slot * rank + r] = b.to(b_all.dtype)

    def _slice(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share: B's rows of a column-parallel part, A's columns of a row-parallel projection."""
        if self.shard is None:
            return a, b
        rank, size, kind = self.shard
        if kind == "column":
            return a, b.chunk(size, dim=0)[rank]
        return a.chunk(size, dim=1)[rank], b
