"""Linear layers with weights pre-packed for oneDNN on CPU.

`F.linear` hands MKL a plain row-major weight on every call; oneDNN can instead keep the weight in
its own blocked layout, reordered once at load time for the expected number of rows. At the row
counts a serving step has (one per decoding request, 1-64), this is faster for the decoder's
projections and more so for the LM head (docs/performance.md has the measurements).
Results differ from F.linear only by float summation order.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from tokenmill.model.layers.cpu_kernels import cpu_flags

logger = logging.getLogger("tokenmill")


@contextmanager
def skip_weight_init() -> Iterator[None]:
    """nn.Linear and nn.Embedding built inside allocate their weights without initializing them (a
    checkpoint overwrites them anyway): untouched pages cost no resident memory, and a weight that is
    replaced before it is written (a kept GGUF matrix) never does."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


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


# ---- Block-quantized weights (GGUF's Q8_0, Q4_*, Q5_* kept as the file stores them) ---------------
QUANT_BLOCK = 32
QUANT_PANEL = 16
# Up to this many rows the C++ kernel's row path runs (decode steps: bandwidth-bound at a few rows);
# above it, the same call dequantizes cache-sized tiles into sgemm (prefill chunks). Decode-only steps
# of up to this many rows may run the whole decoder stack in one C++ call.
BLOCK_KERNEL_MAX_ROWS = 64


@dataclass
class Int8Blocks:
    """A weight as small integers: w[n, k] = q[n, k] * scales[n, k // 32] (+ mins[n, k // 32]).

    q holds the integers as int8, one fp32 scale (and optionally one fp32 offset) per block of 32
    inputs. GGUF's Q8_0, Q4_0 and Q5_0 have no offset; Q4_1, Q5_1 and the 32-value sub-blocks of
    Q4_K / Q5_K have one. `dequantize` computes q * scale + min in float32, one rounding each, as
    gguf-py does, so a file's weights are reproduced bit for bit. `BlockQuantLinear` stores them
    packed at the narrowest width that holds them exactly (`storage_bits`).
    """

    q: torch.Tensor  # int8 [out_features, in_features]
    scales: torch.Tensor  # float32 [out_features, in_features // 32]
    mins: Optional[torch.Tensor] = None  # float32 like scales, or None

    def dequantize(self) -> torch.Tensor:
        out_features, in_features = self.q.shape
        blocks = self.q.float().reshape(out_features, in_features // QUANT_BLOCK, QUANT_BLOCK)
        blocks = blocks * self.scales.unsqueeze(-1)
        if self.mins is not None:
            blocks = blocks + self.mins.unsqueeze(-1)
        return blocks.reshape(out_features, in_features)

    def storage_bits(self) -> int:
        """4 when every integer fits a nibble as GGUF's 4-bit types store it (0..15 with mins, Q4_1 and
        Q4_K; -8..7 without, Q4_0, kept as q + 8), else 8."""
        return Int8Blocks.parts_storage_bits([self])

    @staticmethod
    def parts_storage_bits(parts: list["Int8Blocks"]) -> int:
        """`storage_bits` of the parts stacked (`cat`), read from each part in place."""
        low, high = (0, 15) if any(part.mins is not None for part in parts) else (-8, 7)
        fits = all(part.q.numel() == 0 or (int(part.q.min()) >= low and int(part.q.max()) <= high) for part in parts)
        return 4 if fits else 8

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Int8Blocks":
        """The same permutation of output features applied to q, scales and mins."""
        return Int8Blocks(fn(self.q).contiguous(), fn(self.scales).contiguous(),
                          None if self.mins is None else fn(self.mins).contiguous())

    @staticmethod
    def cat(parts: list["Int8Blocks"], integers: bool = True) -> "Int8Blocks":
        """Stacked along the output features (fused q/k/v or gate/up); a part without mins gets zeros.
        integers=False: the scales and mins only (q holds no inputs: [out_features, 0])."""
        with_mins = any(part.mins is not None for part in parts)
        mins = None
        if with_mins:
            mins = torch.cat([part.mins if part.mins is not None else torch.zeros_like(part.scales)
                              for part in parts])
        q = torch.cat([part.q for part in parts]) if integers else \
            torch.empty(sum(len(part.q) for part in parts), 0, dtype=torch.int8)
        return Int8Blocks(q, torch.cat([part.scales for part in parts]), mins)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q8_0, as llama.cpp and gguf-py write it: per block of 32 inputs d = max|w| / 127,
    q = round(w / d), and d stored as float16 (returned as float32 holding that float16 value, so the
    integer kernels read 2-byte scales, as from a Q8_0 file)."""
    out_features, in_features = weight.shape
    if in_features % QUANT_BLOCK:
        raise ValueError(f"Q8_0 needs in_features divisible by {QUANT_BLOCK}, got {in_features}")
    q = torch.empty(out_features, in_features, dtype=torch.int8)
    scales = torch.empty(out_features, in_features // QUANT_BLOCK)
    step = _rows_per_pass(in_features)  # a run of rows at a time: the float intermediates stay in cache
    for start in range(0, out_features, step):
        rows = slice(start, start + step)
        blocks = weight[rows].detach().float().reshape(-1, in_features // QUANT_BLOCK, QUANT_BLOCK)
        low, high = torch.aminmax(blocks, dim=-1)  # one pass for max|w|, no |w| copy
        d = torch.maximum(-low, high).div_(127.0)
        safe = torch.where(d == 0, torch.ones_like(d), d)
        q[rows] = blocks.div(safe.unsqueeze(-1)).round_().reshape(-1, in_features)  # |w| / d <= 127: no clamp
        scales[rows] = d.to(torch.float16)
    return q, scales


# Weights rounded or packed per pass at load: a run of rows whose intermediates fit in L2, instead of whole
# matrices streamed through memory once per tensor operation.
_VALUES_PER_PASS = 1 << 18


def _rows_per_pass(in_features: int, multiple: int = 1) -> int:
    return max(1, _VALUES_PER_PASS // (in_features * multiple)) * multiple


def dequantize_q8_0(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return Int8Blocks(q, scales).dequantize()


def _pack_panel_values(values: torch.Tensor, panels: int) -> torch.Tensor:
    """Per-block values [out, blocks] as [panel][block][16], the last panel zero-padded."""
    out_features, blocks = values.shape
    padded = torch.zeros(panels * QUANT_PANEL, blocks, dtype=torch.float32)
    padded[:out_features] = values
    return padded.reshape(panels, QUANT_PANEL, blocks).permute(0, 2, 1).contiguous()


def pack_blocks(blocks: Int8Blocks, bits: Optional[int] = None, layout: str = "rows", kernels=None
                ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The C++ kernels' layouts; output features in panels of 16, the last zero-padded.

    "rows" (what the float32 kernels and Triton read): per panel, block of 32 inputs and input k, the 16
    features' integers are one row, so a panel is one sequential stream. 8-bit: q as int8
    [panel][block][k][16]. 4-bit: uint8 [panel][block][k][8], byte j holding feature j in its low nibble
    and feature j + 8 in its high one (without mins each nibble is q + 8, as Q4_0 stores it).

    "dot" (what `--block-matmul int8`'s integer dot products read, the same bytes): per panel and block,
    64-byte groups in which byte 4f + j holds feature f's integer for input 4g + j. 8-bit: int8
    [panel][block][8][64]. 4-bit: uint8 [panel][block][4][64], group u holding inputs 8u..8u+3 in the low
    nibbles and 8u+4..8u+7 in the high ones.

    Scales (and mins) as float32 [panel][block][16]; in the dot layout (read only with activations rounded
    to int8) as float16: exactly for GGUF's Q4_0, Q4_1 and Q8_0, which store them so, and rounded for Q4_K's
    and Q5_K's products of two scales (`_fits_float16`), which halves the bytes they add per weight (0.25 to
    0.125 for 4-bit blocks with mins); scales that would overflow float16 stay float32.

    `kernels`: tokenmill's C++ module, which lays the integers out in one pass (the same bytes)."""
    return pack_block_parts([blocks], layout, kernels, bits)


def pack_block_parts(parts: list[Int8Blocks], layout: str = "rows", kernels=None, bits: Optional[int] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """`pack_blocks(Int8Blocks.cat(parts))`; with tokenmill's C++ module the parts' integers are laid out where
    they lie, never stacked into one copy first (fused q/k/v and gate/up layers)."""
    if layout not in ("rows", "dot"):
        raise ValueError(f"block layout is 'rows' or 'dot', not {layout!r}")
    bits = Int8Blocks.parts_storage_bits(parts) if bits is None else bits
    if bits not in (4, 8):
        raise ValueError(f"block storage is 4 or 8 bits, not {bits}")
    header = Int8Blocks.cat(parts, integers=False) if len(parts) > 1 else parts[0]
    scales, mins = header.scales, header.mins
    out_features, in_features = len(header.q), parts[0].q.shape[1]
    panels = -(-out_features // QUANT_PANEL)
    offset = 0 if mins is not None else 8
    packed_q = None
    if kernels is not None:
        packed_q = kernels.pack_block_integers([part.q.contiguous() for part in parts], bits, layout == "dot", offset)
    else:
        q = Int8Blocks.cat(parts).q if len(parts) > 1 else parts[0].q
        step = _rows_per_pass(in_features, QUANT_PANEL)  # whole panels per pass
        for start in range(0, out_features, step):
            part = _pack_panel_integers(q[start:start + step], bits, layout, offset)
            if packed_q is None:
                packed_q = torch.empty((panels, *part.shape[1:]), dtype=part.dtype)
            packed_q[start // QUANT_PANEL:start // QUANT_PANEL + len(part)] = part
    packed_scales = _pack_panel_values(scales, panels)
    packed_mins = None if mins is None else _pack_panel_values(mins, panels)
    if layout == "dot" and all(_fits_float16(t) for t in (packed_scales, packed_mins) if t is not None):
        packed_scales, packed_mins = (None if t is None else t.half() for t in (packed_scales, packed_mins))
    return packed_q, packed_scales, packed_mins


def _pack_panel_integers(q: torch.Tensor, bits: int, layout: str, offset: int) -> torch.Tensor:
    """`pack_blocks`'s integers for rows q (whole panels of 16, the last zero-padded)."""
    out_features, in_features = q.shape
    num_blocks = in_features // QUANT_BLOCK
    panels = -(-out_features // QUANT_PANEL)
    if panels * QUANT_PANEL != out_features:
        q_padded = torch.zeros(panels * QUANT_PANEL, in_features, dtype=torch.int8)
        q_padded[:out_features] = q
        q = q_padded
    packed_q = q.reshape(panels, QUANT_PANEL, num_blocks, QUANT_BLOCK).permute(0, 2, 3, 1)  # [p][b][k][f]
    if layout == "dot":
        groups = packed_q.reshape(panels, num_blocks, QUANT_BLOCK // 4, 4, QUANT_PANEL).transpose(3, 4)  # [g][f][j]
        if bits == 8:
            return groups.reshape(panels, num_blocks, QUANT_BLOCK // 4, 64).contiguous()
        nibbles = groups.to(torch.int16).reshape(panels, num_blocks, QUANT_BLOCK // 8, 2, 64) + offset
        return (nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)).to(torch.uint8).contiguous()
    if bits == 4:
        nibbles = packed_q.to(torch.int16) + offset
        return (nibbles[..., :8] | (nibbles[..., 8:] << 4)).to(torch.uint8).contiguous()
    return packed_q.contiguous()


def _fits_float16(values: torch.Tensor) -> bool:
    """Whether float16 holds the dot layout's scales: every one finite there (no overflow). Those scales are
    read only where activations are rounded to int8 (a 2^-8 step), so a Q4_K or Q5_K product of two scales
    rounded to float16 (2^-11 relative; at most 2^-25 absolute below float16's normal range, where a block's
    weights are that small too) moves a weight by a small fraction of what rounding x moves its product."""
    return bool(torch.all(torch.isfinite(values.half())))


def packed_layout(q: torch.Tensor) -> str:
    """Which of `pack_blocks`'s layouts a packed q is in."""
    return "dot" if q.shape[-1] == 64 else "rows"


def unpack_blocks(q: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor], out_features: int
                  ) -> Int8Blocks:
    """`pack_blocks` undone (either layout): the integers, scales and mins per output feature."""
    offset = 0 if mins is not None else 8
    panels, num_blocks = q.shape[0], q.shape[1]
    if packed_layout(q) == "dot":
        if q.dtype == torch.uint8:  # [p][b][u][64]: inputs 8u..8u+3 low, 8u+4..8u+7 high
            q = torch.stack([(q & 0x0F).to(torch.int16), (q >> 4).to(torch.int16)], dim=3) - offset
        groups = q.reshape(panels, num_blocks, QUANT_BLOCK // 4, QUANT_PANEL, 4)  # [g][f][j]
        q = groups.transpose(3, 4).reshape(panels, num_blocks, QUANT_BLOCK, QUANT_PANEL)  # [k][f]
    elif q.dtype == torch.uint8:
        low, high = (q & 0x0F).to(torch.int16), (q >> 4).to(torch.int16)
        q = torch.cat([low, high], dim=-1) - offset
    rows = q.to(torch.int8).permute(0, 3, 1, 2).reshape(panels * QUANT_PANEL, num_blocks * QUANT_BLOCK)

    def per_feature(values: torch.Tensor) -> torch.Tensor:
        return values.float().permute(0, 2, 1).reshape(panels * QUANT_PANEL, num_blocks)[:out_features].contiguous()

    return Int8Blocks(rows[:out_features].contiguous(), per_feature(scales),
                      None if mins is None else per_feature(mins))


@dataclass
class PackedBlocks:
    """An `Int8Blocks` in one of `pack_blocks`'s layouts, as a `BlockQuantLinear` holds it."""

    q: torch.Tensor
    scales: torch.Tensor
    mins: Optional[torch.Tensor]
    out_features: int
    in_features: int

    @classmethod
    def of(cls, parts: list[Int8Blocks], layout: str, kernels=None) -> "PackedBlocks":
        """The parts stacked along the output features (one part: the matrix), packed."""
        return cls(*pack_block_parts(parts, layout, kernels), sum(len(part.q) for part in parts), parts[0].q.shape[1])


class BlockQuantLinear(nn.Module):
    """A linear whose weights stay block-quantized (`Int8Blocks`) at the width the GGUF stores them
    (4-bit Q4_0/Q4_1/Q4_K, 8-bit Q8_0/Q5_*), or a float weight rounded to Q8_0 at load (`from_weight`).
    No float copy of the weights is kept. `kernels.block_linear` does the matmul: on the CPU
    tokenmill's C++ kernel (float32; it reads the packed integers for decode steps and dequantizes
    cache-sized tiles for prefill chunks), on CUDA the Triton dequantize-and-matmul
    (`triton_quant_linear`, any float dtype) with the packed tensors moved to `device`.
    """

    def __init__(self, blocks: Int8Blocks | PackedBlocks, bias: torch.Tensor | None, kernels,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        # Packed where the loader left them (the CPU), then moved: a GPU holds no int16 intermediate.
        # In the layout the kernels read: `--block-matmul int8` keeps the integer dot products' own.
        self.out_features, self.in_features = blocks.q.shape if isinstance(blocks, Int8Blocks) else \
            (blocks.out_features, blocks.in_features)
        if self.in_features % QUANT_BLOCK:
            raise ValueError(f"block-quantized weights need in_features divisible by {QUANT_BLOCK}")
        layout = getattr(kernels, "weight_layout", "rows")
        if isinstance(blocks, Int8Blocks):
            blocks = PackedBlocks.of([blocks], layout)
        elif packed_layout(blocks.q) != layout:
            raise ValueError(f"blocks packed in the {packed_layout(blocks.q)!r} layout; these kernels read {layout!r}")
        packed = (blocks.q, blocks.scales, blocks.mins)
        self.q, self.scales, self.mins = (t if t is None or device is None else t.to(device) for t in packed)
        self.bits = 4 if self.q.dtype == torch.uint8 else 8
        self.bias = None if bias is None else bias.detach().float().to(device or bias.device)
        self.kernels = kernels

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernels,
                    device: Optional[torch.device] = None) -> "BlockQuantLinear":
        """`--quantization q8_0`: the float weight rounded to GGUF's Q8_0 at load (on the CPU, one matrix
        at a time, so a GPU holds no float32 copy of the largest matrix while it is rounded)."""
        return cls(Int8Blocks(*quantize_q8_0(weight.to("cpu"))), bias, kernels, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        y = self.kernels.block_linear(rows, self.q, self.scales, self.mins, self.bias, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)

    def blocks(self) -> Int8Blocks:
        """The integers, scales and mins per output feature (unpacked copies)."""
        return unpack_blocks(self.q, self.scales, self.mins, self.out_features)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the float weight, [len(ids), in_features]: q * scale (+ min) in float32 exactly
        as `Int8Blocks.dequantize` computes them, read from the packed storage (embedding lookups)."""
        panel, lane = ids // QUANT_PANEL, ids % QUANT_PANEL
        if packed_layout(self.q) == "dot":  # lane f's integers are bytes 4f..4f+3 of every group
            byte = 4 * lane.view(-1, 1) + torch.arange(4, device=ids.device)
            group = self.q[panel.view(-1, 1), :, :, byte].permute(0, 2, 3, 1)  # [tokens, blocks, group, 4]
            if self.bits == 8:
                q = group.reshape(ids.numel(), -1, QUANT_BLOCK).float()
            else:
                nibbles = torch.stack([group & 0x0F, group >> 4], dim=3).to(torch.int16)  # [tokens, blocks, u, 2, 4]
                q = (nibbles.reshape(ids.numel(), -1, QUANT_BLOCK) - (0 if self.mins is not None else 8)).float()
        elif self.bits == 8:
            q = self.q[panel, :, :, lane].float()  # [tokens, blocks, 32]
        else:
            byte = self.q[panel, :, :, lane % 8].to(torch.int16)
            q = ((byte >> (4 * (lane // 8)).view(-1, 1, 1)) & 0x0F) - (0 if self.mins is not None else 8)
            q = q.float()
        w = q * self.scales[panel, :, lane].float().unsqueeze(-1)
        if self.mins is not None:
            w = w + self.mins[panel, :, lane].float().unsqueeze(-1)
        return w.reshape(ids.numel(), self.in_features)

    def storage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.mins, self.bias) if t is not None)

    def extra_repr(self) -> str:
        kind = f"{self.bits}-bit blocks" + (" with mins" if self.mins is not None else "")
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


# The C++ module's `int8_dot` values that take integer dot products with SIMD, and how to name them.
INT8_DOT_PATHS = {"avx512_vnni": "AVX-512 VNNI", "avx2": "AVX2"}


def runs_int8_dot(kernels: Any) -> bool:
    """Whether `--block-matmul int8` can take integer dot products with these kernels on this CPU."""
    return getattr(kernels, "int8_dot", "portable") in INT8_DOT_PATHS


def runs_bf16_tiles(kernels: Any) -> bool:
    """Whether `--block-matmul bfloat16` can multiply in bfloat16 here: tokenmill's AMX tiles, or MKL's
    bfloat16 GEMM on a CPU with bfloat16 instructions."""
    return kernels.bf16_tiles() == "amx" or (kernels.bf16_gemm_available()
                                            and bool({"avx512_bf16", "amx_bf16"} & cpu_flags()))


class Int8ActivationKernels:
    """tokenmill's C++ kernels with every block-quantized matmul taking integer dot products
    (`--block-matmul int8`): `block_linear` is `block_linear_q8`, which rounds each row of x to int8 per
    block of 32 inputs (scale max|x| / 127, as llama.cpp rounds activations for its quantized matmuls)
    and multiplies the weight's integers with AVX-512 VNNI (VPDPBUSD) or AVX2 (VPMADDUBSW), whichever
    the kernels were built for; the fused decode stack does the same. The weights' values are unchanged
    (`BlockQuantLinear` keeps them in the dot products' layout, `weight_layout`, with float16 scales: exact
    for Q4_0/Q4_1/Q8_0 blocks, within 2^-11 for Q4_K/Q5_K's); the outputs differ from the float32 path by that
    rounding of x (the same bits on either path)."""

    int8_activations = True
    weight_layout = "dot"  # BlockQuantLinear keeps the weights as the dot products read them: no repacking per step

    def __init__(self, module: Any) -> None:
        self._module = module
        self.block_linear = module.block_linear_q8

    def __getattr__(self, name: str) -> Any:  # every other kernel is the module's own
        return getattr(self._module, name)


class Bf16TileKernels:
    """tokenmill's C++ kernels with block-quantized matmuls of more than 64 rows (prefill chunks) in
    bfloat16 (`--block-matmul bfloat16`): `block_linear` is `block_linear_bf16`, which rounds x and each
    dequantized tile of the weights to bfloat16 and multiplies them with float32 accumulation: through
    tokenmill's AMX-BF16 tile kernel where the CPU has AMX (each (panel, block) of the weights dequantized
    straight into a TDPBF16PS operand), else MKL's bfloat16 GEMM. Steps of up to 64 rows, and the fused
    decode stack, run the float32 kernels unchanged."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.block_linear = module.block_linear_bf16

    def __getattr__(self, name: str) -> Any:  # every other kernel is the module's own
        return getattr(self._module, name)


class Bf16TileInt8RowKernels:
    """`--block-matmul bfloat16-int8`: each step's block matmuls take the faster of the two rounded paths
    for their size. More than 64 rows (prefill chunks, mixed steps) as `Bf16TileKernels` (bfloat16 tiles:
    AMX where present, else MKL's GEMM); up to 64 rows (decode steps), and the fused decode stack, as
    `Int8ActivationKernels` (activations rounded to int8 per block of 32, integer dot products). On a CPU
    with AMX the bfloat16 tiles are the faster prefill and the integer rows the faster decode."""

    int8_activations = True  # the fused decode stack takes integer dot products

    def __init__(self, module: Any) -> None:
        self._module = module

    def block_linear(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
        linear = self._module.block_linear_bf16 if x.shape[0] > BLOCK_KERNEL_MAX_ROWS else self._module.block_linear_q8
        return linear(x, q, scales, mins, bias, out_features)

    def __getattr__(self, name: str) -> Any:  # every other kernel is the module's own
        return getattr(self._module, name)


class BlockQuantEmbedding(nn.Module):
    """An embedding table read from a `BlockQuantLinear`'s packed blocks (the tied LM head's, or the
    file's own token embedding): each lookup dequantizes only the rows it needs (torch ops, on the
    table's device), in float32, then rounds them to the model's `dtype`."""

    def __init__(self, table: BlockQuantLinear, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.dequantize_rows(input_ids.reshape(-1)).to(self.dtype)
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.table.bits}-bit blocks"
