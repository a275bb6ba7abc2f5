"""Linear layers with weights pre-packed for oneDNN on CPU.

`F.linear` hands MKL a plain row-major weight on every call; oneDNN can instead keep the weight in
its own blocked layout, reordered once at load time for the expected number of rows. At the row
counts a serving step has (one per decoding request, 1-64), this measured 1.2-1.6x faster for the
decoder's projections and up to 2x for the LM head on a 2-core AVX2 EPYC (docs/performance.md).
Results differ from F.linear only by float summation order.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
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


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None, rows_hint: Optional[int]) -> nn.Module:
    """`weight` as a float layer: oneDNN-packed for about rows_hint rows where that is available (and
    rows_hint is given), else an nn.Linear holding the tensors as they are."""
    if rows_hint and onednn_packing_supported(weight.dtype):
        return PackedLinear(weight, bias, rows_hint)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return linear


# Builds a replacement layer from a loaded (module name, weight, bias).
LinearFactory = Callable[[str, torch.Tensor, Optional[torch.Tensor]], nn.Module]


def replace_linear_layers(model: nn.Module, make: LinearFactory) -> int:
    """Swap every nn.Linear in `model` for make(name, weight, bias); returns how many were replaced."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(name, linear.weight, linear.bias))
    return len(targets)


# ---- Block-int8 weights (GGUF's Q8_0, Q4_*, Q5_* kept quantized) --------------------------------
INT8_BLOCK = 32
# Up to this many rows a block-int8 layer runs tokenmill's int8 kernel: decode steps (bandwidth-bound at
# a few rows, and ~1.7x ahead of oneDNN's fp32 GEMM at 16 rows here, even at 64); above it the dense
# copy of the same dequantized values (prefill chunks, where oneDNN's cache blocking wins).
INT8_KERNEL_MAX_ROWS = 64


@dataclass
class Int8Blocks:
    """A weight stored as w[n, k] = q[n, k] * scales[n, k // 32] (+ mins[n, k // 32]).

    q holds small integers (int8), one fp32 scale (and optionally one fp32 offset) per block of 32
    inputs. GGUF's Q8_0, Q4_0 and Q5_0 have no offset; Q4_1, Q5_1 and the 32-value sub-blocks of
    Q4_K / Q5_K have one. `dequantize` computes q * scale + min in float32, one rounding, as gguf-py
    does, so a file's weights are reproduced bit for bit.
    """

    q: torch.Tensor  # int8 [out_features, in_features]
    scales: torch.Tensor  # float32 [out_features, in_features // 32]
    mins: Optional[torch.Tensor] = None  # float32 like scales, or None

    def dequantize(self) -> torch.Tensor:
        out_features, in_features = self.q.shape
        blocks = self.q.float().reshape(out_features, in_features // INT8_BLOCK, INT8_BLOCK)
        blocks = blocks * self.scales.unsqueeze(-1)
        if self.mins is not None:
            blocks = blocks + self.mins.unsqueeze(-1)
        return blocks.reshape(out_features, in_features)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Int8Blocks":
        """The same permutation of output features applied to q, scales and mins."""
        return Int8Blocks(fn(self.q).contiguous(), fn(self.scales).contiguous(),
                          None if self.mins is None else fn(self.mins).contiguous())

    @staticmethod
    def cat(parts: list["Int8Blocks"]) -> "Int8Blocks":
        """Stacked along the output features (fused q/k/v or gate/up); a part without mins gets zeros."""
        with_mins = any(part.mins is not None for part in parts)
        mins = None
        if with_mins:
            mins = torch.cat([part.mins if part.mins is not None else torch.zeros_like(part.scales)
                              for part in parts])
        return Int8Blocks(torch.cat([part.q for part in parts]), torch.cat([part.scales for part in parts]), mins)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q8_0: per block of 32 inputs, scale = max|w| / 127 and q = round(w / scale)."""
    out_features, in_features = weight.shape
    if in_features % INT8_BLOCK:
        raise ValueError(f"Q8_0 needs in_features divisible by {INT8_BLOCK}, got {in_features}")
    blocks = weight.detach().float().reshape(out_features, in_features // INT8_BLOCK, INT8_BLOCK)
    scales = blocks.abs().amax(dim=-1) / 127.0
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(blocks / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.reshape(out_features, in_features).contiguous(), scales.contiguous()


def dequantize_q8_0(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return Int8Blocks(q, scales).dequantize()


INT8_PANEL = 16


def _pack_panel_values(values: torch.Tensor, panels: int) -> torch.Tensor:
    """Per-block values [out, blocks] as [panel][block][16], the last panel zero-padded."""
    out_features, blocks = values.shape
    padded = torch.zeros(panels * INT8_PANEL, blocks, dtype=torch.float32)
    padded[:out_features] = values
    return padded.reshape(panels, INT8_PANEL, blocks).permute(0, 2, 1).contiguous()


def pack_int8_blocks(q: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The int8 kernel's layout: output features in panels of 16, q as [panel][block][k in 32][16]
    and scales (and mins) as [panel][block][16], so the 16 features of one input are one 16-byte row
    and a panel is one sequential stream. The last panel is zero-padded to 16 features."""
    out_features, in_features = q.shape
    blocks = in_features // INT8_BLOCK
    panels = -(-out_features // INT8_PANEL)
    q_padded = torch.zeros(panels * INT8_PANEL, in_features, dtype=torch.int8)
    q_padded[:out_features] = q
    packed_q = q_padded.reshape(panels, INT8_PANEL, blocks, INT8_BLOCK).permute(0, 2, 3, 1).contiguous()
    packed_mins = None if mins is None else _pack_panel_values(mins, panels)
    return packed_q, _pack_panel_values(scales, panels), packed_mins


class Int8BlockLinear(nn.Module):
    """A float32 linear whose weights are block-int8 (`Int8Blocks`): GGUF blocks kept as the file
    stores them, or a float weight rounded to Q8_0 at load (`from_weight`).

    Steps with few rows run tokenmill's int8 kernel (a quarter of fp32's weight bytes); larger steps
    run a dense copy of the very same dequantized values, so a request's numbers do not depend on
    which path its step took beyond float summation order. Without `dense_rows_hint` the copy is a
    plain float32 weight for torch's `F.linear` (MKL): when no decode step exceeds the kernel's rows,
    only prefill chunks of hundreds of rows reach it, and there MKL ran 5-10% faster than the
    oneDNN-packed weight (384-2048 rows, 2-core AVX2 host). With a hint (decode batches of up to that
    many rows) it is packed for oneDNN, which was ~15% faster at 65-128 rows.
    """

    def __init__(self, blocks: Int8Blocks, bias: torch.Tensor | None, kernels,
                 dense_rows_hint: Optional[int] = None, dequantized: Optional[torch.Tensor] = None) -> None:
        """`dequantized`: blocks.dequantize() when the caller already holds it (the loader checked a
        GGUF's blocks against the dense weights bit for bit), so it is not computed twice at load."""
        super().__init__()
        self.out_features, self.in_features = blocks.q.shape
        if self.in_features % INT8_BLOCK:
            raise ValueError(f"block-int8 weights need in_features divisible by {INT8_BLOCK}")
        self.q, self.scales, self.mins = pack_int8_blocks(blocks.q, blocks.scales, blocks.mins)
        self.bias = None if bias is None else bias.detach().float()
        self.dense = dense_linear(blocks.dequantize() if dequantized is None else dequantized, self.bias,
                                  dense_rows_hint)
        self.kernels = kernels

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernels,
                    dense_rows_hint: Optional[int] = None) -> "Int8BlockLinear":
        """`--quantization q8_0`: the float weight rounded to GGUF's Q8_0 at load."""
        return cls(Int8Blocks(*quantize_q8_0(weight)), bias, kernels, dense_rows_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= INT8_KERNEL_MAX_ROWS:
            return self.kernels.int8_block_linear(x.contiguous(), self.q, self.scales, self.mins, self.bias,
                                                  self.out_features)
        return self.dense(x)

    def extra_repr(self) -> str:
        kind = "int8 blocks with mins" if self.mins is not None else "int8 blocks"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"
