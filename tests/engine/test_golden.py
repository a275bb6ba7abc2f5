"""Greedy token ids equal HF transformers `generate` on the same weights (fp32), with prompts of
mixed lengths submitted together and a small token budget so prefills are chunked and share steps
with decodes."""
from __future__ import annotations

import pytest
import torch

from model_factory import GOLDEN_PROMPTS as PROMPTS
from model_factory import hf_greedy, hf_greedy_batch
from tokenmill import LLM, SamplingParams


def check_against_hf(llm: LLM, hf_model, tokenizer, max_tokens: list[int]) -> None:
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    for ids, m, out in zip(prompt_ids, max_tokens, outputs):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, m), f"mismatch for prompt {tokenizer.decode(ids)!r}"
        assert out.outputs[0].finish_reason == "length"


# Every attention backend must produce the same tokens; "cpu" (the C++ paged kernels) fails with its build
# error where they do not build (skipped only with TOKENMILL_DISABLE_CPU_KERNELS=1). These run on the CPU device,
# whose backends and packed weights they cover; tests/engine/test_cuda.py holds the same checks on a GPU.
BACKENDS = ["torch", "cpu"]


def require_backend(request, name: str) -> None:
    if name == "cpu":
        request.getfixturevalue("kernels")  # fails when the kernels cannot be built


@pytest.mark.parametrize("backend,packed_linear", [("torch", False), ("torch", True), ("cpu", True)])
def test_tiny_llama_matches_hf(request, tiny_llama_dir, smollm2_tokenizer, backend, packed_linear):
    from transformers import AutoModelForCausalLM

    require_backend(request, backend)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    llm = LLM(str(tiny_llama_dir), device="cpu", max_num_batched_tokens=24, num_kv_blocks=64, max_model_len=512,
              attention_backend=backend, packed_linear=packed_linear, numerics="exact")
    runner = llm.llm_engine.core.core.runner
    assert runner.attention_backend.name == backend
    assert runner.packed_linear == (packed_linear and torch.backends.mkldnn.is_available())
    check_against_hf(llm, hf, smollm2_tokenizer, [12, 20, 5, 16, 24, 9, 30, 14, 22])
    assert llm.llm_engine.core.core.kv_cache.usage == 0.0


def test_long_prompt_in_chunks_matches_hf(tiny_llama_dir, smollm2_tokenizer, chunk_path):
    """A 700-token prompt prefilled in chunks of up to 160 tokens, each attending to the cache before
    it, through either attention path for such chunks (`chunk_path`)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompt = smollm2_tokenizer.encode(" ".join(PROMPTS) * 6)[:700]
    assert len(prompt) == 700
    llm = LLM(str(tiny_llama_dir), device="cpu", max_num_batched_tokens=160, num_kv_blocks=128, max_model_len=1024,
              numerics="exact")
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, 12)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_smollm2_gguf_matches_hf(request, smollm2_hf, smollm2_tokenizer, backend):
    require_backend(request, backend)
    llm = LLM(device="cpu", max_num_batched_tokens=32, kv_cache_memory_bytes="256MiB", max_model_len=1024,
              attention_backend=backend, numerics="exact")
    check_against_hf(llm, smollm2_hf, smollm2_tokenizer, [10, 16, 12, 20, 8, 12, 10, 16, 14])
    assert llm.llm_engine.core.core.kv_cache.usage == 0.0


GEMMA_CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
               "List three primary colors.", "How do I reverse a list in Python?", "Who wrote Hamlet?",
               "Give me a synonym for happy.", "Why is the sky blue?"]


@pytest.mark.slow
def test_gemma3_270m_gguf_matches_hf_on_chat_prompts(kernels, gemma3_270m_gguf):
    """The real Gemma 3 270M GGUF (`make gemma`; skipped without it), its blocks kept as stored (Q8_0 head
    and embedding, Q5_0/Q4_K projections; Q6_K ones dequantized): 8 chat prompts in Gemma's template,
    32 greedy tokens each, token-exact with HF transformers on the same dequantized weights."""
    from gguf_compat import hf_model_from_gguf

    hf = hf_model_from_gguf(gemma3_270m_gguf, dtype=torch.float32).eval()
    llm = LLM(str(gemma3_270m_gguf), device="cpu", max_num_batched_tokens=64, num_kv_blocks=400,
              max_model_len=512, numerics="exact")
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True,
                                             tokenize=True) for chat in GEMMA_CHATS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                           SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    # HF's eight references in one batch: its 262k-entry head streams once per step, not eight times.
    for ids, out, expected in zip(prompts, outputs, hf_greedy_batch(hf, prompts, 32)):
        assert out.outputs[0].token_ids == expected, f"mismatch for {tokenizer.decode(ids)!r}"
