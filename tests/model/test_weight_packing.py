"""The C++ load-time weight work (csrc/weight_packing.cpp) against its Python references, bit for bit: the
kernels' panel layouts of block integers, a GGUF Q4_K matrix's integers, scales and mins, and a Q6_K matrix
rounded to Q8_0."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gguf_int8 import random_gguf_tensor

from tokenmill.model.gguf_loader import _DEQUANTIZERS, _in_chunks, _raw_blocks, _unpack_q4_k
from tokenmill.model.layers.linear import _pack_panel_integers, quantize_q8_0


@pytest.mark.parametrize("layout", ["rows", "dot"])
@pytest.mark.parametrize("bits,offset", [(8, 0), (8, 8), (4, 0), (4, 8)])
@pytest.mark.parametrize("out_features", [16, 37])  # whole panels; a padded last panel
def test_panel_integers_as_python_packs_them(kernels, layout, bits, offset, out_features):
    gen = torch.Generator().manual_seed(out_features + bits)
    low, high = (-offset, 16 - offset) if bits == 4 else (-128, 128)
    q = torch.randint(low, high, (out_features, 96), generator=gen, dtype=torch.int8)
    expected = _pack_panel_integers(q, bits, layout, offset)
    packed = kernels.pack_block_integers([q[:5], q[5:]], bits, layout == "dot", offset)  # two parts, stacked
    assert packed.dtype == expected.dtype and packed.shape == expected.shape
    assert torch.equal(packed, expected)


def test_q4_k_unpacked_as_numpy_unpacks_it(kernels):
    raw = _raw_blocks(random_gguf_tensor("Q4_K", 40, 512, seed=11))
    q, scales, mins = kernels.unpack_q4_k(torch.from_numpy(np.ascontiguousarray(raw)))
    ref_q, ref_scales, ref_mins = _unpack_q4_k(raw)
    assert torch.equal(q, torch.from_numpy(ref_q.astype(np.int8)))
    assert torch.equal(scales, torch.from_numpy(ref_scales.astype(np.float32)))
    assert torch.equal(mins, torch.from_numpy(ref_mins.astype(np.float32)))


def test_q6_k_rounded_to_q8_0_as_python_rounds_it(kernels):
    raw = _raw_blocks(random_gguf_tensor("Q6_K", 40, 512, seed=13))
    dense = torch.from_numpy(_in_chunks(_DEQUANTIZERS["Q6_K"], raw, 256).reshape(40, 512))
    q, scales = kernels.q6_k_to_q8_0(torch.from_numpy(np.ascontiguousarray(raw)))
    ref_q, ref_scales = quantize_q8_0(dense)
    assert torch.equal(q.reshape(40, 512), ref_q) and torch.equal(scales.reshape(40, 16), ref_scales)


@pytest.mark.parametrize("layout", ["rows", "dot"])
@pytest.mark.parametrize("type_name", ["Q4_K", "Q4_0", "Q8_0"])
def test_layers_packed_by_the_kernels_hold_the_same_bytes(kernels, layout, type_name):
    from tokenmill.model.gguf_loader import gguf_int8_blocks
    from tokenmill.model.layers.linear import pack_blocks

    tensor = random_gguf_tensor(type_name, 37, 512, seed=5)
    blocks = gguf_int8_blocks(tensor)
    assert torch.equal(gguf_int8_blocks(tensor, kernels).q, blocks.q)
    for ours, reference in zip(pack_blocks(blocks, layout=layout, kernels=kernels), pack_blocks(blocks, layout=layout)):
        assert (ours is None and reference is None) or torch.equal(ours, reference)


@pytest.mark.parametrize("layout", ["rows", "dot"])
def test_fused_parts_packed_in_place_equal_packing_them_stacked(kernels, layout):
    """A fused q/k/v of a Q4_K_M file: 4-bit parts with mins beside a Q8_0 one without (stored at 8 bits)."""
    from tokenmill.model.gguf_loader import gguf_int8_blocks
    from tokenmill.model.layers.linear import Int8Blocks, PackedBlocks, pack_blocks

    parts = [gguf_int8_blocks(random_gguf_tensor(name, rows, 512, seed=rows))
             for name, rows in (("Q4_K", 48), ("Q4_K", 16), ("Q8_0", 21))]
    for chosen in (parts[:2], parts):
        packed = PackedBlocks.of(chosen, layout, kernels)
        reference = pack_blocks(Int8Blocks.cat(chosen), layout=layout)
        assert packed.out_features == sum(len(part.q) for part in chosen) and packed.in_features == 512
        for ours, theirs in zip((packed.q, packed.scales, packed.mins), reference):
            assert torch.equal(ours, theirs)
