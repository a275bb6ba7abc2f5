"""AsyncLLM builds its engine on the engine thread (one OpenMP team per process; see async_llm.py)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine import async_llm
from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.errors import ModelLoadError
from tokenmill.sampling_params import SamplingParams


def test_from_config_builds_the_engine_on_the_thread_that_steps_it(tiny_llama_dir, monkeypatch):
    built_on, stepped_on = [], []

    class RecordingEngine(async_llm.LLMEngine):
        def __init__(self, config):
            built_on.append(threading.get_ident())
            super().__init__(config)

        def step(self):
            stepped_on.append(threading.get_ident())
            return super().step()

    monkeypatch.setattr(async_llm, "LLMEngine", RecordingEngine)
    engine = async_llm.AsyncLLM.from_config(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=16))

    async def run():
        outputs = [out async for out in engine.generate(ProcessedPrompt(None, [1, 2, 3]),
                                                        SamplingParams(max_tokens=3, ignore_eos=True), "r0")]
        await engine.shutdown()
        return outputs

    outputs = asyncio.run(run())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
    assert built_on == [engine._thread.ident] and built_on[0] != threading.get_ident()
    assert set(stepped_on) == {engine._thread.ident}


def test_engine_construction_errors_reach_the_caller(monkeypatch):
    class FailingEngine(async_llm.LLMEngine):
        def __init__(self, config):
            raise ModelLoadError("no such model")

    monkeypatch.setattr(async_llm, "LLMEngine", FailingEngine)
    with pytest.raises(ModelLoadError, match="no such model"):
        async_llm.AsyncLLM.from_config(EngineConfig(model="/nonexistent"))
