"""Swap preemption end to end: KV blocks go to host memory and come back; outputs are unchanged."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

PROMPTS = ["Hello there, how are", "The quick brown fox jumps over the lazy dog because", "1 2 3", "Why",
           "A long time ago in a galaxy far, far away, there was a small"]


def test_swap_preemption_gives_identical_outputs(tiny_llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    big = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_model_len=256, enable_prefix_caching=False, numerics="exact")
    reference = [o.outputs[0].token_ids for o in big.generate(PROMPTS, params, use_tqdm=False)]
    small = LLM(str(tiny_llama_dir), num_kv_blocks=12, max_model_len=192, enable_prefix_caching=False,
                max_num_batched_tokens=32, preemption_mode="swap", swap_space=0.01, numerics="exact")
    scheduler = small.llm_engine.core.core.scheduler
    computed = []
    original = scheduler.schedule

    def counting_schedule():
        out = original()
        computed.append(out.num_scheduled_tokens)
        return out

    scheduler.schedule = counting_schedule
    outputs = small.generate(PROMPTS, params, use_tqdm=False)
    assert scheduler.num_swap_outs > 0
    assert [o.outputs[0].token_ids for o in outputs] == reference
    # Swapped requests resume where they stopped: far less than a full recompute per preemption.
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    recomputed = sum(computed) - prompt_tokens - sum(len(r) - 1 for r in reference)
    assert recomputed < scheduler.num_preemptions * 20
    kv = small.llm_engine.core.core.kv_cache
    assert kv.num_free_blocks == 12 and kv.num_free_host_blocks == kv.host_pool.num_blocks
    assert not scheduler.swapped


@pytest.mark.gpu
def test_swap_preemption_on_cuda(tiny_llama_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (swap to host memory applies where the device is not the CPU)")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    big = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_model_len=256, device="cuda", numerics="exact")
    reference = [o.outputs[0].token_ids for o in big.generate(PROMPTS, params, use_tqdm=False)]
    small = LLM(str(tiny_llama_dir), num_kv_blocks=12, max_model_len=192, max_num_batched_tokens=32,
                device="cuda", swap_space=0.01, numerics="exact")
    assert [o.outputs[0].token_ids for o in small.generate(PROMPTS, params, use_tqdm=False)] == reference
    assert small.llm_engine.core.core.scheduler.num_swap_outs > 0
