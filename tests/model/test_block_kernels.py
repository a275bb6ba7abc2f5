"""The block-quantized linear kernel per GGUF block type and per SIMD path: GGUF's blocks as the file
stores them (4-bit Q4_*, 8-bit Q8_0 / Q5_*), against gguf-py's dequantized values, through the row
path (decode steps) and the dequantized-tile path (prefill chunks), on this CPU's widest SIMD and on
the narrower builds of the same source (AVX2, portable C++)."""
from __future__ import annotations

import pytest
import torch
from test_gguf_int8 import random_gguf_tensor

from tokenmill.model.gguf_loader import INT8_BLOCK_TYPES, gguf_int8_blocks
from tokenmill.model.layers.linear import (
    BLOCK_KERNEL_MAX_ROWS,
    BlockQuantLinear,
    Int8Blocks,
    pack_blocks,
    unpack_blocks,
)

FOUR_BIT_TYPES = {"Q4_0", "Q4_1", "Q4_K"}
ROWS = [1, 5, 9, 16, BLOCK_KERNEL_MAX_ROWS, BLOCK_KERNEL_MAX_ROWS + 1, 200]


def file_blocks(type_name: str, out_features: int = 37, seed: int = 0) -> tuple[Int8Blocks, torch.Tensor]:
    """Random blocks of a GGUF type and gguf-py's dequantized matrix of them."""
    from gguf import quants

    in_features = 512 if type_name.endswith("_K") else 128
    tensor = random_gguf_tensor(type_name, out_features, in_features, seed=seed)
    expected = quants.dequantize(tensor.data, tensor.tensor_type).reshape(out_features, in_features)
    return gguf_int8_blocks(tensor), torch.from_numpy(expected.copy())


@pytest.mark.parametrize("type_name", sorted(INT8_BLOCK_TYPES))
def test_layers_keep_each_type_at_its_width(kernels, type_name):
    blocks, dense = file_blocks(type_name)
    layer = BlockQuantLinear(blocks, None, kernels)
    assert layer.bits == (4 if type_name in FOUR_BIT_TYPES else 8)
    assert layer.q.dtype == (torch.uint8 if layer.bits == 4 else torch.int8)
    assert layer.q.numel() == -(-37 // 16) * 16 * dense.shape[1] * layer.bits // 8
    unpacked = unpack_blocks(layer.q, layer.scales, layer.mins, layer.out_features)
    assert torch.equal(unpacked.dequantize(), dense)
    ids = torch.tensor([0, 7, 8, 15, 16, 36])
    assert torch.equal(layer.dequantize_rows(ids), dense[ids])


@pytest.mark.parametrize("type_name", sorted(INT8_BLOCK_TYPES))
def test_kernel_computes_gguf_values_on_every_path(variant, type_name):
    name, module = variant
    blocks, dense = file_blocks(type_name, seed=len(type_name))
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(37, generator=gen)
    packed = pack_blocks(blocks)
    for rows in ROWS:
        x = torch.randn(rows, dense.shape[1], generator=gen)
        y = module.block_linear(x, *packed, bias, 37)
        expected = x.double() @ dense.double().T + bias.double()
        torch.testing.assert_close(y.double(), expected, atol=2e-4, rtol=1e-4, msg=f"{name} {type_name} rows={rows}")


@pytest.mark.parametrize("type_name", sorted(FOUR_BIT_TYPES))
def test_four_bit_storage_gives_the_same_bits_as_eight(variant, type_name):
    """The row path widens nibbles to the very integers an int8 copy holds, so 4- and 8-bit storage of
    the same blocks agree bit for bit, and a row's result does not depend on its batch."""
    name, module = variant
    blocks, _ = file_blocks(type_name, seed=9)
    four, eight = pack_blocks(blocks), pack_blocks(blocks, bits=8)
    assert four[0].dtype == torch.uint8 and eight[0].dtype == torch.int8
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 3, 8, 11, BLOCK_KERNEL_MAX_ROWS):
        x = torch.randn(rows, blocks.q.shape[1], generator=gen)
        y = module.block_linear(x, *four, None, 37)
        assert torch.equal(y, module.block_linear(x, *eight, None, 37)), f"{name} rows={rows}"
        assert torch.equal(y[-1:], module.block_linear(x[-1:].contiguous(), *four, None, 37))


def test_simd_paths_agree_bit_for_bit_on_the_row_path(kernels):
    """AVX-512 lanes run the AVX2 tile's operations in the same order: where both exist they agree."""
    from tokenmill.model.layers import cpu_kernels

    if kernels.simd != "avx512":
        pytest.skip("needs an AVX-512 CPU")
    narrower = cpu_kernels.load_variant("avx2")
    blocks, _ = file_blocks("Q4_K", seed=2)
    packed = pack_blocks(blocks)
    x = torch.randn(BLOCK_KERNEL_MAX_ROWS, blocks.q.shape[1], generator=torch.Generator().manual_seed(8))
    for rows in (1, 7, 8, 9, BLOCK_KERNEL_MAX_ROWS):
        assert torch.equal(kernels.block_linear(x[:rows], *packed, None, 37),
                           narrower.block_linear(x[:rows], *packed, None, 37))


@pytest.mark.parametrize("in_features", [96, 576])
def test_row_path_bits_do_not_depend_on_the_batch_at_any_width(kernels, in_features):
    """A row's bits are its bits in any batch (tiles of 1-3 rows against the 9-row tile) and on the AVX2
    path, at block counts that are not powers of two (3, and 18: the embedded model's hidden size)."""
    from tokenmill.model.layers import cpu_kernels

    gen = torch.Generator().manual_seed(in_features)
    blocks = Int8Blocks(torch.randint(0, 16, (40, in_features), generator=gen).to(torch.int8),
                        torch.rand(40, in_features // 32, generator=gen),
                        torch.randn(40, in_features // 32, generator=gen))
    packed = pack_blocks(blocks)
    x = torch.randn(9, in_features, generator=gen)
    batch = kernels.block_linear(x, *packed, None, 40)
    for rows in (1, 2, 3):
        assert torch.equal(kernels.block_linear(x[:rows], *packed, None, 40), batch[:rows]), f"rows={rows}"
    torch.testing.assert_close(batch.double(), x.double() @ blocks.dequantize().double().T, atol=1e-4, rtol=1e-4)
    if kernels.simd == "avx512":
        narrower = cpu_kernels.load_variant("avx2")
        for rows in (1, 2, 9):
            assert torch.equal(narrower.block_linear(x[:rows], *packed, None, 40), batch[:rows]), f"avx2 rows={rows}"


def test_kernel_rejects_mismatched_storage(kernels):
    blocks, _ = file_blocks("Q4_1")
    q, scales, mins = pack_blocks(blocks)
    with pytest.raises(RuntimeError):  # 4-bit storage read as if it held 8-bit rows
        kernels.block_linear(torch.randn(1, 128), q.view(torch.int8), scales, mins, None, 37)
    with pytest.raises(RuntimeError):
        kernels.block_linear(torch.randn(1, 128), q.float(), scales, mins, None, 37)
