"""The CUDA paths: greedy parity with HF transformers on the GPU, bfloat16 by default, and the KV cache
sized from --gpu-memory-utilization. Skipped, with the reason, where torch sees no CUDA device."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from model_factory import GOLDEN_PROMPTS as PROMPTS
from model_factory import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelLoadError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def greedy(llm: LLM, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_float32_on_cuda_matches_hf(tiny_llama_dir, smollm2_tokenizer):
    """float32 on the GPU (TF32 off, torch's default for matmuls) gives HF's greedy tokens exactly,
    with chunked prefills sharing steps with decodes."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval().to("cuda")
    llm = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", max_num_batched_tokens=24,
              num_kv_blocks=64, max_model_len=512)
    runner = llm.llm_engine.core.core.runner
    # auto: the triton kernels where triton imports (CUDA builds of torch ship it), else the torch backend.
    assert runner.device.type == "cuda" and runner.attention_backend.name == (
        "triton" if importlib.util.find_spec("triton") is not None else "torch")
    prompt_ids = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    for ids, tokens in zip(prompt_ids, greedy(llm, prompt_ids, 16)):
        assert tokens == hf_greedy(hf, ids, 16), f"mismatch for {smollm2_tokenizer.decode(ids)!r}"
    assert llm.llm_engine.core.core.kv_cache.usage == 0.0


@pytest.mark.slow
def test_smollm2_float32_on_cuda_matches_hf(smollm2_path, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                              dtype=torch.float32).eval().to("cuda")
    llm = LLM(device="cuda", max_num_batched_tokens=32, kv_cache_memory_bytes="256MiB", max_model_len=1024)
    prompt_ids = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    for ids, tokens in zip(prompt_ids, greedy(llm, prompt_ids, 16)):
        assert tokens == hf_greedy(hf, ids, 16), f"mismatch for {smollm2_tokenizer.decode(ids)!r}"


@pytest.mark.slow
def test_smollm2_bfloat16_on_cuda_tracks_hf(smollm2_path, smollm2_tokenizer):
    """`--dtype auto` is bfloat16 on the GPU. Rounding differs from HF's (other matmul shapes), so
    tokens are checked teacher-forced: at every position of tokenmill's greedy output, HF (bfloat16,
    same GPU) rates tokenmill's token within a bfloat16 rounding of its own best."""
    from transformers import AutoModelForCausalLM

    llm = LLM(dtype="auto", kv_cache_memory_bytes="512MiB", max_model_len=1024, max_num_batched_tokens=64)
    assert llm.llm_engine.core.core.runner.dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                              dtype=torch.bfloat16).eval().to("cuda")
    prompt_ids = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    exact = 0
    for ids, tokens in zip(prompt_ids, greedy(llm, prompt_ids, 24)):
        with torch.inference_mode():
            logits = hf(torch.tensor([ids + tokens], device="cuda")).logits[0, len(ids) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        gap = logits.max(dim=1).values - chosen
        assert float(gap.max()) < 0.25, f"tokenmill chose a token HF rates {float(gap.max()):.3f} below its best"
        exact += int(torch.equal(logits.argmax(dim=1).cpu(), torch.tensor(tokens)))
    assert exact >= len(PROMPTS) // 2  # most sequences agree token for token


def test_gpu_memory_utilization_sizes_the_kv_cache(tiny_llama_dir):
    total = torch.cuda.get_device_properties(0).total_memory
    llm = LLM(str(tiny_llama_dir), device="cuda", gpu_memory_utilization=0.2, max_model_len=256)
    core = llm.llm_engine.core.core
    cache_bytes = core.kv_cache.pool.num_blocks * core.runner.kv_spec.bytes_per_block
    assert 0.15 * total < cache_bytes <= 0.2 * total
    # A second engine in the same process with the same share finds it taken: a clear error, not an OOM.
    with pytest.raises(ModelLoadError):
        LLM(str(tiny_llama_dir), device="cuda", gpu_memory_utilization=0.2, max_model_len=256)
    del llm, core


def test_generation_after_abort_and_preemption_on_cuda(tiny_llama_dir):
    """Recompute preemption on the GPU: a cache too small for every request still gives the tokens a
    large cache gives."""
    big = LLM(str(tiny_llama_dir), device="cuda", num_kv_blocks=256, max_model_len=256)
    prompts = [[5 + i, 17, 300 + 7 * i, 42] * (3 + i) for i in range(6)]
    reference = greedy(big, prompts, 40)
    small = LLM(str(tiny_llama_dir), device="cuda", num_kv_blocks=10, max_model_len=192,
                max_num_batched_tokens=32, preemption_mode="recompute")
    assert greedy(small, prompts, 40) == reference
    assert small.llm_engine.core.core.scheduler.num_preemptions > 0


def test_int8_kv_cache_on_cuda_takes_the_torch_backend_and_matches_the_cpu(tiny_llama_dir, smollm2_tokenizer):
    """--kv-cache-dtype int8 on the GPU: `auto` takes the torch backend (the triton kernels read float caches), whose
    greedy tokens equal the CPU engine's over the same int8 cache (float32 model, one quantization rule)."""
    prompt_ids = [smollm2_tokenizer.encode(p) for p in PROMPTS[:4]]
    llms = {device: LLM(str(tiny_llama_dir), device=device, dtype="float32", kv_cache_dtype="int8",
                        attention_backend="torch", num_kv_blocks=64, max_model_len=512)
            for device in ("cpu", "cuda")}
    auto = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", kv_cache_dtype="int8", num_kv_blocks=64,
               max_model_len=512)
    assert auto.llm_engine.core.core.runner.attention_backend.name == "torch"
    assert auto.llm_engine.core.core.runner.kv_caches[0].dtype == torch.int8
    assert greedy(llms["cuda"], prompt_ids, 12) == greedy(llms["cpu"], prompt_ids, 12)
