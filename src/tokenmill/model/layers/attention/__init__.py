"""Attention over the paged KV cache, one module per backend behind one small interface (base.py):
`prepare_metadata(inputs)` once per step builds the backend's own metadata, then each layer calls `forward`.

- torch_backend: portable (CPU or any GPU), gathers blocks and runs torch's SDPA;
- cpu_backend: tokenmill's C++ kernels read the cache in place (the default on CPU where they build);
- triton_backend: Triton kernels (the default on CUDA where triton imports).
"""
from __future__ import annotations

import torch

from tokenmill.config import ATTENTION_BACKENDS
from tokenmill.model.layers.attention.base import AttentionBackend, AttentionInputs, AttentionMetadata
from tokenmill.model.layers.attention.cpu_backend import CpuPagedAttentionBackend
from tokenmill.model.layers.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionInputs", "AttentionMetadata", "CpuPagedAttentionBackend",
           "TorchAttentionBackend", "get_attention_backend"]


def get_attention_backend(device: torch.device, name: str = "auto", cache_dtype: torch.dtype = torch.float32,
                          bf16_block_matmul: bool = False) -> AttentionBackend:
    """`auto`: the triton kernels on CUDA when triton imports; on CPU the C++ paged kernels when they
    build here; else the portable torch backend. An explicit choice that cannot run raises, naming why.
    cache_dtype, bf16_block_matmul: the KV cache's dtype, and whether block-quantized projections multiply
    prefill steps in bfloat16 (the C++ backend then attends prefill chunks in bfloat16 products too). An int8
    cache (kv_int8) is read by the C++ kernels and the torch backend; on CUDA `auto` takes the torch one.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(ATTENTION_BACKENDS)}")
    if name == "triton" and cache_dtype == torch.int8:
        raise ValueError("the triton attention backend does not read an int8 KV cache; use --attention-backend torch")
    if name == "triton" or (name == "auto" and device.type == "cuda" and cache_dtype != torch.int8):
        from tokenmill.model.layers.attention import triton_backend

        if name == "triton" or triton_backend.triton_unavailable_reason(device) is None:
            return triton_backend.make_triton_backend(device)
    if name == "torch" or device.type != "cpu":
        if name == "cpu":
            raise ValueError("the cpu attention backend runs only on the CPU device")
        return TorchAttentionBackend()
    from tokenmill.model.layers import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        if name == "cpu":
            raise RuntimeError(f"the cpu attention backend is unavailable: {cpu_kernels.build_error()}")
        return TorchAttentionBackend()
    return CpuPagedAttentionBackend(kernels, cache_dtype, bf16_block_matmul)
