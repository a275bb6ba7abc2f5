"""The numerics chosen from the hardware (runner.numerics): every CPU feature set with its flags injected, the
exact mode, explicit values, and what an engine on this machine reports."""
from __future__ import annotations

import pytest

from tokenmill.config import EngineConfig
from tokenmill.errors import InvalidRequestError
from tokenmill.runner.numerics import Hardware, detect_hardware, resolve_numerics

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi"}
AVX512_VNNI = AVX512 | {"avx512_vnni"}
EPYC_ZEN4 = AVX512_VNNI | {"avx512_bf16"}  # VNNI + BF16, no AMX
XEON_AMX = EPYC_ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}
ALDER_LAKE = AVX2 | {"avx_vnni"}  # AVX-VNNI on 256-bit registers: the kernels' AVX2 dot path
OLD_X86 = {"sse4_2", "avx"}


def choose(flags, block_weights=True, cpu_kernels=True, **options):
    numerics = resolve_numerics(EngineConfig(**options), Hardware.for_cpu_flags(flags, cpu_kernels), block_weights)
    return numerics.dtype.value, numerics.block_matmul.value, numerics.kv_cache_dtype.value


@pytest.mark.parametrize("flags, expected", [
    (XEON_AMX, ("float32", "int8", "bfloat16")),  # bfloat16-int8 is not the default until measured again
    (EPYC_ZEN4, ("float32", "int8", "bfloat16")),
    (AVX512_VNNI, ("float32", "int8", "float16")),
    (ALDER_LAKE, ("float32", "int8", "float16")),
    (AVX2, ("float32", "int8", "float16")),
    (OLD_X86, ("float32", "float32", "float16")),
], ids=["amx", "avx512-vnni-bf16", "avx512-vnni", "avx-vnni", "avx2", "no-avx2"])
def test_block_quantized_weights_by_cpu(flags, expected):
    assert choose(flags) == expected


@pytest.mark.parametrize("flags, expected", [
    (XEON_AMX, ("q8_0", "float32", "int8", "bfloat16")),
    (EPYC_ZEN4, ("q8_0", "float32", "int8", "bfloat16")),
    (AVX512_VNNI, ("q8_0", "float32", "int8", "float16")),
    (ALDER_LAKE, ("q8_0", "float32", "int8", "float16")),
    (AVX2, ("q8_0", "float32", "int8", "float16")),
    (OLD_X86, ("as stored", "float32", "float32", "float16")),
], ids=["amx", "avx512-vnni-bf16", "avx512-vnni", "avx-vnni", "avx2", "no-avx2"])
def test_dense_weights_by_cpu(flags, expected):
    """A safetensors model: rounded to Q8_0 at load wherever the int8 dot kernels run (faster than 16-bit
    weights at 1B, perplexity within 0.5% of them; docs/benchmarks.md), else dense."""
    numerics = resolve_numerics(EngineConfig(), Hardware.for_cpu_flags(flags), block_weights=False)
    assert (numerics.weights.value, *choose(flags, block_weights=False)) == expected
    assert numerics.apply(EngineConfig()).quantization == (None if expected[0] == "as stored" else "q8_0")


@pytest.mark.parametrize("flags, expected", [
    (XEON_AMX, ("bfloat16", "float32", "bfloat16")),
    (EPYC_ZEN4, ("bfloat16", "float32", "bfloat16")),
    (AVX512_VNNI, ("float32", "float32", "float16")),
    (AVX2, ("float32", "float32", "float16")),
], ids=["amx", "avx512-vnni-bf16", "avx512-vnni", "avx2"])
def test_dense_weights_kept_dense_by_cpu(flags, expected):
    """--quantization none keeps a dense model's weights: bfloat16 where the CPU has it natively, as vLLM does."""
    assert choose(flags, block_weights=False, quantization="none") == expected


def test_dense_weights_stay_dense_where_asked_or_where_q8_0_cannot_pay():
    def weights(flags=EPYC_ZEN4, cpu_kernels=True, experts=False, **options):
        numerics = resolve_numerics(EngineConfig(**options), Hardware.for_cpu_flags(flags, cpu_kernels),
                                    block_weights=False, experts=experts)
        return numerics.weights.value
    assert weights(dtype="bfloat16") == weights(dtype="float32") == "as stored"
    assert weights(block_matmul="float32") == "as stored"  # the blocks would be widened back to float32
    assert weights(block_matmul="int8") == "q8_0"
    assert weights(experts=True) == "as stored"  # experts stay dense: the model keeps its bfloat16
    assert weights(cpu_kernels=False) == weights(OLD_X86) == "as stored"
    assert weights(numerics="exact") == "as stored"
    cuda = resolve_numerics(EngineConfig(), Hardware("cuda", cuda_bf16=True), block_weights=False)
    assert cuda.weights.value == "as stored" and cuda.dtype.value == "bfloat16"


def test_without_the_cpp_kernels_everything_stays_float32():
    # Blocks would be dequantized (nothing multiplies them kept), and the torch backend reads the cache as stored.
    assert choose(EPYC_ZEN4, cpu_kernels=False) == ("float32", "float32", "float32")
    assert choose(EPYC_ZEN4, block_weights=False, cpu_kernels=False) == ("float32", "float32", "float32")


def test_q8_0_and_gguf_computes_in_float32_on_their_kernels():
    assert choose(EPYC_ZEN4, block_weights=True, quantization="q8_0") == ("float32", "int8", "bfloat16")
    # An explicit bfloat16 model dequantizes the blocks: the block matmul has nothing to multiply.
    assert choose(EPYC_ZEN4, dtype="bfloat16") == ("bfloat16", "float32", "bfloat16")


def test_explicit_values_are_kept():
    assert choose(EPYC_ZEN4, block_matmul="float32") == ("float32", "float32", "bfloat16")
    assert choose(EPYC_ZEN4, kv_cache_dtype="float16") == ("float32", "int8", "float16")
    assert choose(XEON_AMX, block_matmul="int8", kv_cache_dtype="float32") == ("float32", "int8", "float32")
    assert choose(EPYC_ZEN4, dtype="float32", block_matmul="float32", kv_cache_dtype="float32") == \
        ("float32", "float32", "float32")


def test_exact_mode_is_float32_throughout_and_refuses_other_values():
    for flags in (XEON_AMX, EPYC_ZEN4, AVX2, OLD_X86):
        for block_weights in (True, False):
            assert choose(flags, block_weights, numerics="exact") == ("float32", "float32", "float32")
    assert choose(EPYC_ZEN4, numerics="exact", dtype="float32", kv_cache_dtype="float32") == ("float32",) * 3
    with pytest.raises(InvalidRequestError, match="--kv-cache-dtype float16"):
        choose(EPYC_ZEN4, numerics="exact", kv_cache_dtype="float16")
    with pytest.raises(InvalidRequestError, match="--block-matmul int8"):
        choose(EPYC_ZEN4, numerics="exact", block_matmul="int8")


def test_cuda_keeps_its_own_dtype_and_cache():
    numerics = resolve_numerics(EngineConfig(), Hardware("cuda", cuda_bf16=True), block_weights=True)
    assert (numerics.dtype.value, numerics.block_matmul.value, numerics.kv_cache_dtype.value) == \
        ("bfloat16", "float32", "bfloat16")
    numerics = resolve_numerics(EngineConfig(), Hardware("cuda", cuda_bf16=False), block_weights=False)
    assert numerics.dtype.value == "float16" and numerics.kv_cache_dtype.value == "float16"


def test_every_choice_says_why():
    numerics = resolve_numerics(EngineConfig(), Hardware.for_cpu_flags(EPYC_ZEN4), block_weights=True)
    assert numerics.describe() == (
        "weights: as stored (the file's block-quantized matrices); dtype: float32 (block-quantized weights: the C++ "
        "block kernels compute in float32); block matmul: int8 "
        "(avx512_vnni); kv cache dtype: bfloat16 (16-bit cache under a float32 model, native bfloat16 (avx512_bf16))")
    assert numerics.as_dict()["block_matmul"] == {"value": "int8", "reason": "avx512_vnni"}
    applied = numerics.apply(EngineConfig())
    assert (applied.dtype, applied.block_matmul, applied.kv_cache_dtype) == ("float32", "int8", "bfloat16")


def test_numerics_flag_parses_and_rejects_unknown_values():
    from tokenmill.entrypoints.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--numerics", "exact"])
    assert args.numerics == "exact"
    with pytest.raises(InvalidRequestError, match="numerics must be one of auto, exact"):
        EngineConfig(numerics="fast")


def test_an_engine_here_reports_what_it_chose(smollm2_path):
    """The embedded GGUF at the defaults: what detect_hardware finds on this machine decides, and the engine
    runs exactly that (its runner's kernels, dtypes and cache)."""
    import torch

    from tokenmill import LLM

    llm = LLM(str(smollm2_path), num_kv_blocks=32, max_model_len=256)
    chosen = resolve_numerics(EngineConfig(), detect_hardware("cpu", "auto"), block_weights=True)
    assert llm.llm_engine.numerics == chosen.as_dict()
    runner = llm.llm_engine.core.core.runner
    assert str(runner.dtype).removeprefix("torch.") == chosen.dtype.value
    assert runner.linear_methods.block_matmul == chosen.block_matmul.value
    assert runner.kv_caches[0].dtype == getattr(torch, chosen.kv_cache_dtype.value)


def test_a_dense_model_here_runs_the_chosen_dtype(tiny_llama_dir):
    import torch

    from tokenmill import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16)
    chosen = resolve_numerics(EngineConfig(), detect_hardware("cpu", "auto"), block_weights=False)
    assert llm.llm_engine.numerics == chosen.as_dict()
    runner = llm.llm_engine.core.core.runner
    assert runner.dtype == getattr(torch, chosen.dtype.value)
    rounded = [layer for layer in runner.model.modules() if type(layer).__name__ == "BlockQuantLinear"]
    assert bool(rounded) == (chosen.weights.value == "q8_0")
    assert runner.kv_caches[0].dtype == getattr(torch, chosen.kv_cache_dtype.value)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
