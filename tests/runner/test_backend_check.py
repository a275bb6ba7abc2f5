"""The start-up check that lets `--attention-backend auto` fall back to torch when compiled kernels fail."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from triton_setup import interpret_without_cuda, require_triton

interpret_without_cuda()

from tokenmill.entrypoints.llm import LLM  # noqa: E402
from tokenmill.model.layers.attention import TorchAttentionBackend  # noqa: E402
from tokenmill.runner.backend_check import attention_mismatch  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

CPU = torch.device("cpu")
LAYER = SimpleNamespace(num_heads=6, num_kv_heads=2, head_dim=16, scale=0.25, window=None, softcap=None)


class WrongBackend(TorchAttentionBackend):
    name = "triton"

    def forward(self, q, k, v, kv_cache, meta, scale, window=None, softcap=None):
        return super().forward(q, k, v, kv_cache, meta, scale * 1.5, window=window, softcap=softcap)


class FailingBackend(TorchAttentionBackend):
    name = "triton"

    def forward(self, *args, **kwargs):
        raise RuntimeError("PassManager::run failed\nmore compiler output")


def test_the_torch_backend_passes_and_broken_kernels_are_named():
    assert attention_mismatch(TorchAttentionBackend(), LAYER, torch.float32, CPU) is None
    assert "largest difference" in attention_mismatch(WrongBackend(), LAYER, torch.float32, CPU)
    assert attention_mismatch(FailingBackend(), LAYER, torch.float32, CPU) == "RuntimeError: PassManager::run failed"


def test_the_triton_kernels_pass_the_check_on_windowed_and_capped_layers():
    require_triton()
    from tokenmill.model.layers.attention.triton_backend import TritonAttentionBackend

    for layer in (LAYER, SimpleNamespace(**{**vars(LAYER), "window": 9, "softcap": 0.5})):
        assert attention_mismatch(TritonAttentionBackend(), layer, torch.float32, CPU) is None


def test_a_failing_backend_is_replaced_by_torch_in_every_layer(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), attention_backend="torch", max_model_len=128, kv_cache_memory_bytes="16MiB",
              numerics="exact")
    runner = llm.llm_engine.core.core.runner
    params = SamplingParams(max_tokens=6, temperature=0.0)
    expected = llm.generate(["Hello there"], params)[0].outputs[0].token_ids
    broken = FailingBackend()
    runner.attention_backend = broken
    for layer in runner.model.layers:
        layer.self_attn.backend = broken
    runner._check_attention_kernels()
    assert isinstance(runner.attention_backend, TorchAttentionBackend) and runner.attention_backend.name == "torch"
    assert all(layer.self_attn.backend is runner.attention_backend for layer in runner.model.layers)
    assert llm.generate(["Hello there"], params)[0].outputs[0].token_ids == expected
