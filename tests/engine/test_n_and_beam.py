"""n > 1 and beam search share KV blocks: the prompt is computed once, samples and beams fork with
copy-on-write, and the results equal independent runs (n) and a plain HF reference (beams)."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.beam_search import BeamSearchParams, get_beam_search_score
from tokenmill.errors import InvalidRequestError

# 70 tokens (block size 16): 4 full blocks + 6 tokens. An n > 1 parent computes 69 of them and its samples share
# the partially filled block 4, so all but the last of them must copy it before writing.
PROMPT = [1000 + 7 * i for i in range(70)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def record_schedules(llm: LLM, monkeypatch) -> list:
    """Wrap the scheduler (for this test) so every SchedulerOutput is kept for inspection."""
    scheduler = llm.llm_engine.core.core.scheduler
    outputs, schedule = [], scheduler.schedule

    def recording():
        out = schedule()
        outputs.append(out)
        return out

    monkeypatch.setattr(scheduler, "schedule", recording)
    return outputs


def prompt_tokens_scheduled(outputs: list, prompt_len: int) -> int:
    """Prompt positions sent through the model, over all sequences of the run."""
    return sum(max(0, min(s.start_position + s.num_new_tokens, prompt_len) - s.start_position)
               for out in outputs for s in out.scheduled)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    # No prefix cache: a shared prompt must come from forking, never from cache hits.
    return LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256, enable_prefix_caching=False, numerics="exact")


# ---- n > 1 -------------------------------------------------------------------------------
def test_greedy_n3_gives_three_copies_of_n1(llm, monkeypatch):
    single = llm.generate({"prompt_token_ids": PROMPT}, greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    outputs = record_schedules(llm, monkeypatch)
    out = llm.generate({"prompt_token_ids": PROMPT}, greedy(10).clone(n=3), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [single] * 3
    # The prompt went through the model once, not once per sample: the parent computed all but its
    # last token, then each sample computed that last token itself (3 * 70 if each recomputed it).
    assert prompt_tokens_scheduled(outputs, len(PROMPT)) == len(PROMPT) - 1 + 3
    # Block 4 (partial) was shared by the three samples: the first two copied it, the last wrote in place.
    copies = [c for out in outputs for c in out.block_copies]
    assert len(copies) == 2 and len({src for src, _ in copies}) == 1
    assert llm.llm_engine.core.core.kv_cache.num_free_blocks == 64


def test_seeded_n3_samples_differ_and_each_equals_its_own_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    samples = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in samples}) == 3
    # Sample i runs with seed + i; alone, with no shared blocks, it draws the same tokens. A broken
    # copy-on-write (samples overwriting each other's KV) would change them.
    for i, sample in enumerate(samples):
        alone = llm.generate({"prompt_token_ids": PROMPT}, params.clone(n=1, seed=11 + i), use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == sample


def peak_blocks_used(llm: LLM, requests: list[tuple[str, SamplingParams]]) -> int:
    """Add the requests, step the engine by hand, and return the most blocks held at once."""
    engine = llm.llm_engine
    kv = engine.core.core.kv_cache
    for request_id, params in requests:
        engine.add_request(request_id, engine.input_processor.process_prompt({"prompt_token_ids": PROMPT}), params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, kv.pool.num_blocks - kv.num_free_blocks)
    assert kv.num_free_blocks == kv.pool.num_blocks
    return peak


def test_n_samples_use_far_fewer_blocks_than_n_requests(llm):
    n, max_tokens = 4, 8
    # Tokens 0..76 at most: 5 blocks per sequence, 4 of them full prompt blocks that can be shared.
    separate = peak_blocks_used(llm, [(f"sep-{i}", greedy(max_tokens)) for i in range(n)])
    forked = peak_blocks_used(llm, [("forked", greedy(max_tokens).clone(n=n))])
    assert separate == n * 5
    assert forked == 4 + n  # shared prompt blocks + one private last block per sample


# ---- beam search -------------------------------------------------------------------------
PEAKY_INIT = 0.3  # weight init std of the beam-search model (the default 0.02 gives ~uniform logits)


@pytest.fixture(scope="module")
def peaky_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny Llama with larger weights, so next-token distributions are peaked and the candidates at
    each cut are >= 0.01 apart in logprob (with the default init they are ~uniform, and the cut can
    fall between candidates closer than float noise)."""
    from model_factory import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("peaky-llama"), smollm2_tokenizer, initializer_range=PEAKY_INIT)


@pytest.fixture(scope="module")
def hf_peaky(peaky_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(peaky_dir, dtype=torch.float32).eval()


def reference_beam_search(model, prompt: list[int], width: int, max_tokens: int, eos: set[int],
                          ignore_eos: bool = False, length_penalty: float = 1.0) -> list[tuple[list[int], float]]:
    """Textbook beam search with full recomputation: every beam runs its whole sequence through
    HF transformers each step; 2 * width candidates per beam; EOS candidates finish."""
    def score(item):
        return get_beam_search_score(item[0], item[1], list(eos), length_penalty)

    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            with torch.inference_mode():
                logits = model(torch.tensor([tokens])).logits[0, -1].float()
            top = torch.log_softmax(logits, dim=-1).topk(2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                item = (tokens + [token], cum + logprob)
                (completed if token in eos and not ignore_eos else candidates).append(item)
        beams = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(completed + beams, key=score, reverse=True)[:width]


BEAM_PROMPTS = ["The quick brown fox jumps over the lazy dog because", "1 2 3", "Once upon a time"]


def check_beams(llm: LLM, hf_model, tokenizer, width: int, max_tokens: int, eos: set[int], **kw) -> list:
    prompts = [tokenizer.encode(p) for p in BEAM_PROMPTS]
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                              BeamSearchParams(beam_width=width, max_tokens=max_tokens, **kw))
    for prompt, result in zip(prompts, results):
        expected = reference_beam_search(hf_model, prompt, width, max_tokens, eos, **kw)
        assert [s.tokens for s in result.sequences] == [tokens for tokens, _ in expected]
        assert [s.cum_logprob for s in result.sequences] == pytest.approx([c for _, c in expected], abs=1e-3)
    return results


def test_beam_width_1_is_greedy(tiny_llama_dir, smollm2_tokenizer):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256, numerics="exact")
    prompt = smollm2_tokenizer.encode(BEAM_PROMPTS[0])
    expected = llm.generate({"prompt_token_ids": prompt}, greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True))
    (seq,) = out[0].sequences
    assert seq.tokens == prompt + expected and seq.finish_reason == "length"
    assert len(seq.logprobs) == 12
    assert seq.cum_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(expected, seq.logprobs)), abs=1e-4)
    assert seq.text == smollm2_tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("width", [2, 3])
def test_beam_search_matches_a_full_recompute_reference(peaky_dir, hf_peaky, smollm2_tokenizer, width, monkeypatch):
    llm = LLM(str(peaky_dir), num_kv_blocks=64, max_model_len=256, enable_prefix_caching=False, numerics="exact")
    outputs = record_schedules(llm, monkeypatch)
    max_tokens = 8
    results = check_beams(llm, hf_peaky, smollm2_tokenizer, width, max_tokens, {smollm2_tokenizer.eos_token_id},
                          ignore_eos=True, length_penalty=0.7)
    assert all(len(r.sequences) == width for r in results)
    # Each prompt went through the model once; afterwards every step costs one token per beam.
    prompt_lens = [len(smollm2_tokenizer.encode(p)) for p in BEAM_PROMPTS]
    total = sum(s.num_new_tokens for out in outputs for s in out.scheduled)
    assert total == sum(prompt_lens) + len(BEAM_PROMPTS) * width * (max_tokens - 1)
    # Beams forked from each other: partial blocks were copied, nothing leaked.
    assert any(out.block_copies for out in outputs)
    assert (llm.llm_engine.core.core.kv_cache.num_free_blocks == 64
            and not llm.llm_engine.core.core.has_unfinished_requests())


def test_eos_finishes_a_beam_that_stays_a_candidate(tmp_path, hf_peaky, peaky_dir, smollm2_tokenizer):
    """Make a token the search meets at step 2 an extra EOS id of the model: the run must finish some
    hypotheses early ("stop"), keep them among the candidates, and still equal the reference."""
    from model_factory import build_tiny_llama

    prompt = smollm2_tokenizer.encode(BEAM_PROMPTS[0])
    probe = LLM(str(peaky_dir), num_kv_blocks=64, max_model_len=256, numerics="exact")
    first = probe.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=2, max_tokens=3))[0]
    stop_token = first.sequences[0].tokens[len(prompt) + 1]
    # Same seed, same weights; only the config's EOS id differs.
    eos_dir = build_tiny_llama(tmp_path / "eos", smollm2_tokenizer, initializer_range=PEAKY_INIT,
                               eos_token_id=stop_token)
    llm = LLM(str(eos_dir), num_kv_blocks=64, max_model_len=256, numerics="exact")
    eos = {smollm2_tokenizer.eos_token_id, stop_token}
    results = check_beams(llm, hf_peaky, smollm2_tokenizer, 2, 5, eos)
    finished = [s for s in results[0].sequences if s.finish_reason == "stop"]
    assert finished and all(s.tokens[-1] == stop_token and stop_token not in s.tokens[len(prompt):-1]
                            for s in finished)
    assert llm.llm_engine.core.core.kv_cache.num_free_blocks == 64


def test_an_interrupted_beam_search_leaves_nothing_behind(tiny_llama_dir, monkeypatch):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=256, numerics="exact")
    core = llm.llm_engine.core.core
    step, calls = core.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:  # parked beams have just been handed their children
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(core, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.beam_search("Hello there", BeamSearchParams(beam_width=3, max_tokens=6))
    monkeypatch.undo()
    assert not core.has_unfinished_requests() and core.kv_cache.num_free_blocks == 64
    out = llm.beam_search("Hello there", BeamSearchParams(beam_width=3, max_tokens=6))
    assert len(out[0].sequences) == 3


def test_beam_search_validates_its_params(tiny_llama_dir):
    with pytest.raises(InvalidRequestError):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(InvalidRequestError):
        BeamSearchParams(beam_width=11, max_tokens=4)  # 2 * width logprobs exceed the cap of 20
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=64, numerics="exact")
    with pytest.raises(InvalidRequestError):
        llm.beam_search("hello", BeamSearchParams(beam_width=2, max_tokens=100))
    assert not llm.llm_engine.core.core.has_unfinished_requests()
