"""Speculative decoding with drafts from a model: a second checkpoint (draft_model), the target's first layers
(layer_skip) or its own weights through the int8 path (qspec). Greedy outputs are exactly plain decoding's
under batching, chunked prefill, prefix hits and preemption; the draft's KV lives in the target's blocks, so
every block is free again once the requests are done; a draft with another vocabulary is refused."""
from __future__ import annotations

import json

import pytest

from model_factory import build_tiny_llama
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelLoadError
from tokenmill.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def one_layer_draft_dir(tmp_path_factory, smollm2_tokenizer):
    """A different, smaller random model with the target's tokenizer: its drafts are mostly refused."""
    return build_tiny_llama(tmp_path_factory.mktemp("draft-1-layer"), smollm2_tokenizer, seed=7, num_hidden_layers=1)


def _prompts(tokenizer):
    shared = tokenizer.encode("one two three four five six seven eight nine ten eleven twelve thirteen fourteen " * 3)
    return [shared + tokenizer.encode(" and then"), shared + tokenizer.encode(" or else"),
            tokenizer.encode("The capital of France is"), [11, 12, 13, 14]]


def _run(model_dir, prompts, params, warm: bool = False, **kwargs):
    llm = LLM(str(model_dir), numerics="exact", **kwargs)
    if warm:  # the first prompt computed once, so the others' shared prefix is a cache hit
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


def _assert_everything_freed(llm):
    core = llm.llm_engine.core.core
    assert core.kv_cache.usage == 0.0 and core.kv_cache.num_free_blocks == core.num_kv_blocks
    # The runner learns of finished requests with the next step: after one, the draft holds nothing of them.
    llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=1), use_tqdm=False)
    drafter = core.runner.drafter
    assert set(drafter.computed) | set(drafter.tail) <= set(core.runner.input_batch.requests)
    assert len(core.runner.input_batch.requests) <= 1


@pytest.mark.parametrize("method", ["draft_model-itself", "draft_model-other", "layer_skip", "qspec"])
def test_greedy_outputs_equal_plain_decoding_with_chunks_and_prefix_hits(request, tiny_llama_dir, one_layer_draft_dir,
                                                                         smollm2_tokenizer, method):
    """Chunks of 16 tokens, two prompts sharing a cached prefix, a batch of four: the same tokens as plain
    decoding. The target drafting for itself (at the draft's faster numerics) keeps most drafts."""
    request.getfixturevalue("kernels")
    spec = {"draft_model-itself": {"model": str(tiny_llama_dir)},
            "draft_model-other": {"model": str(one_layer_draft_dir)},
            "layer_skip": {"method": "layer_skip", "num_layers": 1},
            "qspec": {"method": "qspec"}}[method]
    prompts = _prompts(smollm2_tokenizer)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 33, 25, 7)]
    kwargs = dict(num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=16, enable_prefix_caching=True,
                  warm=True)
    _, reference = _run(tiny_llama_dir, prompts, params, **kwargs)
    llm, tokens = _run(tiny_llama_dir, prompts, params, speculative_config={**spec, "num_speculative_tokens": 3},
                       **kwargs)
    assert tokens == reference
    stats = llm.llm_engine.core.core.get_stats()
    assert stats.spec_num_draft_tokens > 0 and stats.prefix_cache_hits > 0
    if method in ("draft_model-itself", "qspec"):
        assert stats.spec_num_accepted_tokens >= stats.spec_num_draft_tokens // 2
    _assert_everything_freed(llm)


def test_preemption_sampling_and_grammars_with_a_draft_model(request, tiny_llama_dir, smollm2_tokenizer):
    """Nine KV blocks force preemption mid-speculation (the draft's KV is rebuilt when a request resumes);
    a seeded sampled request speculates and is reproducible; a regex request's output matches its regex."""
    request.getfixturevalue("kernels")
    prompts = _prompts(smollm2_tokenizer)
    regex = r"(yes|no), [0-9]{3} items"
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=regex))]
    kwargs = dict(num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=32)
    spec = {"model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    _, reference = _run(tiny_llama_dir, prompts, params, **kwargs)
    llm, tokens = _run(tiny_llama_dir, prompts, params, speculative_config=spec, **kwargs)
    assert [tokens[i] for i in (0, 2, 3)] == [reference[i] for i in (0, 2, 3)]
    assert len(tokens[1]) == 30
    import re
    assert re.fullmatch(regex, smollm2_tokenizer.decode(tokens[3]))
    core = llm.llm_engine.core.core
    assert core.scheduler.num_preemptions > 0 and core.get_stats().spec_num_accepted_tokens > 0
    _assert_everything_freed(llm)
    _, again = _run(tiny_llama_dir, prompts[1:2], params[1:2], speculative_config=spec, **kwargs)
    assert again[0] == tokens[1]


def test_a_draft_with_another_vocabulary_is_refused(tmp_path, tiny_llama_dir, smollm2_tokenizer):
    import copy

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_tokens(["<only-in-the-draft>"])
    other = build_tiny_llama(tmp_path / "other-vocab", tokenizer, num_hidden_layers=1)
    with pytest.raises(ModelLoadError, match="different vocabulary"):
        LLM(str(tiny_llama_dir), num_kv_blocks=32, speculative_config={"model": str(other)})


def test_qspec_needs_an_exact_target(request, tiny_llama_dir):
    request.getfixturevalue("kernels")
    with pytest.raises(ModelLoadError, match="--numerics exact"):
        LLM(str(tiny_llama_dir), num_kv_blocks=32, quantization="q8_0", speculative_config={"method": "qspec"})


def test_layer_skip_cannot_keep_every_layer(tiny_llama_dir):
    with pytest.raises(ModelLoadError, match="num_layers"):
        LLM(str(tiny_llama_dir), num_kv_blocks=32, speculative_config={"method": "layer_skip", "num_layers": 2})


def test_draft_model_memory_and_blocks(request, tiny_llama_dir):
    """The KV budget holds the draft's blocks too: the same budget gives fewer blocks with a draft model."""
    request.getfixturevalue("kernels")
    budget = dict(kv_cache_memory_bytes=2**20, max_model_len=128)
    plain = LLM(str(tiny_llama_dir), numerics="exact", **budget).llm_engine.core.core
    drafted = LLM(str(tiny_llama_dir), numerics="exact", speculative_config={"method": "qspec"},
                  **budget).llm_engine.core.core
    draft_bytes = drafted.runner.drafter.bytes_per_block
    assert drafted.num_kv_blocks == 2**20 // (plain.bytes_per_block + draft_bytes) < plain.num_kv_blocks
    assert drafted.memory.kv_cache == drafted.num_kv_blocks * (plain.bytes_per_block + draft_bytes)
    assert json.dumps(drafted.resolved_options()["speculative_config"]["draft_block_matmul"]) != '"float32"'


@pytest.mark.parametrize("spec", [{"model": "TARGET", "num_speculative_tokens": 3},
                                  {"method": "ngram", "num_speculative_tokens": 3}])
def test_each_sample_of_an_n_request_speculates(request, tiny_llama_dir, smollm2_tokenizer, spec):
    """n = 2: each sample, once forked from the shared prompt, drafts and verifies on its own; greedy samples
    are plain decoding's, seeded ones reproducible."""
    request.getfixturevalue("kernels")
    spec = {**spec, "model": str(tiny_llama_dir)} if "model" in spec else spec
    prompts = _prompts(smollm2_tokenizer)[:2]
    greedy = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=24, ignore_eos=True)
    kwargs = dict(num_kv_blocks=64, max_model_len=256)
    plain = LLM(str(tiny_llama_dir), numerics="exact", **kwargs)
    drafted = LLM(str(tiny_llama_dir), numerics="exact", speculative_config=spec, **kwargs)

    def samples(llm, params):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[sample.token_ids for sample in o.outputs] for o in outputs]

    assert samples(drafted, greedy) == samples(plain, greedy)
    first = samples(drafted, seeded)
    assert all(len(tokens) == 24 for per_prompt in first for tokens in per_prompt)
    assert samples(drafted, seeded) == first
    assert drafted.llm_engine.core.core.get_stats().spec_num_draft_tokens > 0


def test_sampled_requests_draw_drafts_from_the_draft_distribution(request, tiny_llama_dir, smollm2_tokenizer):
    """At temperature 1 the tiny random model's distribution is nearly flat, so a guess (a point mass) would
    almost never be kept; drafts drawn from the draft's own distribution (q, close to the target's under
    qspec) are kept with probability sum min(p, q): most of them. Seeded requests stay reproducible."""
    request.getfixturevalue("kernels")
    prompts = _prompts(smollm2_tokenizer)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=30, ignore_eos=True) for seed in range(4)]
    spec = {"method": "qspec", "num_speculative_tokens": 3}
    llm, tokens = _run(tiny_llama_dir, prompts, params, speculative_config=spec, num_kv_blocks=128,
                       max_model_len=256)
    stats = llm.llm_engine.core.core.get_stats()
    assert stats.spec_num_draft_tokens > 20
    assert stats.spec_num_accepted_tokens >= 0.7 * stats.spec_num_draft_tokens, stats
    assert all(len(t) == 30 for t in tokens)
    _, again = _run(tiny_llama_dir, prompts, params, speculative_config=spec, num_kv_blocks=128, max_model_len=256)
    assert again == tokens


def test_layer_skip_drafts_on_the_targets_kv_cache(tiny_llama_dir):
    """layer_skip's layers are the target's first ones at its numerics: they read and write the target's
    KV tensors, cost the KV budget nothing, and never catch up (every position the target computed is theirs)."""
    budget = dict(kv_cache_memory_bytes=2**20, max_model_len=128, numerics="exact")
    plain = LLM(str(tiny_llama_dir), **budget).llm_engine.core.core
    llm = LLM(str(tiny_llama_dir), speculative_config={"method": "layer_skip", "num_layers": 1}, **budget)
    core = llm.llm_engine.core.core
    drafter = core.runner.drafter
    assert core.num_kv_blocks == plain.num_kv_blocks and drafter.bytes_per_block == 0
    assert drafter.runner.layer_kv_caches[0] is core.runner.layer_kv_caches[0]
    assert drafter.runner.dtype == core.runner.dtype
    caught_up = []
    original = drafter._catch_up
    drafter._catch_up = lambda rid, start, end: caught_up.append(end - start) or original(rid, start, end)
    llm.generate([{"prompt_token_ids": list(range(5, 45))}], SamplingParams(temperature=0, max_tokens=20,
                                                                           ignore_eos=True), use_tqdm=False)
    assert caught_up and set(caught_up) == {1}  # only the sampled token: the prompt is the target's


@pytest.mark.slow
def test_json_schema_replies_are_plain_decodings_tokens(request):
    """Drafts stop before text the grammar forces: there plain decoding appends the grammar's own tokens
    (fast-forward), while a draft, or the token sampled after the last one, could spell the same text with
    other tokens (SmolLM2 writes `","` where the grammar forces `"` and `,"city":"`)."""
    request.getfixturevalue("kernels")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "job": {"type": "string"}},
              "required": ["name", "city", "job"], "additionalProperties": False}
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True))
    people = [("Alice Martin", "Paris", "structural engineer"), ("Bruno Keller", "Zurich", "pastry chef"),
              ("Chiara Rossi", "Bologna", "marine biologist"), ("Daniel Okafor", "Lagos", "software architect")]
    conversations = [[{"role": "user", "content": f"Extract name, city and job as JSON:\n{name} lives in {city} "
                                                  f"and works as a {job}."}] for name, city, job in people * 2]
    kwargs = dict(kv_cache_memory_bytes="256MiB", max_model_len=512, numerics="exact")
    reference = [o.outputs[0].token_ids for o in LLM(**kwargs).chat(conversations, params, use_tqdm=False)]
    llm = LLM(speculative_config={"method": "qspec"}, **kwargs)
    outputs = llm.chat(conversations, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert llm.llm_engine.core.core.get_stats().spec_num_accepted_tokens > 0
    for output in outputs:
        assert set(json.loads(output.outputs[0].text)) == {"name", "city", "job"}


def test_stop_strings_and_max_tokens_end_a_drafted_reply_where_plain_decoding_does(request, tiny_llama_dir,
                                                                                  smollm2_tokenizer):
    """Several tokens arrive per step with drafts: a stop string inside them still ends the reply at the
    same text, and max_tokens is never exceeded."""
    request.getfixturevalue("kernels")
    prompts = _prompts(smollm2_tokenizer)[:2]
    kwargs = dict(num_kv_blocks=128, max_model_len=256)
    plain = LLM(str(tiny_llama_dir), numerics="exact", **kwargs)
    text = plain.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=30,
                                                                             ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
              SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)]
    drafted = LLM(str(tiny_llama_dir), numerics="exact", speculative_config={"model": str(tiny_llama_dir)}, **kwargs)
    outputs = {}
    for name, llm in (("plain", plain), ("drafted", drafted)):
        outputs[name] = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                         for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert outputs["drafted"] == outputs["plain"]
    assert outputs["drafted"][0][2] == "stop" and stop not in outputs["drafted"][0][0]
    assert len(outputs["drafted"][1][1]) == 13 and outputs["drafted"][1][2] == "length"
    assert drafted.llm_engine.core.core.get_stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("max_tokens, drafts", [(40, True), (8, False)])
def test_a_rested_draft_resumes_only_for_a_reply_long_enough_to_repay_its_catch_up(request, tiny_llama_dir,
                                                                                   max_tokens, drafts):
    """Two requests start together above the batch limit of 1, so the draft model rests; once the short one
    ends, the other drafts again only if enough of its reply is left (at least an eighth of its tokens)."""
    request.getfixturevalue("kernels")
    llm = LLM(str(tiny_llama_dir), numerics="exact", num_kv_blocks=64, max_model_len=256,
              speculative_config={"method": "qspec", "disable_by_batch_size": 1})
    prompt = {"prompt_token_ids": list(range(100, 160))}
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)]
    outputs = llm.generate([prompt, prompt], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, max_tokens]
    assert (llm.llm_engine.core.core.get_stats().spec_num_draft_tokens > 0) == drafts
