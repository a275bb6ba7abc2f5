"""LoRA adapters on the decoder's projections: PEFT's files read, and the low-rank deltas of a whole step's
rows, whatever their adapters, computed in one batched pass per projection.

A projection with LoRA holds `num_slots` adapters side by side. Its A matrices are stacked into one
[slots * parts * rank, in] matrix, so one matmul gives every row its x·Aᵀ under every slot; a one-hot of
each row's slot (zero for rows of the base model) keeps its own, and one matmul per fused part (q, k, v
of qkv_proj; gate, up of gate_up_proj) adds (x·Aᵀ)·Bᵀ into that part's columns:

    x [T, in] -> x·Aᵀ [T, slots, parts, rank] * onehot(slot)[T, slots] -> per part: [T, slots * rank]·B_partᵀ

(B carries PEFT's scaling, alpha / rank, or alpha / √rank with rsLoRA). One matmul for A and one per part for
B, whatever the number of adapters in the step, in place of a pass per adapter; rows of the base model add
exact zeros. A step of many rows (prompt chunks) would waste too much on the other slots' products, so there
each slot's rows are gathered and take matmuls of their own, and rows of the base model take none. Where the
projections run float32 on the CPU, tokenmill's C++ `lora_add` replaces both: each row by its own adapter
only. The base projection runs as before (dense, packed or kept quantized blocks): the adapter's delta is
added on top. Under tensor parallelism a column-parallel projection holds its rows of B, a row-parallel
one its columns of A (its partial delta is summed with the base's partial output by the same all-reduce).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.lora_request import check_adapter

# HF module names -> (our fused projection, part index within it).
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1), "down_proj": ("mlp.down_proj", 0)}
# Checkpoints that fuse the projections themselves (Phi-3): one A for every part, B's rows split by part.
FUSED_TARGETS = {"qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj"}
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass
class PeftAdapter:
    """One PEFT LoRA adapter as tokenmill applies it: per (layer, projection, part), A [r, in] and B [out, r]
    with the scaling folded into B."""

    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # (layer, projection) -> (A, B) of a fused checkpoint projection, split into parts by LoRALinear.parts
    fused: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def parts_of(self, layer: int, projection: str, sizes: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{part: (A, B)} of one projection whose parts have these output sizes."""
        parts = {part: pair for (at, p, part), pair in self.weights.items() if at == layer and p == projection}
        if (layer, projection) in self.fused:
            a, b = self.fused[(layer, projection)]
            if b.shape[0] != sum(sizes):
                raise ValueError(f"the adapter's {projection} of layer {layer} has {b.shape[0]} outputs, "
                                 f"the model's {sum(sizes)}")
            parts.update({part: (a, rows) for part, rows in enumerate(b.split(sizes))})
        return parts


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
    adapter = PeftAdapter()
    with safe_open(str(layout.directory / "adapter_model.safetensors"), framework="pt") as handle:
        for (layer, module), rank in layout.ranks.items():
            a = handle.get_tensor(layout.names[(layer, module, "A")]).float()
            b = handle.get_tensor(layout.names[(layer, module, "B")]).float()
            module_alpha = float(_pattern_value(config.get("alpha_pattern") or {}, f"model.layers.{layer}.{module}",
                                                alpha))
            scaling = module_alpha / (math.sqrt(rank) if rslora else rank)
            b = b * scaling
            if module in FUSED_TARGETS:  # each part: the shared A, its rows of B (sizes known to the model)
                adapter.fused[(layer, FUSED_TARGETS[module])] = (a.contiguous(), b.contiguous())
                continue
            projection, part = TARGETS[module]
            adapter.weights[(layer, projection, part)] = (a.contiguous(), b.contiguous())
    return adapter


# Steps of more rows than this take the grouped path (each slot's rows gathered, their own matmuls), fewer
# the masked one (every slot's product for every row, 1 + parts matmuls in all): the masked path's waste grows
# with the rows, the grouped path's extra operations do not.
GROUPED_MIN_ROWS = 64


@dataclass
class LoRAStepState:
    """The step's rows' adapters, shared by every LoRA projection of a model. `active` is False when no row
    has one (the projections then add nothing and the fused decode stack may run). `token_slots` holds each
    row's slot (-1: the base model), which the C++ kernel reads; without it, a step of at most
    GROUPED_MIN_ROWS rows carries `onehot` [T, slots] (zero rows for the base model's), a larger one `order`
    (the rows with an adapter, grouped by slot) and `segments` ((slot, start, end) of each group in it)."""

    kernel: Any = None  # tokenmill's C++ lora_add, where the projections run float32 on the CPU
    token_slots: Optional[torch.Tensor] = None
    onehot: Optional[torch.Tensor] = None
    order: Optional[torch.Tensor] = None
    segments: list[tuple[int, int, int]] = field(default_factory=list)

    def set_rows(self, token_slots: torch.Tensor, num_slots: int, device: torch.device) -> None:
        """token_slots: each row's slot, -1 for the base model."""
        rows = token_slots.numel()
        self.clear()
        if self.kernel is not None:
            self.token_slots = token_slots.to(device)
            return
        if rows <= GROUPED_MIN_ROWS:
            onehot = torch.zeros(rows, num_slots + 1)
            onehot[torch.arange(rows), token_slots] = 1.0  # -1 (no adapter) lands in the extra column
            self.onehot = onehot[:, :num_slots].to(device)
            return
        order = torch.argsort(token_slots, stable=True)
        sorted_slots = token_slots[order]
        first = int(torch.searchsorted(sorted_slots, 0))  # the base model's rows (-1) come first: skipped
        self.order = order[first:].to(device)
        start = 0
        for slot, count in zip(*torch.unique_consecutive(sorted_slots[first:], return_counts=True)):
            self.segments.append((int(slot), start, start + int(count)))
            start += int(count)

    @property
    def active(self) -> bool:
        return self.token_slots is not None or self.onehot is not None or self.order is not None

    def clear(self) -> None:
        self.token_slots, self.onehot, self.order, self.segments = None, None, None, []


class LoRALinear(nn.Module):
    """A projection plus the LoRA deltas of the adapters in its `num_slots` slots.

    parts: the output sizes of the fused parts, in order (q, k, v; gate, up; or one). shard: under tensor
    parallelism, (rank, size, "column" | "row") as the base projection is split; A and B are sliced to match
    when an adapter is loaded into a slot. A is [slots * parts * rank, in] (slot-major); B is kept transposed,
    [slots * rank, out], part p's columns reading only that part's ranks."""

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
        self.offsets = [sum(parts[:i]) for i in range(len(parts) + 1)]  # and the end
        self.register_buffer("lora_a", torch.zeros(num_slots * len(parts) * max_rank, in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_bt", torch.zeros(num_slots * max_rank, sum(parts), dtype=dtype, device=device),
                             persistent=False)

    @property
    def full_parts(self) -> list[int]:
        """The parts' output sizes in the whole (unsharded) projection."""
        if self.shard is not None and self.shard[2] == "column":
            return [size * self.shard[1] for size in self.parts]
        return list(self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        state = self.state
        if not state.active:
            return y
        if state.token_slots is not None:
            state.kernel(y, x.contiguous(), state.token_slots, self.lora_a, self.lora_bt, self.offsets, self.max_rank)
            return y
        rank, num_parts, spans = self.max_rank, len(self.parts), list(zip(self.offsets, self.offsets[1:]))
        if state.onehot is not None:
            rows = x.shape[0]
            xa = F.linear(x, self.lora_a).view(rows, self.num_slots, num_parts, rank)
            xa = xa.mul_(state.onehot.to(xa.dtype)[:, :, None, None])
            for part, (first, end) in enumerate(spans):
                y[:, first:end] += torch.mm(xa[:, :, part].reshape(rows, -1), self.lora_bt[:, first:end]).to(y.dtype)
            return y
        rows = x.index_select(0, state.order)
        delta = torch.empty(rows.shape[0], y.shape[1], dtype=rows.dtype, device=rows.device)
        width = num_parts * rank
        for slot, start, end in state.segments:
            xa = F.linear(rows[start:end], self.lora_a[slot * width:(slot + 1) * width])
            for part, (first, last) in enumerate(spans):
                delta[start:end, first:last] = torch.mm(xa[:, part * rank:(part + 1) * rank],
                                                        self.lora_bt[slot * rank:(slot + 1) * rank, first:last])
        return y.index_add_(0, state.order, delta.to(y.dtype))

    def load_slot(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The slot's A and B from an adapter's {part: (A, B)} (parts it lacks left zero)."""
        rank, num_parts = self.max_rank, len(self.parts)
        self.lora_a[slot * num_parts * rank:(slot + 1) * num_parts * rank].zero_()
        self.lora_bt[slot * rank:(slot + 1) * rank].zero_()
        for part, (first, end) in enumerate(zip(self.offsets, self.offsets[1:])):
            if part not in weights:
                continue
            a, b = self._slice(*weights[part])
            r = a.shape[0]
            start = (slot * num_parts + part) * rank
            self.lora_a[start:start + r] = a.to(self.lora_a.dtype)
            self.lora_bt[slot * rank:slot * rank + r, first:end] = b.t().to(self.lora_bt.dtype)

    def _slice(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share: B's rows of a column-parallel part, A's columns of a row-parallel projection."""
        if self.shard is None:
            return a, b
        rank, size, kind = self.shard
        if kind == "column":
            return a, b.chunk(size, dim=0)[rank]
        return a.chunk(size, dim=1)[rank], b


def target_shapes(config, fused_checkpoint: bool, sparse_mlp: bool = False) -> dict[str, list[int]]:
    """The [in, out] of each projection an adapter of this model may target, by its HF module name (a
    checkpoint that fuses q/k/v and gate/up, as Phi-3's does, names them qkv_proj and gate_up_proj).
    sparse_mlp: a mixture-of-experts model, whose MLP projections are listed with [] (not adaptable)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q = heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inter = config.intermediate_size
    shapes = {"o_proj": [q, hidden], "down_proj": [inter, hidden]}
    if fused_checkpoint:
        shapes.update(qkv_proj=[hidden, q + 2 * kv], gate_up_proj=[hidden, 2 * inter])
    else:
        shapes.update(q_proj=[hidden, q], k_proj=[hidden, kv], v_proj=[hidden, kv], gate_proj=[hidden, inter],
                      up_proj=[hidden, inter])
    if sparse_mlp:
        shapes.update({name: [] for name in ("gate_proj", "up_proj", "down_proj", "gate_up_proj")})
    return shapes
