"""The offline LLM API end to end on a tiny random Llama: preemption, seeds, stops, n, logprobs."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError

PROMPTS = ["Hello there, how are", "The quick brown fox jumps over the lazy dog because", "1 2 3", "Why",
           "A long time ago in a galaxy far, far away, there was a small"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_preemption_gives_identical_outputs_and_frees_every_block(tiny_llama_dir):
    big = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_model_len=256, enable_prefix_caching=False, numerics="exact")
    reference = [o.outputs[0].token_ids for o in big.generate(PROMPTS, greedy(40), use_tqdm=False)]
    # 12 blocks of 16 tokens cannot hold five 50-token sequences at once: requests must be preempted.
    small = LLM(str(tiny_llama_dir), num_kv_blocks=12, max_model_len=192, enable_prefix_caching=False,
                max_num_batched_tokens=32, numerics="exact")
    outputs = small.generate(PROMPTS, greedy(40), use_tqdm=False)
    core = small.llm_engine.core.core
    assert core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert core.kv_cache.num_free_blocks == 12 and core.kv_cache.usage == 0.0
    assert not core.has_unfinished_requests()


def test_outputs_come_back_in_input_order_with_prompt_fields(tiny_llama_dir, tokenizer):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, numerics="exact")
    outputs = llm.generate(PROMPTS, [greedy(m) for m in (3, 9, 1, 5, 7)], use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 9, 1, 5, 7]
    for out in outputs:
        assert out.prompt_token_ids == tokenizer.encode(out.prompt)
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_regardless_of_batch(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, numerics="exact")
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate(PROMPTS[::-1], [greedy(8)] * 4 + [params], use_tqdm=False)[-1].outputs[0].token_ids
    assert alone == batched
    other = llm.generate(PROMPTS[0], params.clone(seed=99), use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone


def test_stop_strings_and_stop_token_ids(tiny_llama_dir, tokenizer):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, numerics="exact")
    full = llm.generate(PROMPTS[1], greedy(30), use_tqdm=False)[0].outputs[0]
    # Stop on a piece of text that greedy decoding will produce; the text ends right before it.
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    first = full.text.find(stop)
    if not stop.strip() or first < 1:
        pytest.skip("random model produced no usable stop text")
    out = llm.generate(PROMPTS[1], greedy(30).clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(PROMPTS[1], greedy(30).clone(stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:first + len(stop)]
    token = full.token_ids[4]
    out = llm.generate(PROMPTS[1], greedy(30).clone(stop_token_ids=[token]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(token) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == token


def test_n_samples_and_logprobs(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, numerics="exact")
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, logprobs=2,
                                                  ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for completion in out.outputs:
        assert len(completion.logprobs) == 12
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert token in entry and len(entry) in (2, 3)
            assert entry[token].logprob <= 0.0
        assert completion.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)), abs=1e-4)


def test_prompt_logprobs_cover_the_prompt(tiny_llama_dir, tokenizer):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=5, numerics="exact")
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for token, entry in zip(ids[1:], out.prompt_logprobs[1:]):
        assert token in entry


def test_max_logprobs_bounds_what_a_request_may_ask(tiny_llama_dir):
    """--max-logprobs (vLLM's, default 20) caps logprobs and prompt_logprobs per request; above it a clear
    error names the field, before anything runs."""
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, numerics="exact", max_logprobs=30)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, logprobs=25, prompt_logprobs=30), use_tqdm=False)[0]
    assert all(len(entry) in (25, 26) for entry in out.outputs[0].logprobs)
    assert all(len(entry) in (30, 31) for entry in out.prompt_logprobs[1:])
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError, match=f"{field} asks for 31 .* maximum of 30 \\(--max-logprobs\\)"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, **{field: 31}), use_tqdm=False)
    default = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, numerics="exact")
    with pytest.raises(InvalidRequestError, match="maximum of 20"):
        default.generate(PROMPTS[0], SamplingParams(max_tokens=2, logprobs=21), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests() and not default.llm_engine.has_unfinished_requests()


def test_chat_applies_the_template(tiny_llama_dir, tokenizer):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, numerics="exact")
    messages = [{"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, greedy(4), use_tqdm=False)[0]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected
    assert out.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)


def test_bad_input_is_refused_before_anything_runs(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=64, numerics="exact")
    with pytest.raises(InvalidRequestError):
        llm.generate("", greedy(4), use_tqdm=False)
    with pytest.raises(InvalidRequestError):
        llm.generate({"prompt_token_ids": [10**7]}, greedy(4), use_tqdm=False)
    with pytest.raises(InvalidRequestError):
        llm.generate("hello", greedy(100), use_tqdm=False)
    with pytest.raises(InvalidRequestError):
        SamplingParams(top_p=1.5)
    assert not llm.llm_engine.has_unfinished_requests()


def test_lpm_wait_bound_reaches_the_policy(tiny_llama_dir):
    import argparse

    from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--scheduling-policy", "lpm", "--lpm-max-wait", "0.5"]))
    assert config.lpm_max_wait == 0.5
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=32, max_model_len=128, scheduling_policy="lpm", lpm_max_wait=0.5,
              numerics="exact")
    policy = llm.llm_engine.core.core.scheduler.policy
    assert policy.name == "lpm" and policy.max_wait_s == 0.5


def test_step_budget_defaults_by_device_and_fits_unchunked_prompts(tiny_llama_dir, tmp_path, tokenizer):
    from model_factory import build_tiny_llama
    from tokenmill.errors import ModelLoadError

    cpu = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=64, numerics="exact")
    assert cpu.llm_engine.core.core.scheduler.config.max_num_batched_tokens == 1024
    explicit = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=64, max_num_batched_tokens=96, numerics="exact")
    assert explicit.llm_engine.core.core.scheduler.config.max_num_batched_tokens == 96

    # Without chunked prefill a prompt must fit one step: the default budget grows to the model length ...
    long_model = build_tiny_llama(tmp_path / "long", tokenizer, max_position_embeddings=1536)
    unchunked = LLM(str(long_model), device="cpu", num_kv_blocks=100, enable_chunked_prefill=False, numerics="exact")
    assert unchunked.llm_engine.core.core.max_model_len == 1536
    assert unchunked.llm_engine.core.core.scheduler.config.max_num_batched_tokens == 1536
    long_prompt = {"prompt_token_ids": [5 + i % 300 for i in range(1400)]}
    out = unchunked.generate([long_prompt], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    # ... and an explicit budget that could never hold a full prompt is refused at startup.
    with pytest.raises(ModelLoadError, match=r"max_num_batched_tokens \(1024\) is smaller than max_model_len \(1536\)"):
        LLM(str(long_model), device="cpu", num_kv_blocks=100, enable_chunked_prefill=False,
            max_num_batched_tokens=1024, numerics="exact")


def test_default_threads_follow_the_cpus_the_process_may_use(tiny_llama_dir, monkeypatch):
    """Under `taskset -c 0` (or a one-CPU cpuset) the engine runs one torch thread, not one per CPU of the
    machine, which would make its threads take turns on the one CPU."""
    import os

    import torch

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        LLM(str(tiny_llama_dir), max_model_len=64, num_kv_blocks=8).shutdown()
        assert torch.get_num_threads() == 1
        LLM(str(tiny_llama_dir), max_model_len=64, num_kv_blocks=8, num_threads=2).shutdown()
        assert torch.get_num_threads() == 2  # --num-threads still says
    finally:
        torch.set_num_threads(before)
