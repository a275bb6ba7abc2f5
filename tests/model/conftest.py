"""The kernels' builds as a parameter: tests of a kernel's SIMD paths run on each."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module", params=["native", pytest.param("avx2", marks=pytest.mark.slow),
                                        pytest.param("portable", marks=pytest.mark.slow)])
def variant(request, kernels):
    """(name, module): the engine's own build (AVX-512 where the CPU has it), then builds limited to AVX2 and
    to portable C++ (each compiled once per machine; skipped where the CPU lacks AVX2)."""
    from tokenmill.model.layers import cpu_kernels

    if request.param == "native":
        return "native", kernels
    if request.param == "avx2" and kernels.simd == "portable":
        pytest.skip("this CPU has no AVX2")
    return request.param, cpu_kernels.load_variant(request.param)
