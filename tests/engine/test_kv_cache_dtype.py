"""--kv-cache-dtype: a float16/bfloat16 KV cache under a float32 model (half the cache memory and half
the bytes a decode step reads), with attention still computed in float32."""
from __future__ import annotations

import pytest
import torch

from model_factory import GOLDEN_PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.errors import InvalidRequestError
from tokenmill.model.layers.kv_int8 import kv_row_width


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 16):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return [out.outputs[0] for out in outputs]


def _assert_logprobs_track(reference, outputs, tolerance: float) -> None:
    """Each chosen token's logprob within `tolerance` of the reference's while the tokens agree, over at least 32
    tokens (most of the 64: the check is not vacuous)."""
    compared = 0
    for ref, out in zip(reference, outputs):
        for ref_token, token, ref_lp, lp in zip(ref.token_ids, out.token_ids, ref.logprobs, out.logprobs):
            if ref_token != token:
                break
            assert abs(ref_lp[ref_token].logprob - lp[token].logprob) < tolerance
            compared += 1
    assert compared >= 32


def test_kv_cache_dtype_is_validated():
    assert EngineConfig(kv_cache_dtype="fp16").kv_cache_dtype == "float16"
    assert EngineConfig(kv_cache_dtype="bf16").kv_cache_dtype == "bfloat16"
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_16_bit_cache_halves_its_memory_and_backends_agree(request, tiny_llama_dir, smollm2_tokenizer,
                                                           kv_cache_dtype):
    request.getfixturevalue("kernels")  # the "cpu" backend needs the C++ kernels
    budget = 4 * 2**20
    prompts = [smollm2_tokenizer.encode(p) for p in GOLDEN_PROMPTS[:4]]
    # The "cpu" attention backend runs on the CPU device only, so every engine here is pinned to it.
    base = LLM(str(tiny_llama_dir), kv_cache_memory_bytes=budget, max_num_batched_tokens=24, max_model_len=512,
               device="cpu", numerics="exact")
    runs = {backend: LLM(str(tiny_llama_dir), kv_cache_memory_bytes=budget, max_num_batched_tokens=24,
                         max_model_len=512, kv_cache_dtype=kv_cache_dtype, attention_backend=backend, device="cpu",
                         dtype="float32", block_matmul="float32")
            for backend in ("torch", "cpu")}
    dtype = getattr(torch, kv_cache_dtype)
    for llm in runs.values():
        core = llm.llm_engine.core.core
        assert all(cache.dtype == dtype for cache in core.runner.kv_caches)
        assert core.runner.model.embed_tokens.weight.dtype == torch.float32  # the model stays float32
        # the same byte budget holds twice the blocks
        assert core.runner.kv_caches[0].shape[1] == 2 * base.llm_engine.core.core.runner.kv_caches[0].shape[1]
    reference = _greedy(base, prompts)
    outputs = {backend: _greedy(llm, prompts) for backend, llm in runs.items()}
    # Both backends read the same rounded K/V and compute in float32: the same greedy tokens.
    assert [o.token_ids for o in outputs["torch"]] == [o.token_ids for o in outputs["cpu"]]
    # Rounding K/V to 16 bits moves each chosen token's logprob only slightly while the tokens agree.
    _assert_logprobs_track(reference, outputs["cpu"], 0.02 if dtype == torch.float16 else 0.1)


def test_int8_cache_holds_about_twice_the_tokens_and_backends_agree(request, tiny_llama_dir, smollm2_tokenizer):
    """--kv-cache-dtype int8: int8 rows with a float16 scale per 32 values (model/layers/kv_int8.py), read in place
    by the C++ kernels and dequantized by the torch backend (decode in bfloat16 products where the CPU has them)."""
    request.getfixturevalue("kernels")
    budget = 4 * 2**20
    prompts = [smollm2_tokenizer.encode(p) for p in GOLDEN_PROMPTS[:4]]
    exact = LLM(str(tiny_llama_dir), kv_cache_memory_bytes=budget, max_num_batched_tokens=24, max_model_len=512,
                device="cpu", numerics="exact")
    half = LLM(str(tiny_llama_dir), kv_cache_memory_bytes=budget, max_model_len=512, device="cpu",
               kv_cache_dtype="bfloat16", dtype="float32", block_matmul="float32")
    runs = {backend: LLM(str(tiny_llama_dir), kv_cache_memory_bytes=budget, max_num_batched_tokens=24,
                         max_model_len=512, kv_cache_dtype="int8", attention_backend=backend, device="cpu",
                         dtype="float32", block_matmul="float32")
            for backend in ("torch", "cpu")}
    half_blocks = half.llm_engine.core.core.runner.kv_caches[0].shape[1]
    for llm in runs.values():
        runner = llm.llm_engine.core.core.runner
        head_dim = runner.model.layers[0].self_attn.head_dim
        assert all(cache.dtype == torch.int8 and cache.shape[-1] == kv_row_width(head_dim, torch.int8) == head_dim + 2
                   for cache in runner.kv_caches)
        blocks = runner.kv_caches[0].shape[1]
        # head_dim 16 here: 18 bytes a row (one scale) against 32, 1.78x the blocks (1.88x at head_dims of 32k)
        assert blocks == budget // runner.kv_spec.bytes_per_block and blocks * (head_dim + 2) // 2 // head_dim in (
            half_blocks, half_blocks - 1)
    reference = _greedy(exact, prompts)
    outputs = {backend: _greedy(llm, prompts) for backend, llm in runs.items()}
    assert [o.token_ids for o in outputs["torch"]] == [o.token_ids for o in outputs["cpu"]]
    _assert_logprobs_track(reference, outputs["cpu"], 0.1)


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_int8_cache_is_token_exact_under_preemption_and_prefix_hits(request, tiny_llama_dir, preemption_mode):
    """The int8 cache's blocks swap to host memory and back, are recomputed after a preemption, and serve prefix
    hits: the same greedy tokens as an engine with room for everything and no prefix cache."""
    request.getfixturevalue("kernels")
    prompts = ["Hello there, how are", "The quick brown fox jumps over the lazy dog because", "1 2 3", "Why",
               "A long time ago in a galaxy far, far away, there was a small"]
    shared = "System: you are a helpful assistant who answers briefly and well. " * 3
    prompts += [shared + "Name a color.", shared + "Name a fruit."]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    numerics = dict(kv_cache_dtype="int8", dtype="float32", block_matmul="float32", device="cpu")
    big = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_model_len=256, enable_prefix_caching=False, **numerics)
    reference = [o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    small = LLM(str(tiny_llama_dir), num_kv_blocks=14, max_model_len=192, max_num_batched_tokens=32,
                preemption_mode=preemption_mode, swap_space=0.01, **numerics)
    outputs = small.generate(prompts, params, use_tqdm=False)
    core = small.llm_engine.core.core
    assert core.scheduler.num_preemptions > 0
    assert (core.scheduler.num_swap_outs > 0) == (preemption_mode == "swap")
    assert [o.outputs[0].token_ids for o in outputs] == reference
    # The shared system prompt again, now cached: a prefix hit over int8 blocks, the same tokens.
    again = small.generate([prompts[-1]], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == reference[-1]
