"""--kv-cache-dtype: a float16/bfloat16 KV cache under a float32 model (half the cache memory and half
the bytes a decode step reads), with attention still computed in float32."""
from __future__ import annotations

import pytest
import torch

from model_factory import GOLDEN_PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.errors import InvalidRequestError


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 16):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return [out.outputs[0] for out in outputs]


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
    compared = 0
    for ref, out in zip(reference, outputs["cpu"]):
        for ref_token, token, ref_lp, lp in zip(ref.token_ids, out.token_ids, ref.logprobs, out.logprobs):
            if ref_token != token:
                break
            assert abs(ref_lp[ref_token].logprob - lp[token].logprob) < (0.02 if dtype == torch.float16 else 0.1)
            compared += 1
    assert compared >= 32  # most of the 64 tokens: the check above is not vacuous
