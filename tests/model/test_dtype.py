"""`--dtype auto`: bfloat16 only where the hardware computes it natively."""
from __future__ import annotations

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.runner.model_runner import resolve_dtype


@pytest.mark.parametrize("avx512_bf16, amx, expected", [(False, False, torch.float32), (True, False, torch.bfloat16),
                                                        (False, True, torch.bfloat16)])
def test_auto_dtype_on_cpu_follows_native_bf16(monkeypatch, avx512_bf16, amx, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve_dtype("auto", torch.device("cpu")) == expected


def test_explicit_dtypes_are_kept(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_auto_with_quantization_computes_in_float32():
    config = EngineConfig(dtype="auto", quantization="q8_0")
    assert config.dtype == "auto"  # as given: the config is never rewritten
    assert config.resolved_dtype == "float32"
    assert config.with_resolved_defaults("cpu").dtype == "float32"
    assert EngineConfig(dtype="auto").resolved_dtype == "auto"  # resolved on the device, when the runner starts


def test_auto_dtype_engine_runs_here(tiny_llama_dir):
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), dtype="auto", num_kv_blocks=16)
    expected = resolve_dtype("auto", torch.device("cpu"))
    assert llm.llm_engine.core.core.runner.dtype == expected
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
