"""The triton dequantize-and-matmul against x @ W^T on the dequantized weights: every storage kind
`pack_blocks` produces (4-bit without mins as Q4_0, with mins as Q4_1/Q4_K; 8-bit as Q8_0/Q5_0, with
mins as Q5_1/Q5_K), GGUF's own blocks of each kept type, partial panels and tiles, any row count,
bias or none, float32/float16/bfloat16 inputs; and an engine whose kept GGUF blocks run through it.

Without a CUDA device the kernel runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set
here before the kernel is first imported); with one, the same tests run the compiled kernel on it.
Skipped, with the reason, where triton is not installed or, on the CPU, is older than 3.7.
"""
from __future__ import annotations

import pytest
import torch

from triton_setup import require_triton

require_triton()

from tokenmill.model.layers import triton_quant_linear  # noqa: E402
from tokenmill.model.layers.linear import BlockQuantLinear, Int8Blocks, pack_blocks  # noqa: E402
from tokenmill.model.layers.triton_quant_linear import TritonBlockKernels, block_kernel_problem  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# name: (integer range, with mins, storage bits)
KINDS = {
    "Q4_0": ((-8, 8), False, 4),
    "Q4_1": ((0, 16), True, 4),  # Q4_K's 32-value sub-blocks are stored the same way
    "Q8_0": ((-127, 128), False, 8),
    "Q5_1": ((0, 32), True, 8),  # 5-bit values do not fit a nibble: int8, with mins
}
ROWS, FEATURES, INPUTS = (1, 5, 33, 70), (32, 96, 160), (32, 96, 256)


@pytest.fixture(scope="module")
def triton_kernels():
    return TritonBlockKernels()


@pytest.fixture(autouse=True)
def gpu_tiles(monkeypatch):
    """The kernel-level tests run the tiles a GPU runs (several feature tiles per matrix), in the interpreter too."""
    monkeypatch.setattr(triton_quant_linear, "INTERPRETED_BLOCK_N", triton_quant_linear.BLOCK_N)


def random_blocks(kind: str, out_features: int, in_features: int, gen: torch.Generator) -> Int8Blocks:
    (low, high), with_mins, _ = KINDS[kind]
    q = torch.randint(low, high, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = torch.rand(out_features, in_features // 32, generator=gen) * 0.05
    mins = -torch.rand(scales.shape, generator=gen) * 0.2 if with_mins else None
    return Int8Blocks(q, scales, mins)


def run(kernels, blocks: Int8Blocks, x: torch.Tensor, bias) -> torch.Tensor:
    packed = [None if t is None else t.to(DEVICE) for t in pack_blocks(blocks)]
    bias = None if bias is None else bias.to(DEVICE)
    return kernels.block_linear(x.to(DEVICE), *packed, bias, blocks.q.shape[0]).cpu()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_shape_matches_the_dequantized_matmul(triton_kernels, kind):
    """Float32 inputs: the same sum as x @ dequantize().T up to float32 rounding, for every row count
    (one and several row tiles), partial panels and feature tiles, one to eight blocks of inputs."""
    gen = torch.Generator().manual_seed(len(kind))
    assert pack_blocks(random_blocks(kind, 16, 32, gen))[0].dtype == (torch.uint8 if KINDS[kind][2] == 4
                                                                      else torch.int8)
    for n in FEATURES:
        for k in INPUTS:
            blocks = random_blocks(kind, n, k, gen)
            weight = blocks.dequantize()
            for m in ROWS:
                x = torch.randn(m, k, generator=gen)
                for bias in (None, torch.randn(n, generator=gen)):
                    expected = x @ weight.T + (0 if bias is None else bias)
                    got = run(triton_kernels, blocks, x, bias)
                    assert got.dtype == torch.float32 and got.shape == (m, n)
                    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5,
                                               msg=f"{kind} m={m} n={n} k={k} bias={bias is not None}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_half_inputs_give_half_outputs(triton_kernels, kind, dtype):
    """16-bit x: output in x's dtype, within its rounding of the float32 result on the same x."""
    gen = torch.Generator().manual_seed(7)
    for m, n, k in ((1, 96, 256), (33, 160, 96)):
        blocks = random_blocks(kind, n, k, gen)
        bias = torch.randn(n, generator=gen)
        x = torch.randn(m, k, generator=gen).to(dtype)
        expected = x.float() @ blocks.dequantize().T + bias
        got = run(triton_kernels, blocks, x, bias)
        assert got.dtype == dtype
        scale = float(expected.abs().max())
        torch.testing.assert_close(got.float(), expected, atol=2e-2 * scale, rtol=2e-2)


def test_gguf_blocks_of_every_kept_type(triton_kernels):
    """The file's own blocks (gguf_int8_blocks of random GGUF data) for each type kept quantized."""
    pytest.importorskip("gguf")
    from test_gguf_int8 import random_gguf_tensor

    from tokenmill.model.gguf_loader import INT8_BLOCK_TYPES, gguf_int8_blocks

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=gen)
    for type_name in sorted(INT8_BLOCK_TYPES):
        blocks = gguf_int8_blocks(random_gguf_tensor(type_name, 40, 256, seed=len(type_name)))
        expected = x @ blocks.dequantize().T
        got = run(triton_kernels, blocks, x, None)
        torch.testing.assert_close(got, expected, atol=1e-5 * float(expected.abs().max()), rtol=1e-5,
                                   msg=type_name)


def test_layer_runs_the_triton_kernel_and_holds_no_float_weight(triton_kernels):
    """A BlockQuantLinear built with the triton kernels on the device: packed integers, scales, mins
    and bias there, no float tensor as large as the weight; any leading shape; rows of its table for
    embedding lookups come from the same storage on the device."""
    gen = torch.Generator().manual_seed(11)
    blocks = random_blocks("Q4_1", 48, 128, gen)
    bias = torch.randn(48, generator=gen)
    layer = BlockQuantLinear(blocks, bias, triton_kernels, device=DEVICE)
    held = {name: t for name, t in vars(layer).items() if isinstance(t, torch.Tensor)}
    assert set(held) == {"q", "scales", "mins", "bias"} and all(t.device.type == DEVICE.type for t in held.values())
    assert layer.bits == 4 and layer.q.dtype == torch.uint8
    assert not [name for name, t in held.items() if t.is_floating_point() and t.numel() >= 48 * 128]
    assert not list(layer.parameters())
    x = torch.randn(2, 3, 128, generator=gen)
    torch.testing.assert_close(layer(x.to(DEVICE)).cpu(), x @ blocks.dequantize().T + bias, atol=1e-4, rtol=1e-5)
    ids = torch.tensor([0, 47, 17, 8])
    assert torch.equal(layer.dequantize_rows(ids.to(DEVICE)).cpu(), blocks.dequantize()[ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_start_up_check_passes(triton_kernels, dtype):
    assert block_kernel_problem(triton_kernels, DEVICE, dtype) is None



@pytest.mark.slow
def test_engine_runs_kept_gguf_blocks_through_triton(kernels, tiny_gguf_path, tiny_llama_dir, smollm2_tokenizer,
                                                     monkeypatch):
    """The runner's CUDA path: a GGUF's kept blocks become triton block layers on the device (no C++ fused
    decode stack), no float copy of any projection is held, and greedy tokens equal those of the C++
    block kernels on the CPU. Without a GPU the runner is handed the interpreted kernels on the CPU, with
    the interpreter's wide tiles (the head's 49k features in 48 programs rather than 768)."""
    monkeypatch.setattr(triton_quant_linear, "INTERPRETED_BLOCK_N", 1024)
    from test_gguf_int8 import greedy

    from tokenmill import LLM
    from tokenmill.model.layers.linear import BlockQuantEmbedding
    from tokenmill.model.layers.linear_method import LinearMethods

    def engine(device: str):
        return LLM(str(tiny_gguf_path), tokenizer=str(tiny_llama_dir), max_num_batched_tokens=24, num_kv_blocks=64,
                   max_model_len=512, dtype="float32", device=device, block_matmul="float32", kv_cache_dtype="float32")

    lengths = [6, 4, 5, 3]
    expected = greedy(engine("cpu"), smollm2_tokenizer, lengths)[1]
    if DEVICE.type == "cpu":
        triton_kernels = TritonBlockKernels()
        monkeypatch.setattr(LinearMethods, "block_kernels", property(lambda self: triton_kernels))
    llm = engine(DEVICE.type)
    runner = llm.llm_engine.core.core.runner
    model = runner.model
    assert "triton dequantize-and-matmul" in runner.linear_layers and model._int8_decode is None
    layers = [m for m in model.modules() if isinstance(m, BlockQuantLinear)]
    assert len(layers) == 4 * len(model.layers) + 2
    assert all(isinstance(layer.kernels, TritonBlockKernels) and layer.q.device.type == DEVICE.type
               for layer in layers)
    assert isinstance(model.embed_tokens, BlockQuantEmbedding)
    smallest = min(layer.in_features * layer.out_features for layer in layers)
    tensors = list(model.parameters()) + [t for layer in layers for t in vars(layer).values()
                                          if isinstance(t, torch.Tensor)]
    assert not [tuple(t.shape) for t in tensors if t.is_floating_point() and t.numel() >= smallest and t.dim() == 2]
    assert greedy(llm, smollm2_tokenizer, lengths)[1] == expected
