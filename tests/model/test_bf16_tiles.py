"""`--block-matmul bfloat16`: steps of more than 64 rows multiply the kept blocks in bfloat16 (x and each
dequantized tile rounded to it, float32 accumulation through MKL's bfloat16 GEMM), smaller steps as the
float32 kernel. Per GGUF block type against a float64 product of the same rounded values; and the
engine's greedy tokens against HF transformers whose prefill-sized linear products round the same way."""
from __future__ import annotations

import pytest
import torch
from test_block_kernels import file_blocks
from test_gguf_int8 import hf_on_file_weights
from test_int8_dot import engine_with_block_matmul

from model_factory import hf_greedy
from tokenmill import SamplingParams
from tokenmill.model.gguf_loader import INT8_BLOCK_TYPES
from tokenmill.model.layers.cpu_kernels import cpu_flags
from tokenmill.model.layers.linear import BLOCK_KERNEL_MAX_ROWS, Bf16TileKernels, pack_blocks, runs_bf16_tiles


@pytest.fixture(scope="module")
def bf16(kernels):
    if not runs_bf16_tiles(kernels):
        pytest.skip("no AMX-BF16, and no MKL bfloat16 GEMM with AVX-512 BF16, on this CPU")
    return kernels


def bf16_product(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().double() @ dense.bfloat16().double().T + bias.double()


@pytest.mark.parametrize("type_name", sorted(INT8_BLOCK_TYPES))
def test_bf16_tiles_per_block_type(bf16, type_name):
    blocks, dense = file_blocks(type_name, seed=len(type_name) + 7)
    packed = pack_blocks(blocks)
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(37, generator=gen)
    for rows in (BLOCK_KERNEL_MAX_ROWS + 1, 96, 200):  # AMX pads rows to blocks of 32
        x = torch.randn(rows, dense.shape[1], generator=gen)
        y = bf16.block_linear_bf16(x, *packed, bias, 37)
        expected = bf16_product(x, dense, bias)
        # float32 accumulation of exact bf16 x bf16 products: a float32 rounding away, not bf16's
        torch.testing.assert_close(y.double(), expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5,
                                   msg=f"{type_name} rows={rows}")
        exact = x.double() @ dense.double().T + bias.double()
        assert (y.double() - exact).abs().max() > 1e-4 * exact.abs().max()  # it did round to bfloat16
    # up to the row kernel's limit, the float32 kernel's own bits
    x = torch.randn(BLOCK_KERNEL_MAX_ROWS, dense.shape[1], generator=gen)
    assert torch.equal(bf16.block_linear_bf16(x, *packed, bias, 37), bf16.block_linear(x, *packed, bias, 37))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0"])
def test_bf16_tiles_whole_output_blocks_without_bias(bf16, type_name):
    """96 features, no bias: AMX writes whole 32 x 32 blocks of y straight from its accumulators and the
    ragged ones (the last 8 of 200 rows) through its buffer; both must give the same product."""
    blocks, dense = file_blocks(type_name, out_features=96, seed=3)
    packed = pack_blocks(blocks)
    gen = torch.Generator().manual_seed(9)
    for rows in (96, 200):
        x = torch.randn(rows, dense.shape[1], generator=gen)
        y = bf16.block_linear_bf16(x, *packed, None, 96)
        expected = bf16_product(x, dense, torch.zeros(96))
        torch.testing.assert_close(y.double(), expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5,
                                   msg=f"{type_name} rows={rows}")


def test_amx_tiles_run_where_the_cpu_has_them(bf16):
    """On a CPU with AMX-BF16 the tiles above went through tokenmill's own TDPBF16PS kernel, not MKL."""
    if "amx_bf16" not in cpu_flags():
        pytest.skip("no AMX-BF16 on this CPU")
    assert bf16.bf16_tiles() == "amx"


class PrefillRoundedLinear(torch.nn.Module):
    """HF's nn.Linear multiplying in bfloat16 (float32 accumulation) when it gets more than 64 rows."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= BLOCK_KERNEL_MAX_ROWS:
            return self.linear(x)
        w = self.linear.weight.bfloat16().float()
        y = torch.nn.functional.linear(rows.bfloat16().float(), w, self.linear.bias)
        return y.reshape(*x.shape[:-1], -1)


def test_engine_bf16_prefill_matches_hf_with_the_same_rounding(bf16, tiny_gguf_path, tiny_llama_dir,
                                                               smollm2_tokenizer):
    """Prompts of 70-110 tokens prefilled in one step each (the engine's layers see more than 64 rows and
    round; decode steps do not), against HF with its projections rounded the same way on the prompt
    pass. The LM head computes only the sampled rows in the engine, so HF's stays exact."""
    llm, runner = engine_with_block_matmul(tiny_gguf_path, tiny_llama_dir, "bfloat16", Bf16TileKernels, 256)
    assert "bfloat16" in runner.linear_layers
    exact = hf_on_file_weights(tiny_gguf_path, tiny_llama_dir)
    hf = hf_on_file_weights(tiny_gguf_path, tiny_llama_dir)
    for name, module in list(hf.named_modules()):
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            parent, _, leaf = name.rpartition(".")
            setattr(hf.get_submodule(parent), leaf, PrefillRoundedLinear(module))
    texts = ["The capital of France is Paris, and the capital of Italy is Rome. " * 5,
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 3,
             "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25,"]
    gap = err = 0.0
    for text, new_tokens in zip(texts, (12, 16, 10)):
        ids = smollm2_tokenizer.encode(text)
        assert BLOCK_KERNEL_MAX_ROWS < len(ids) <= 256
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=5)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == hf_greedy(hf, ids, new_tokens)
        # The first token's logprobs come from the prefill pass: the rounded reference's, not the exact one's.
        with torch.no_grad():
            rounded = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1)
            unrounded = torch.log_softmax(exact(torch.tensor([ids])).logits[0, -1].double(), -1)
        for token, entry in out.logprobs[0].items():
            err = max(err, abs(entry.logprob - rounded[token].item()))
            gap = max(gap, abs(rounded[token].item() - unrounded[token].item()))
    # Within float32 summation noise of the rounded reference (measured 7e-7), while the rounding itself
    # moves these logprobs by ~1e-3: the check can tell one from the other.
    assert err < 2e-5 and gap > 2e-4
