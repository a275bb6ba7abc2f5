"""Linear layers with weights pre-packed for oneDNN on CPU.

`F.linear` hands MKL a plain row-major weight on every call; oneDNN can instead keep the weight in
its own blocked layout, reordered once at load time for the expected number of rows. At the row
counts a serving step has (one per decoding request, 1-64), this measured 1.2-1.6x faster for the
decoder's projections and up to 2x for the LM head on a 2-core AVX2 EPYC (docs/performance.md).
Results differ from F.linear only by float summation order.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from torch import nn

logger = logging.getLogger("tokenmill")


def onednn_packing_supported(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


class PackedLinear(nn.Module):
    """y = x W^T + b with W reordered once into oneDNN's layout; x is [rows, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows_hint: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows_hint)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


# Builds a replacement layer from a loaded (weight, bias).
LinearFactory = Callable[[torch.Tensor, Optional[torch.Tensor]], nn.Module]


def replace_linear_layers(model: nn.Module, make: LinearFactory) -> int:
    """Swap every nn.Linear in `model` for make(weight, bias); returns how many were replaced."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(linear.weight, linear.bias))
    return len(targets)


# ---- Q8_0 weight-only quantization ------------------------------------------------------------
Q8_0_BLOCK = 32
# Up to this many rows a Q8_0 layer runs tokenmill's int8 kernel: decode steps (bandwidth-bound at a
# few rows, and ~1.7x ahead of oneDNN's fp32 GEMM at 16 rows here, even at 64); above it the dense copy
# of the same dequantized values (prefill chunks, where oneDNN's cache blocking wins).
Q8_0_MAX_KERNEL_ROWS = 64


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q8_0: per block of 32 inputs, scale = max|w| / 127 and q = round(w / scale)."""
    out_features, in_features = weight.shape
    if in_features % Q8_0_BLOCK:
        raise ValueError(f"Q8_0 needs in_features divisible by {Q8_0_BLOCK}, got {in_features}")
    blocks = weight.detach().float().reshape(out_features, in_features // Q8_0_BLOCK, Q8_0_BLOCK)
    scales = blocks.abs().amax(dim=-1) / 127.0
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(blocks / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.reshape(out_features, in_features).contiguous(), scales.contiguous()


Q8_0_PANEL = 16


def pack_q8_0(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 kernel's layout: output features in panels of 16, q as [panel][block][k in 32][16]
    and scales as [panel][block][16], so the 16 features of one input are one 16-byte row and a panel
    is one sequential stream. The last panel is zero-padded to 16 features."""
    out_features, in_features = q.shape
    blocks = in_features // Q8_0_BLOCK
    panels = -(-out_features // Q8_0_PANEL)
    padded = panels * Q8_0_PANEL
    q_padded = torch.zeros(padded, in_features, dtype=torch.int8)
    q_padded[:out_features] = q
    scales_padded = torch.zeros(padded, blocks, dtype=torch.float32)
    scales_padded[:out_features] = scales
    packed_q = q_padded.reshape(panels, Q8_0_PANEL, blocks, Q8_0_BLOCK).permute(0, 2, 3, 1).contiguous()
    packed_scales = scales_padded.reshape(panels, Q8_0_PANEL, blocks).permute(0, 2, 1).contiguous()
    return packed_q, packed_scales


def dequantize_q8_0(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out_features, in_features = q.shape
    blocks = q.float().reshape(out_features, in_features // Q8_0_BLOCK, Q8_0_BLOCK) * scales.unsqueeze(-1)
    return blocks.reshape(out_features, in_features)


class Q8_0Linear(nn.Module):
    """A float32 linear whose weights are rounded to Q8_0 once at load.

    Steps with few rows run tokenmill's int8 kernel (a quarter of the weight bytes); larger steps
    run a dense (oneDNN-packed when available) copy of the very same dequantized values, so a
    request's numbers do not depend on which path its step took beyond float summation order.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows_hint: int, kernels) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scales = quantize_q8_0(weight)
        self.q, self.scales = pack_q8_0(q, scales)  # the int8 kernel's layout
        self.bias = None if bias is None else bias.detach().float()
        dense = dequantize_q8_0(q, scales)
        if onednn_packing_supported(torch.float32):
            self.dense: nn.Module = PackedLinear(dense, self.bias, rows_hint)
        else:
            self.dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
            self.dense.weight.data = dense
            if self.bias is not None:
                self.dense.bias.data = self.bias
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= Q8_0_MAX_KERNEL_ROWS:
            return self.kernels.q8_0_linear(x.contiguous(), self.q, self.scales, self.bias, self.out_features)
        return self.dense(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q8_0"
