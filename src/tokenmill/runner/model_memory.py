"""Bytes a model's tensors hold on its device: weights (parameters, and the packed tensors block-quantized
layers keep as attributes) and buffers (rotary tables), for the start-up memory report."""
from __future__ import annotations

import torch


def model_tensor_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(weights, buffers) in bytes: parameters and the tensors block-quantized layers keep as attributes;
    then buffers (rotary tables), each storage counted once (a tied head and its embedding are one table)."""
    weights, buffers = tensor_storages(model)
    return sum(weights.values()), sum(size for ptr, size in buffers.items() if ptr not in weights)


def tensor_storages(module: torch.nn.Module) -> tuple[dict[int, int], dict[int, int]]:
    """({storage address: bytes} of the weights, of the buffers) that a module and its children hold, each
    storage once; oneDNN's packed weights (no storage to share) under their object's id."""
    weights: dict[int, int] = {}
    buffers: dict[int, int] = {}
    for child in module.modules():
        held = [*child.parameters(recurse=False),
                *(value for value in vars(child).values() if isinstance(value, torch.Tensor))]
        for into, tensors in ((weights, held), (buffers, list(child.buffers(recurse=False)))):
            for tensor in tensors:
                if tensor.is_mkldnn:  # oneDNN's own layout (PackedLinear): no storage to share
                    into[id(tensor)] = tensor.numel() * tensor.element_size()
                    continue
                storage = tensor.untyped_storage()
                into[storage.data_ptr()] = storage.nbytes()
    return weights, buffers
