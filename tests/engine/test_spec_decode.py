"""Speculative decoding with n-gram drafts: greedy outputs are exactly those of plain decoding, sampled
requests speculate too (their distribution is tested in tests/sample/test_spec_sampling.py), and drafts
are really verified and kept."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import SpeculativeConfig
from tokenmill.errors import InvalidRequestError
from tokenmill.spec_decode.ngram import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def test_ngram_proposals_follow_the_latest_earlier_match():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1))
    assert proposer.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]
    assert proposer.propose([9, 1, 2, 8, 1, 2, 7, 1, 2]) == [7, 1, 2]  # the most recent occurrence wins
    assert proposer.propose([1, 2, 3, 5, 6, 3]) == [5, 6, 3]  # a 1-gram match when no longer one exists
    assert proposer.propose([1, 2, 3, 4]) == []
    assert proposer.propose([5]) == []
    longest = NgramProposer(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=2))
    assert longest.propose([1, 2, 9, 3, 2, 7, 2]) == []  # only 1-grams match, below prompt_lookup_min


@pytest.mark.parametrize("config", [
    {"method": "eagle"}, {"num_speculative_tokens": 0}, {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
    {"method": "draft_model"}, {"num_speculative_tokens": "4"}, [1], {"method": "ngram", "num_layers": 2},
    {"method": "layer_skip", "num_layers": 0}, {"method": "qspec", "numerics": "exact"},
    {"model": "x", "numerics": "fp8"},
])
def test_bad_speculative_configs_are_refused(config):
    with pytest.raises(InvalidRequestError):
        SpeculativeConfig.from_dict(config)


def _prompts(tokenizer):
    repetitive = tokenizer.encode("one two three four five six one two three four five six one two three")
    return [repetitive, repetitive[:9] * 3, tokenizer.encode("The capital of France is"), [11, 12, 13, 14]]


# "torch" (any device, the GPU's backend) verifies drafts as a prefill-like chunk; "auto" on CPU picks
# the paged C++ kernels, where each draft position is a decode row of its own.
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_greedy_outputs_equal_plain_decoding_and_drafts_are_kept(tiny_llama_dir, smollm2_tokenizer, backend):
    prompts = [{"prompt_token_ids": p} for p in _prompts(smollm2_tokenizer)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 33, 25, 7)]
    plain = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=512, attention_backend=backend, numerics="exact")
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=512, speculative_config=NGRAM,
               attention_backend=backend, numerics="exact")
    outputs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert [len(o.outputs[0].token_ids) for o in outputs] == [40, 33, 25, 7]
    stats = spec.llm_engine.core.core.get_stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    assert spec.llm_engine.core.core.kv_cache.usage == 0.0
    # Every kept draft is counted once: per position (a draft at position i is kept only after those
    # before it), per verify, and per request.
    per_position = stats.spec_accepted_per_position
    assert sum(per_position) == stats.spec_num_accepted_tokens and 0 < stats.spec_num_drafts
    assert all(a >= b for a, b in zip(per_position, per_position[1:])) and per_position[0] <= stats.spec_num_drafts
    assert sum(o.metrics.num_spec_accepted_tokens for o in outputs) == stats.spec_num_accepted_tokens


def test_speculation_under_preemption_and_beside_sampled_requests(tiny_llama_dir, smollm2_tokenizer):
    """A small cache forces preemption mid-speculation; a seeded random request speculates too (speculative
    sampling), so does a logprobs request, and a greedy request with a repetition penalty verifies through
    the sampler's path: every greedy output (and logprob) equals the one without speculation, and the seeded
    one is reproducible."""
    prompts = [{"prompt_token_ids": p} for p in _prompts(smollm2_tokenizer)]
    prompts.append(prompts[0])  # a repetitive prompt, asking for logprobs
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)]
    kwargs = dict(num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=32, enable_prefix_caching=True,
                  numerics="exact")
    plain = LLM(str(tiny_llama_dir), **kwargs)
    reference = plain.generate(prompts, params, use_tqdm=False)
    spec = LLM(str(tiny_llama_dir), speculative_config=NGRAM, **kwargs)
    outputs = spec.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert [tokens[i] for i in (0, 2, 3, 4)] == [reference[i].outputs[0].token_ids for i in (0, 2, 3, 4)]
    assert len(tokens[1]) == 30
    # The logprobs request speculates too: every token's entry (kept drafts' included) is the one plain
    # decoding gives, from the logits at its own position.
    spec_logprobs, plain_logprobs = outputs[4].outputs[0].logprobs, reference[4].outputs[0].logprobs
    assert len(spec_logprobs) == len(plain_logprobs) == 40 and outputs[4].metrics.num_spec_accepted_tokens > 0
    for token, got, want in zip(tokens[4], spec_logprobs, plain_logprobs):
        assert token in got and got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-3 and got[t].rank == want[t].rank for t in got)
    assert outputs[4].outputs[0].cumulative_logprob == pytest.approx(reference[4].outputs[0].cumulative_logprob,
                                                                      abs=1e-2)
    core = spec.llm_engine.core.core
    assert core.scheduler.num_preemptions > 0 and core.get_stats().spec_num_accepted_tokens > 0
    assert core.kv_cache.usage == 0.0
    again = LLM(str(tiny_llama_dir), speculative_config=NGRAM, **kwargs).generate(prompts[1:2], params[1:2],
                                                                                   use_tqdm=False)
    assert again[0].outputs[0].token_ids == tokens[1]


@pytest.mark.slow
def test_smollm2_copying_prompt_keeps_drafts_and_matches_plain_decoding():
    text = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    messages = [{"role": "user", "content": "Copy this code exactly:\n" + text}]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(kv_cache_memory_bytes="128MiB", max_model_len=512, numerics="exact")
    spec = LLM(kv_cache_memory_bytes="128MiB", max_model_len=512, speculative_config=NGRAM, numerics="exact")
    reference = plain.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids
    assert spec.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids == reference
    stats = spec.llm_engine.core.core.get_stats()
    assert stats.spec_num_accepted_tokens >= 10  # copied code is mostly guessed right
    # A sampled request speculates too: at a low temperature the copy is still mostly what the drafts say.
    before = stats.spec_num_accepted_tokens
    sampled = SamplingParams(temperature=0.5, top_p=0.95, seed=1, max_tokens=48, ignore_eos=True)
    assert len(spec.chat(messages, sampled, use_tqdm=False)[0].outputs[0].token_ids) == 48
    assert spec.llm_engine.core.core.get_stats().spec_num_accepted_tokens - before >= 10


def test_q8_0_verify_steps_run_the_fused_decode_stack(request, tiny_llama_dir, smollm2_tokenizer):
    """With block tables, each draft position is a decode row of its own (same blocks, one more token
    of context), so a verify step of a Q8_0 model stays on the fused C++ stack and gives the same tokens."""
    request.getfixturevalue("kernels")
    prompts = [{"prompt_token_ids": p} for p in _prompts(smollm2_tokenizer)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kwargs = dict(num_kv_blocks=128, max_model_len=512, quantization="q8_0", device="cpu", numerics="exact")
    reference = [o.outputs[0].token_ids for o in LLM(str(tiny_llama_dir), **kwargs).generate(prompts, params,
                                                                                            use_tqdm=False)]
    spec = LLM(str(tiny_llama_dir), speculative_config=NGRAM, **kwargs)
    model = spec.llm_engine.core.core.runner.model
    fused_rows = []
    original = model._forward_int8_decode

    def counting(input_ids, *args):
        fused_rows.append(input_ids.numel())
        return original(input_ids, *args)

    model._forward_int8_decode = counting
    outputs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert spec.llm_engine.core.core.get_stats().spec_num_accepted_tokens > 0
    assert max(fused_rows) > len(prompts)  # some fused steps carried draft rows


def test_adaptive_draft_length_follows_acceptance():
    from tokenmill.spec_decode import adaptive

    # A draft is proposed while its chance of being kept (acceptance ** position) stays high enough.
    assert adaptive.draft_length(4, 1.0) == 4 and adaptive.draft_length(4, 0.8) == 4
    assert adaptive.draft_length(4, adaptive.PRIOR) == 2 and adaptive.draft_length(4, 0.2) == 0
    assert adaptive.draft_length(1, 0.9) == 1
    # Refused drafts pull the acceptance down until the request stops proposing; idle steps bring it back.
    acceptance = adaptive.PRIOR
    verifies = 0
    while adaptive.draft_length(4, acceptance):
        acceptance = adaptive.after_verify(acceptance, adaptive.draft_length(4, acceptance), 0)
        verifies += 1
    assert 1 <= verifies <= 4
    idle = 0
    while not adaptive.draft_length(4, acceptance):
        acceptance = adaptive.after_idle_step(acceptance)
        idle += 1
    assert 3 <= idle <= 20  # it tries again, but not at once
    assert adaptive.after_verify(0.5, 2, 2) > 0.5 and adaptive.after_verify(0.5, 0, 0) == 0.5


def test_refused_drafts_shrink_a_requests_drafts_and_fixed_length_keeps_them(tiny_llama_dir, smollm2_tokenizer):
    """The tiny random model rarely follows an n-gram: with the adaptive length its requests verify fewer
    drafts than with a fixed one, for the same (greedy, exact) output."""
    prompts = [{"prompt_token_ids": p} for p in _prompts(smollm2_tokenizer)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    drafted = {}
    outputs = {}
    for adaptive_length in (True, False):
        llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=512, numerics="exact",
                  speculative_config={**NGRAM, "prompt_lookup_min": 1, "adaptive": adaptive_length})
        outputs[adaptive_length] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.llm_engine.core.core.get_stats()
        drafted[adaptive_length] = (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
    assert outputs[True] == outputs[False]
    assert drafted[True][0] < drafted[False][0], drafted
    assert drafted[True][1] / drafted[True][0] >= drafted[False][1] / drafted[False][0], drafted


def test_one_decision_per_step_pauses_drafts_for_large_batches(tiny_llama_dir, smollm2_tokenizer):
    from tokenmill.spec_decode import adaptive

    assert adaptive.step_draft_limit(4, 8, 8) == 4 and adaptive.step_draft_limit(4, 9, 8) == 0
    assert adaptive.step_draft_limit(4, 100, None) == 4
    prompts = [{"prompt_token_ids": p} for p in _prompts(smollm2_tokenizer)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    drafted = []
    for batch in (prompts, prompts[:1]):
        llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=512, numerics="exact",
                  speculative_config={**NGRAM, "disable_by_batch_size": 1})
        llm.generate(batch, params, use_tqdm=False)
        drafted.append(llm.llm_engine.core.core.get_stats().spec_num_draft_tokens)
    # Four requests running together never draft; the first of them alone does.
    assert drafted[0] == 0 and drafted[1] > 0
