"""Triton in the tests: without a CUDA device its kernels run in Triton's interpreter on CPU tensors,
which must be switched on (TRITON_INTERPRET=1) before the kernels are first imported."""
from __future__ import annotations

import os

import pytest
import torch


def interpret_without_cuda() -> None:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def require_triton():
    """The triton module, or the calling test module skipped with the reason."""
    interpret_without_cuda()
    if torch.cuda.is_available():
        return pytest.importorskip("triton", reason="triton is not installed (CUDA builds of torch ship it)")
    # Older interpreters index NumPy arrays in ways NumPy 2 refuses.
    return pytest.importorskip("triton", minversion="3.7",
                               reason="the CPU interpreter needs triton >= 3.7 (a test extra)")
