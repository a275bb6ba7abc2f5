"""AsyncLLM runs the engine core in a process of its own, behind zmq and msgspec messages."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from proc_util import thread_niceness
from tokenmill.config import EngineConfig
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import EngineDeadError, EngineFailedError, ModelLoadError
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


def _collect(engine: AsyncLLM, prompt: list[int], params: SamplingParams, request_id: str):
    async def run():
        return [out async for out in engine.generate(ProcessedPrompt(None, prompt), params, request_id)]
    return run()


def test_outputs_from_the_core_process_match_the_offline_engine(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=32, numerics="exact")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = LLM.from_config(config).generate([[1, 2, 3, 4]], params, use_tqdm=False)[0].outputs[0]
    engine = AsyncLLM.from_config(config)

    async def run():
        try:
            assert engine.client.process.pid != os.getpid() and engine.client.process.is_alive()
            # On CPU the core (every thread: compute, zmq I/O) runs niced by 10 below this process.
            assert thread_niceness(engine.client.process.pid) == {min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)}
            delta = await _collect(engine, [1, 2, 3, 4], params.clone(output_kind=RequestOutputKind.DELTA), "d")
            final = await _collect(engine, [1, 2, 3, 4], params.clone(output_kind=RequestOutputKind.FINAL_ONLY), "f")
            return delta, final
        finally:
            await engine.shutdown()

    delta, final = asyncio.run(run())
    # Deltas concatenate to the whole output; FINAL_ONLY sends it once.
    assert [t for out in delta for t in out.outputs[0].token_ids] == expected.token_ids
    assert "".join(out.outputs[0].text for out in delta) == expected.text
    assert len(final) == 1 and final[0].outputs[0].token_ids == expected.token_ids
    assert delta[-1].finished and delta[-1].outputs[0].finish_reason == "length"
    assert not engine.client.process.is_alive()  # shutdown leaves no child process


def test_a_model_that_fails_to_load_in_the_core_raises_in_the_caller(tiny_llama_dir, tmp_path):
    (tmp_path / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    for name in os.listdir(tiny_llama_dir):
        if name.startswith("tokenizer") or name.endswith(".json") and name != "config.json":
            (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    with pytest.raises((ModelLoadError, EngineDeadError)):
        AsyncLLM.from_config(EngineConfig(model=str(tmp_path), num_kv_blocks=32))  # no weights


def test_a_killed_core_fails_requests_in_flight_and_marks_the_engine_dead(tiny_llama_dir):
    engine = AsyncLLM.from_config(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64))
    params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def run():
        outputs = []
        try:
            async for out in engine.generate(ProcessedPrompt(None, [1, 2, 3]), params, "victim"):
                outputs.append(out)
                if len(outputs) == 3:
                    os.kill(engine.client.process.pid, signal.SIGKILL)
        finally:
            await engine.shutdown()
        return outputs

    with pytest.raises(EngineFailedError):
        asyncio.run(asyncio.wait_for(run(), 60))
    assert engine.errored
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.check_health())


def test_a_core_that_dies_while_idle_is_noticed_without_any_request(tiny_llama_dir):
    """The receiver also watches the core's process while no output arrives: a core killed while nothing
    is in flight (and nobody asks /health) still marks the engine dead, so the server can exit."""
    engine = AsyncLLM.from_config(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=32, engine_core_nice=0))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def run():
        try:
            assert thread_niceness(engine.client.process.pid) == {os.getpriority(os.PRIO_PROCESS, 0)}
            await _collect(engine, [1, 2, 3], params, "first")  # the receiver runs from the first request on
            assert not engine.errored
            os.kill(engine.client.process.pid, signal.SIGKILL)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while not engine.errored and loop.time() < deadline:
                await asyncio.sleep(0.02)
            return engine.errored
        finally:
            await engine.shutdown()

    assert asyncio.run(run())
