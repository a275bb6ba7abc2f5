"""Block-quantized linear layers on CUDA: GGUF's kept blocks (and `--quantization q8_0`) through a
Triton dequantize-and-matmul instead of a dense float copy of the model.

`TritonBlockKernels.block_linear` takes the same arguments as the C++ CPU kernels' `block_linear`
(`pack_blocks`' layout), so a `BlockQuantLinear` built with it and placed on the GPU runs the Triton
kernel unchanged. The kernel (`triton_quant_linear_kernels.py`) is imported when the object is
built, so tokenmill imports without triton. On the CPU it runs only under Triton's interpreter
(TRITON_INTERPRET=1 before the first import), which is how the tests check it without a GPU; there
NumPy has no bfloat16, so tiles are widened to float32 first.

Tile sizes are unmeasured starting points: no GPU measurement of this path exists yet.
"""
from __future__ import annotations

from typing import Optional

import torch

from tokenmill.model.layers.linear import QUANT_BLOCK, QUANT_PANEL, Int8Blocks, pack_blocks

BLOCK_N = 64  # output features per program: four panels of 16
# Under Triton's interpreter (the CPU, in tests) programs run one after another in Python, each paying a fixed
# cost: wider tiles there make the same products in far fewer programs.
INTERPRETED_BLOCK_N = 1024


def _block_m(rows: int) -> int:
    """Rows per program: at least 16 (tl.dot's smallest), padded with masked rows."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


class TritonBlockKernels:
    """`block_linear` for tensors on the GPU (or the CPU under Triton's interpreter)."""

    name = "triton"

    def __init__(self) -> None:
        from tokenmill.model.layers import triton_quant_linear_kernels

        self._kernels = triton_quant_linear_kernels

    def block_linear(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: Optional[torch.Tensor],
                     bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
        """x [rows, in_features] (float32/float16/bfloat16) times the packed weight's transpose, plus bias
        (float32); [rows, out_features] in x's dtype, accumulated in float32."""
        import triton.language as tl

        rows, in_features = x.shape
        if in_features % QUANT_BLOCK or q.shape[1] * QUANT_BLOCK != in_features:
            raise ValueError(f"x has {in_features} inputs; the blocks hold {q.shape[1] * QUANT_BLOCK}")
        if q.shape[0] * QUANT_PANEL < out_features:
            raise ValueError(f"the blocks hold {q.shape[0] * QUANT_PANEL} features, fewer than {out_features}")
        dtypes = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
        if x.dtype not in dtypes:
            raise ValueError(f"triton block_linear takes float32/float16/bfloat16 inputs, got {x.dtype}")
        if x.stride(-1) != 1:
            x = x.contiguous()
        y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
        if rows == 0 or out_features == 0:
            return y
        compute = tl.float32 if self._kernels.INTERPRETED or x.dtype == torch.float32 else dtypes[x.dtype]
        block_m = _block_m(rows)
        block_n = INTERPRETED_BLOCK_N if self._kernels.INTERPRETED else BLOCK_N
        grid = (-(-rows // block_m), -(-out_features // block_n))
        self._kernels.block_linear_kernel[grid](
            x, q, scales, mins if mins is not None else scales, bias if bias is not None else scales, y,
            rows, out_features, in_features // QUANT_BLOCK, x.stride(0), y.stride(0),
            BITS=8 if q.dtype == torch.int8 else 4, HAS_MINS=mins is not None, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, COMPUTE=compute, IEEE=compute == tl.float32)
        return y


# Start-up check: each storage kind on a shape with a partial panel, a partial tile and several blocks.
_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def block_kernel_problem(kernels: TritonBlockKernels, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why `kernels` cannot serve `dtype` on `device` (a compile error, or a result off the float32
    reference), or None when 4-bit (with and without mins) and 8-bit blocks all agree with it."""
    gen = torch.Generator().manual_seed(0)
    out_features, in_features, rows = 40, 96, 5
    x = torch.randn(rows, in_features, generator=gen)
    for low, high, with_mins in ((-8, 8, False), (0, 16, True), (-127, 128, False)):
        q = torch.randint(low, high, (out_features, in_features), generator=gen, dtype=torch.int8)
        scales = torch.rand(out_features, in_features // QUANT_BLOCK, generator=gen) * 0.02
        mins = -torch.rand(scales.shape, generator=gen) * 0.1 if with_mins else None
        blocks = Int8Blocks(q, scales, mins)
        bias = torch.randn(out_features, generator=gen)
        expected = x.to(dtype).float() @ blocks.dequantize().T + bias
        packed = [None if t is None else t.to(device) for t in pack_blocks(blocks)]
        try:
            got = kernels.block_linear(x.to(device, dtype), *packed, bias.to(device), out_features).float().cpu()
        except Exception as error:  # noqa: BLE001  (a compiler's failure has no fixed type)
            return f"{type(error).__name__}: {error}"
        error = float((got - expected).abs().max() / expected.abs().max())
        if not error <= _CHECK_TOLERANCE[dtype]:
            bits = 4 if high <= 16 else 8
            return f"{bits}-bit blocks{' with mins' if with_mins else ''}: relative error {error:.2g}"
    return None


def load_triton_block_kernels(device: torch.device, dtype: torch.dtype) -> tuple[Optional[TritonBlockKernels], str]:
    """(kernels, "") where the Triton block kernel runs on `device` and passes its check in `dtype`,
    else (None, the reason)."""
    from tokenmill.model.layers.attention.triton_backend import triton_unavailable_reason

    reason = triton_unavailable_reason(device)
    if reason is not None:
        return None, reason
    try:
        kernels = TritonBlockKernels()
    except Exception as error:  # noqa: BLE001  (triton's import can fail in many ways)
        return None, f"{type(error).__name__}: {error}"
    problem = block_kernel_problem(kernels, device, dtype)
    return (None, f"its start-up check failed ({problem})") if problem is not None else (kernels, "")
