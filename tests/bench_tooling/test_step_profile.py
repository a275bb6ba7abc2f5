"""The per-phase step profiler: phases partition the wall time and the instrumentation comes off."""
from __future__ import annotations

import torch

from benchmarks import step_profile
from tokenmill import LLM
from tokenmill.bench.workloads import WorkloadRequest


def test_phases_partition_the_run_and_unpatch(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=16, numerics="exact")
    requests = [WorkloadRequest(id=i, prompt_token_ids=list(range(5, 5 + n)), max_tokens=m)
                for i, (n, m) in enumerate([(20, 6), (9, 4), (33, 3)])]
    runner = llm.llm_engine.core.core.runner
    forward_before = runner.model.forward
    out = step_profile.run(llm, requests)

    assert out["throughput"]["output_tokens"] == 13
    phases = {row["phase"]: row for row in out["phases"]}
    assert list(phases) == list(step_profile.PHASES)
    assert abs(sum(row["seconds"] for row in out["phases"]) - out["wall_s"]) < 0.01 + 0.005 * len(phases)
    for busy in ("model: linear", "model: attention (decode)", "model: attention (prefill)", "model: attention (other)",
                 "logits", "sampling", "schedule"):
        assert phases[busy]["seconds"] > 0, busy
    # 62 prompt tokens at <= 16 a step need >= 4 steps; the 20-token prompt alone needs 2 chunks,
    # then its 6 tokens come one a step (the first with the last chunk): >= 2 + 5 steps
    assert out["steps"] >= 7
    assert "| model: linear |" in out["markdown"]
    # every wrapper is gone: a second, unprofiled run behaves as before
    assert runner.model.forward == forward_before
    assert not any("forward" in vars(m) for m in runner.model.modules() if isinstance(m, torch.nn.Module))


def test_fused_stack_steps_time_as_model_other_unless_layer_by_layer(tiny_gguf_path, tiny_llama_dir):
    """At int8 numerics every step runs the fused C++ decoder stack: its projections and attention time under
    "model: other"; run_layer_by_layer (--layer-by-layer) sends the steps through the layers, timed apart."""
    requests = [WorkloadRequest(id=i, prompt_token_ids=list(range(5, 5 + n)), max_tokens=m)
                for i, (n, m) in enumerate([(40, 6), (9, 4), (33, 3)])]
    seconds, tokens = {}, {}
    for layered in (False, True):
        llm = LLM(str(tiny_gguf_path), tokenizer=str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256,
                  max_num_batched_tokens=16, block_matmul="int8", dtype="float32")
        assert llm.llm_engine.core.core.runner.model._int8_decode is not None
        if layered:
            step_profile.run_layer_by_layer(llm)
        out = step_profile.run(llm, requests)
        seconds[layered] = {row["phase"]: row["seconds"] for row in out["phases"]}
        tokens[layered] = out["throughput"]["output_tokens"]
    assert seconds[False]["model: linear"] == 0 and seconds[False]["model: attention (prefill)"] == 0
    assert seconds[True]["model: linear"] > 0 and seconds[True]["model: attention (prefill)"] > 0
    assert tokens[False] == tokens[True] == 13
