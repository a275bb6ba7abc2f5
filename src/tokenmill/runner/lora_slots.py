"""The runner's LoRA adapters: `--max-loras` slots on the model's projections, filled from PEFT directories
as steps need them (least recently used slot first), and each step's rows mapped to their slots.

The scheduler never runs more than `--max-loras` adapters in one step, so a step's adapters always fit. Read
adapters stay in host memory (up to `--max-cpu-loras`, least recently used out first), so one that comes
back to a slot is not read from disk again.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np
import torch

from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.lora_request import LoRARequest
from tokenmill.model.layers.lora import PROJECTIONS, LoRALinear, LoRAStepState, PeftAdapter, read_peft_adapter

logger = logging.getLogger("tokenmill")


def add_lora_projections(model: torch.nn.Module, num_slots: int, max_rank: int, tp=None,
                         kernels=None) -> tuple[LoRAStepState, dict[tuple[int, str], LoRALinear]]:
    """Puts every decoder layer's q/k/v, o, gate/up and down projections behind a LoRALinear with `num_slots`
    empty slots; returns the state they share (the model reads it to leave the fused decode stack to steps
    without adapters) and the LoRALinears by (layer index, projection). kernels: tokenmill's C++ CPU kernels,
    whose lora_add then computes float32 deltas; where the projections round their activations to 8 bits
    (--block-matmul int8, the default on CPUs with integer dot products) the adapters' weights are kept in
    bfloat16, which halves the bytes each decode step reads (the exact numerics keep float32)."""
    # The activations' dtype and device (the final norm's: embeddings and projections may be kept quantized).
    dtype, device = model.norm.weight.dtype, model.norm.weight.device
    use_kernel = kernels is not None and hasattr(kernels, "lora_add") and dtype == torch.float32 and \
        device.type == "cpu"
    state = LoRAStepState(kernel=kernels.lora_add if use_kernel else None)
    if use_kernel and _rounds_activations(model):
        dtype = torch.bfloat16
    linears: dict[tuple[int, str], LoRALinear] = {}
    for index, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        spec = model.spec
        shapes = {"self_attn.qkv_proj": (spec.hidden_size, [attn.q_size, attn.kv_size, attn.kv_size], "column"),
                  "self_attn.o_proj": (attn.q_size, [spec.hidden_size], "row")}
        if hasattr(mlp, "gate_up_proj"):  # a mixture-of-experts layer: adapters cover its attention only
            shapes.update({"mlp.gate_up_proj": (spec.hidden_size, [mlp.intermediate_size] * 2, "column"),
                           "mlp.down_proj": (mlp.intermediate_size, [spec.hidden_size], "row")})
        for name in PROJECTIONS:
            if name not in shapes:
                continue
            owner_name, attr = name.split(".")
            owner = getattr(layer, owner_name)
            in_features, parts, kind = shapes[name]
            shard = None if tp is None else (tp.rank, tp.size, kind)
            linears[(index, name)] = LoRALinear(getattr(owner, attr), in_features, parts, num_slots, max_rank,
                                                state, dtype, device, shard)
            setattr(owner, attr, linears[(index, name)])
    model.lora_state = state
    return state, linears


def _rounds_activations(model: torch.nn.Module) -> bool:
    """Whether the model's projections round their activations to 8 bits (their kernels' int8_activations)."""
    return any(getattr(getattr(module, "kernels", None), "int8_activations", False) for module in model.modules())


class LoRASlots:
    @staticmethod
    def settings(config) -> Optional[tuple[int, int, Optional[int], int]]:
        """The constructor's sizes from an EngineConfig; None without --enable-lora."""
        if not config.enable_lora:
            return None
        return config.max_loras, config.max_lora_rank, config.max_cpu_loras, config.max_num_seqs

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, max_cpu_loras: Optional[int],
                 max_num_seqs: int, tp=None, kernels=None) -> None:
        """max_cpu_loras: adapters kept read in host memory, at least max_loras (None: max_loras)."""
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.state, self.linears = add_lora_projections(model, max_loras, max_rank, tp, kernels)
        self.device = model.norm.weight.device
        self.slot_bytes = sum(buffer.numel() * buffer.element_size() for linear in self.linears.values()
                              for buffer in linear.buffers(recurse=False)) // max_loras
        logger.info("LoRA: %d slots of rank %d on %d projections, %.1f MiB each (%s)", max_loras, max_rank,
                    len(self.linears), self.slot_bytes / 2**20,
                    "C++ kernel" if self.state.kernel is not None else "torch matmuls")
        self.requests: dict[str, LoRARequest] = {}  # request id -> its adapter (requests with one)
        self.slots: OrderedDict[LoRARequest, int] = OrderedDict()  # loaded adapters, least recently used first
        self.read: OrderedDict[LoRARequest, PeftAdapter] = OrderedDict()  # adapters held in host memory
        self.row_slot = np.full(max_num_seqs + 1, -1, dtype=np.int64)  # input-batch row -> slot (-1: none)
        self.num_slot_loads = 0

    def track(self, output: SchedulerOutput) -> None:
        """Which adapter each request the runner learns of uses; finished ones forgotten."""
        for new in output.new_requests:
            if new.lora is not None:
                self.requests[new.request_id] = new.lora
            else:
                self.requests.pop(new.request_id, None)
        for request_id in output.finished_ids:
            self.requests.pop(request_id, None)

    def prepare(self, scheduled: Sequence, states: Sequence, token_rows: np.ndarray) -> None:
        """The step's one-hot of each token's slot (None: no adapter in the step), loading adapters into slots."""
        needed = {self.requests[item.request_id] for item in scheduled if item.request_id in self.requests}
        if not needed:
            self.state.clear()
            return
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step with {len(needed)} adapters; --max-loras is {self.max_loras}")
        for lora in needed:
            self._ensure_slot(lora, needed)
        rows = self.row_slot
        rows[:] = -1
        for item, state in zip(scheduled, states):
            lora = self.requests.get(item.request_id)
            if lora is not None:
                rows[state.row] = self.slots[lora]
        self.state.set_rows(torch.from_numpy(rows[token_rows]), self.max_loras, self.device)

    def _ensure_slot(self, lora: LoRARequest, needed: set) -> None:
        if lora in self.slots:
            self.slots.move_to_end(lora)
            return
        used = set(self.slots.values())
        free = [slot for slot in range(self.max_loras) if slot not in used]
        if free:
            slot = free[0]
        else:  # the least recently used adapter this step does not need
            victim = next(key for key in self.slots if key not in needed)
            slot = self.slots.pop(victim)
        adapter = self._adapter(lora)
        for (index, projection), linear in self.linears.items():
            linear.load_slot(slot, adapter.parts_of(index, projection, linear.full_parts))
        self.slots[lora] = slot
        self.num_slot_loads += 1
        logger.info("LoRA adapter %r in slot %d (%s)", lora.lora_name, slot, lora.lora_path)

    def _adapter(self, lora: LoRARequest) -> PeftAdapter:
        adapter = self.read.get(lora)
        if adapter is None:
            adapter = read_peft_adapter(lora.lora_path, len(self.model.layers), self.max_rank)
            self.read[lora] = adapter
            while len(self.read) > self.max_cpu_loras:
                self.read.popitem(last=False)
        self.read.move_to_end(lora)
        return adapter

