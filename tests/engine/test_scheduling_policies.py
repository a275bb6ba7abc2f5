"""Scheduling policies end to end on the tiny random Llama: priority, preemption under a tiny KV
cache (identical outputs, capped preemptions, nothing lost), admission control, queue timeouts and
prompt length limits through the offline API and the LLMEngine step loop."""
from __future__ import annotations

import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.core.scheduler import QUEUE_TIMEOUT
from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import InvalidRequestError

PROMPTS = ["Hello there, how are", "The quick brown fox jumps over the lazy dog because", "1 2 3", "Why",
           "A long time ago in a galaxy far, far away, there was a small", "Once upon a time",
           "Lists: apples, pears, plums, cherries and", "Q: what is two plus two? A:"]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def make_engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(model=str(model_dir), num_kv_blocks=128, max_model_len=256, numerics="exact")
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def token_prompt(n: int, base: int) -> ProcessedPrompt:
    return ProcessedPrompt(None, [base + i for i in range(n)])


def step_until_done(engine: LLMEngine, first_token_step: dict[str, int], outputs: dict, max_steps: int = 5000) -> None:
    for index in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        for out in engine.step():
            if out.outputs[0].token_ids:
                first_token_step.setdefault(out.request_id, index)
            if out.finished:
                assert out.request_id not in outputs, "a request finished twice"
                outputs[out.request_id] = out
    raise AssertionError("the engine did not drain")


# ---- priority --------------------------------------------------------------------------------
def test_llm_generate_priority_runs_the_urgent_prompt_first(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, max_num_seqs=1,
              scheduling_policy="priority", numerics="exact")
    priorities = [1] * (len(PROMPTS) - 1) + [0]  # the last prompt is the urgent one
    outputs = llm.generate(PROMPTS, greedy(6), use_tqdm=False, priority=priorities)
    first = [o.metrics.first_token_time for o in outputs]
    assert all(first[-1] < t for t in first[:-1])
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)


def test_engine_step_loop_high_priority_overtakes_queued_low_priority(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=2, scheduling_policy="priority")
    for i in range(8):
        engine.add_request(f"low{i}", token_prompt(10, 100 + 20 * i), greedy(6 + i), priority=1)
    first: dict[str, int] = {}
    for index in range(3):  # saturated: two low-priority requests decode, six wait
        for out in engine.step():
            first.setdefault(out.request_id, index)
    queued = [r.request_id for r in engine.core.core.scheduler.waiting]
    assert len(queued) == 6
    engine.add_request("high", token_prompt(10, 900), greedy(6), priority=0)
    outputs: dict = {}
    later: dict[str, int] = {}
    step_until_done(engine, later, outputs)
    assert all(later["high"] < later[rid] for rid in queued)
    assert sorted(outputs) == sorted(queued + ["high", "low0", "low1"])


# ---- preemption ------------------------------------------------------------------------------
PREEMPTION_MAX_TOKENS = 40


@pytest.fixture(scope="module")
def unconstrained_outputs(tiny_llama_dir) -> list[list[int]]:
    big = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_model_len=256, enable_prefix_caching=False, numerics="exact")
    outputs = big.generate(PROMPTS, greedy(PREEMPTION_MAX_TOKENS), use_tqdm=False)
    assert big.llm_engine.core.core.scheduler.num_preemptions == 0
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_preemption_under_a_tiny_kv_cache_loses_nothing_and_respects_the_cap(tiny_llama_dir, unconstrained_outputs,
                                                                             policy):
    max_tokens, cap, reference = PREEMPTION_MAX_TOKENS, 2, unconstrained_outputs
    params = [greedy(max_tokens)] * len(PROMPTS)
    priorities = [i % 3 for i in range(len(PROMPTS))]
    # 10 blocks of 16 tokens; every sequence grows to ~50 tokens (4 blocks): constant preemption.
    small = LLM(str(tiny_llama_dir), num_kv_blocks=10, max_model_len=160, enable_prefix_caching=False,
                max_num_batched_tokens=32, scheduling_policy=policy, max_preemptions=cap, numerics="exact")
    engine = small.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", engine.input_processor.process_prompt(prompt), params[i],
                           priority=priorities[i], user=f"tenant{i % 2}")
    outputs: dict = {}
    step_until_done(engine, {}, outputs)
    core = engine.core.core
    assert core.scheduler.num_preemptions > 0
    assert sorted(outputs) == sorted(f"r{i}" for i in range(len(PROMPTS)))  # each id exactly once
    for i in range(len(PROMPTS)):
        out = outputs[f"r{i}"]
        assert len(out.outputs) == 1 and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == reference[i]  # recompute changes nothing
        assert len(out.outputs[0].token_ids) == max_tokens
        assert out.metrics.num_preemptions <= cap
    assert sum(o.metrics.num_preemptions for o in outputs.values()) == core.scheduler.num_preemptions
    assert core.kv_cache.num_free_blocks == 10 and not core.has_unfinished_requests()


def test_swap_space_is_accepted_and_preemption_recomputes(tiny_llama_dir):
    """--swap-space is recorded but no KV is swapped anywhere yet: a preempted request recomputes."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=10, max_model_len=160, enable_prefix_caching=False,
              max_num_batched_tokens=32, swap_space=1.0, device="cpu", numerics="exact")
    outputs = llm.generate(PROMPTS[:5], greedy(40), use_tqdm=False)
    assert llm.llm_engine.config.swap_space == 1.0
    assert llm.llm_engine.core.core.scheduler.num_preemptions > 0
    assert all(len(o.outputs[0].token_ids) == 40 for o in outputs)


# ---- admission and queue timeouts ------------------------------------------------------------
def test_engine_refuses_beyond_max_num_queued_requests(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=1, max_num_queued_requests=2)
    engine.add_request("a", token_prompt(5, 10), greedy(4))
    engine.add_request("b", token_prompt(5, 20), greedy(4))
    engine.add_request("c", token_prompt(5, 30), greedy(4))
    # The core refuses "c" on arrival, before any work: offline it ends as an abort naming the reason
    # (the server turns it into a 429 with Retry-After).
    refused = {out.request_id: out for out in engine.step()}["c"]
    assert refused.finished and (refused.outputs[0].finish_reason, refused.outputs[0].stop_reason) == \
        ("abort", "queue_full") and refused.outputs[0].token_ids == []
    assert engine.num_rejected == {"queue_full": 1}
    # "a" runs now: one waiting, so there is room again.
    engine.add_request("c2", token_prompt(5, 30), greedy(4))
    outputs: dict = {}
    step_until_done(engine, {}, outputs)
    assert sorted(outputs) == ["a", "b", "c2"]


def test_queue_timeout_finishes_a_waiting_request_with_a_clear_reason(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=1, max_queue_time=0.2, max_model_len=1024)
    engine.add_request("long", token_prompt(5, 10), greedy(600))
    engine.step()
    engine.add_request("late", token_prompt(5, 50), greedy(4))
    outputs: dict = {}
    started = time.monotonic()
    step_until_done(engine, {}, outputs)
    late = outputs["late"].outputs[0]
    assert (late.finish_reason, late.stop_reason, late.token_ids) == ("abort", QUEUE_TIMEOUT, [])
    assert outputs["long"].outputs[0].finish_reason == "length"
    assert len(outputs["long"].outputs[0].token_ids) == 600
    assert engine.core.core.get_stats().num_queue_timeouts == 1
    assert time.monotonic() - started >= 0.2


# ---- length limit ----------------------------------------------------------------------------
def test_max_prompt_tokens_refuses_longer_prompts(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, max_prompt_tokens=16, numerics="exact")
    ok = llm.generate({"prompt_token_ids": list(range(1, 17))}, greedy(2), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 2
    with pytest.raises(InvalidRequestError) as info:
        llm.generate({"prompt_token_ids": list(range(1, 18))}, greedy(2), use_tqdm=False)
    assert (info.value.code, info.value.param, info.value.http_status) == ("prompt_too_long", "prompt", 400)
    assert "17 tokens" in info.value.message and "16" in info.value.message
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_refused_prompt_in_a_batch_leaves_nothing_queued(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, max_prompt_tokens=16, numerics="exact")
    with pytest.raises(InvalidRequestError):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": list(range(1, 40))}], greedy(2),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
