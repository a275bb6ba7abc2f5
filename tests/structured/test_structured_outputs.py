"""Structured outputs: grammar masks applied before sampling, on the tiny random Llama (whose
unconstrained text is noise, so anything well-formed below is the grammar's doing)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured.backend import allocate_token_bitmask, apply_token_bitmask

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tag": {"enum": ["red", "green", "blue"]},
                   "ok": {"type": "boolean"}},
    "required": ["id", "tag", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=256, numerics="exact")


def _one(llm: LLM, prompt: str, **params):
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def test_bitmask_matches_llguidance_kernel():
    # llguidance's numpy kernel: the same masking as its torch one, which compiles through torch.compile (many
    # seconds on a small CPU; its module import alone pulls in torch._dynamo).
    from llguidance.numpy import apply_token_bitmask_inplace

    generator = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word's high bits are past the vocabulary
    bitmask = allocate_token_bitmask(3, vocab)
    bitmask[1:] = torch.randint(-2**31, 2**31 - 1, bitmask[1:].shape, dtype=torch.int32, generator=generator)
    logits = torch.randn(3, vocab, generator=generator)
    ours, theirs = logits.clone(), logits.clone().numpy()
    apply_token_bitmask(ours, bitmask)
    apply_token_bitmask_inplace(theirs, bitmask.numpy())
    assert torch.equal(ours, torch.from_numpy(theirs))
    assert torch.equal(ours[0], logits[0])  # an all-ones row keeps everything
    allowed = [token for token in range(vocab) if (int(bitmask[1, token // 32]) >> (token % 32)) & 1]
    assert torch.isfinite(ours[1]).nonzero().flatten().tolist() == allowed and 0 < len(allowed) < vocab


def test_a_grammar_fills_its_row_as_llguidance_does(llm):
    """The backend fills a bitmask row through the matcher itself (not llguidance.torch, whose import costs the
    first structured step seconds): the same words as llguidance's own fill, in the row it names only."""
    import sys

    from llguidance.numpy import fill_next_token_bitmask

    backend = llm.llm_engine.input_processor.structured_backend
    grammar = backend.compile(StructuredOutputsParams(json=SCHEMA))
    vocab = backend.vocab_size
    ours = allocate_token_bitmask(3, vocab)
    ours[2] = 0
    grammar.fill_bitmask(ours, 1)
    theirs = allocate_token_bitmask(3, vocab).numpy()
    fill_next_token_bitmask(backend.compile(StructuredOutputsParams(json=SCHEMA)).matcher, theirs, 1)
    assert torch.equal(ours[1], torch.from_numpy(theirs[1]))
    assert (ours[1] != -1).any()  # the schema allows only some tokens first (an opening brace, whitespace)
    assert (ours[0] == -1).all() and (ours[2] == 0).all()
    with pytest.raises(ValueError, match="int32"):
        grammar.fill_bitmask(ours.to(torch.int64), 1)
    assert "llguidance.torch" not in sys.modules or "torch._dynamo" in sys.modules  # imported by someone else


def test_params_need_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="exactly one") as info:
        StructuredOutputsParams(regex="a", choice=["a"], param="guided_regex")
    assert info.value.param == "guided_regex"
    with pytest.raises(InvalidRequestError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.kind == "regex"


def test_bad_grammars_are_refused_with_the_field_named(llm):
    backend = llm.llm_engine.input_processor.structured_backend
    for params, text in [(StructuredOutputsParams(regex="a(b", param="guided_regex"), "invalid regex"),
                         (StructuredOutputsParams(json={"type": "objectx"}), "invalid json"),
                         (StructuredOutputsParams(json="{not json"), "not valid JSON"),
                         (StructuredOutputsParams(grammar="start: foo"), "invalid grammar")]:
        with pytest.raises(InvalidRequestError, match=text) as info:
            backend.validate(params)
        assert info.value.param == params.param and "\n" not in info.value.message
    # The engine refuses them too (offline there is no validation before it), the whole call at once.
    for params, text in [(StructuredOutputsParams(regex="a(b"), "invalid regex"),
                         (StructuredOutputsParams(grammar='root ::= "a'), "invalid grammar.*GBNF")]:
        with pytest.raises(InvalidRequestError, match=text):
            llm.generate(["fine", "x"], [SamplingParams(max_tokens=2), SamplingParams(structured_outputs=params)],
                         use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()


def test_json_schema_output_is_valid_and_ends_the_request(llm):
    out = _one(llm, "Describe a record:", temperature=0, max_tokens=64,
               structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)).outputs[0]
    record = json.loads(out.text)
    assert set(record) == {"id", "tag", "ok"} and isinstance(record["id"], int) and 0 <= record["id"] <= 999
    assert record["tag"] in ("red", "green", "blue") and isinstance(record["ok"], bool)
    assert out.finish_reason == "stop" and out.stop_reason is None
    # The grammar ended the request on its closing brace: nothing (not even EOS) follows it.
    assert llm.get_tokenizer().decode(out.token_ids) == out.text and out.text.endswith("}")


def test_regex_and_choice_hold_for_random_samples_and_n(llm):
    pattern = r"[0-9]{3}-[a-z]{2}"
    outs = llm.generate(["a", "bb", "ccc"], SamplingParams(
        temperature=1.0, seed=3, max_tokens=32, structured_outputs=StructuredOutputsParams(regex=pattern)),
        use_tqdm=False)
    for out in outs:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
    choices = ["alpha", "beta", "gamma delta"]
    out = _one(llm, "Pick:", n=6, temperature=1.0, seed=0, max_tokens=16,
               structured_outputs=StructuredOutputsParams(choice=choices))
    texts = [c.text for c in out.outputs]
    assert len(texts) == 6 and all(t in choices for t in texts)


def test_lark_grammar(llm):
    grammar = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/'
    out = _one(llm, "Sum:", temperature=0.7, seed=1, max_tokens=48,
               structured_outputs=StructuredOutputsParams(grammar=grammar)).outputs[0]
    if out.finish_reason == "stop":
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", out.text), out.text
    else:  # cut at max_tokens: still a prefix of the language
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\+?", out.text), out.text


def test_grammar_wins_over_min_tokens(llm):
    # min_tokens blocks EOS, but the grammar allows nothing else once "yes" is complete: the request
    # must end cleanly rather than sample from an all -inf row.
    out = _one(llm, "Answer:", temperature=0, max_tokens=8, min_tokens=4,
               structured_outputs=StructuredOutputsParams(choice=["yes"])).outputs[0]
    assert out.text == "yes" and out.finish_reason == "stop"


@pytest.mark.parametrize("fast_forward", [True, False])
def test_grammar_state_survives_preemption(tiny_llama_dir, fast_forward):
    """Recompute preemption replays a request's tokens as its prompt; its grammar must not be replayed."""
    prompts = [f"Record number {i} of the inventory, written out in full as a JSON object:" for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    options = dict(enable_prefix_caching=False, structured_outputs_fast_forward=fast_forward, numerics="exact")
    roomy = LLM(str(tiny_llama_dir), num_kv_blocks=256, **options).generate(prompts, params, use_tqdm=False)
    # 5 blocks of 16 tokens hold one ~35-token sequence and part of a second.
    tight_llm = LLM(str(tiny_llama_dir), num_kv_blocks=5, max_model_len=80, max_num_batched_tokens=16, **options)
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    assert tight_llm.llm_engine.core.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    for out in tight:
        json.loads(out.outputs[0].text)


def test_unconstrained_rows_in_the_same_batch_are_untouched(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = _one(llm, "Hello there", **vars(plain)).outputs[0].token_ids
    constrained = SamplingParams(temperature=0, max_tokens=12,
                                 structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{1,30}"))
    mixed = llm.generate(["Hello there", "Other"], [plain, constrained], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch(r"[a-z ]{1,30}", mixed[1].outputs[0].text)


def _count_steps(llm: LLM) -> list[int]:
    """Wraps the runner so each model step is counted."""
    runner, calls = llm.llm_engine.core.core.runner, []
    execute = runner.execute

    def counted(output):
        calls.append(len(output.scheduled))
        return execute(output)

    runner.execute = counted
    return calls


def test_fast_forward_skips_forced_text_and_keeps_the_output(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=64,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    results = {}
    for fast_forward in (True, False):
        llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, structured_outputs_fast_forward=fast_forward,
                  numerics="exact")
        steps = _count_steps(llm)
        out = llm.generate(["Describe a record:"], params, use_tqdm=False)[0].outputs[0]
        results[fast_forward] = (out.text, len(out.token_ids), len(steps), out.finish_reason)
    (ff_text, ff_tokens, ff_steps, ff_reason), (text, tokens, steps, reason) = results[True], results[False]
    assert ff_text == text and ff_reason == reason == "stop"
    json.loads(text)
    # Keys, quotes and separators are forced: those tokens cost no model step of their own.
    assert ff_steps < steps and steps == tokens  # without fast-forward: one step per token (prompt + decodes)
    assert ff_tokens == tokens  # forced tokens still count as generated tokens


def test_requests_with_logprobs_are_not_fast_forwarded(llm):
    out = _one(llm, "Describe a record:", temperature=0, max_tokens=64, logprobs=1,
               structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)).outputs[0]
    json.loads(out.text)
    assert len(out.logprobs) == len(out.token_ids) and all(t in lp for t, lp in zip(out.token_ids, out.logprobs))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_drafts_are_checked_against_the_grammar_and_verified_under_its_masks(tiny_llama_dir, temperature):
    """n-gram drafts with a grammar: only drafts the grammar allows are proposed, each position is verified
    under the mask after the drafts before it, and fast-forward combines with them. Greedy output equals
    the one without drafts; sampled output always matches the grammar."""
    # Repetitive by construction: every word after the first repeats earlier text, so n-grams propose.
    regex = "(cat|dog|bird)( (cat|dog|bird)){30}"
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(regex=regex, param="guided_regex"))
    prompts = ["Animals: cat dog bird cat dog bird", "List: dog dog dog dog"]
    outputs, stats = {}, {}
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                        "adaptive": False}):
        llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, numerics="exact", speculative_config=spec)
        outputs[spec is not None] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        stats[spec is not None] = llm.llm_engine.core.core.get_stats()
    for out in outputs[True]:
        assert re.fullmatch(regex, out.text), out.text
        assert out.finish_reason == "stop"
    assert stats[True].spec_num_draft_tokens > 0, stats[True]
    if temperature == 0:
        assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]
        assert stats[True].spec_num_accepted_tokens > 0, stats[True]
    # Sampled, the random tiny model spreads each word over many spellings the grammar allows (" bi" + "rd",
    # " bird", ...), so a draft is kept about one time in ten: the distribution itself is tested in
    # tests/sample/test_spec_sampling.py.


def test_grammar_checks_drafts_and_masks_each_position_without_moving(llm, smollm2_tokenizer):
    from tokenmill.structured.backend import allocate_token_bitmask

    backend = llm.llm_engine.core.core.structured_backend
    vocab = llm.llm_engine.core.core.vocab_size
    grammar = backend.compile(StructuredOutputsParams(regex="ab(c|d)e", param="guided_regex"))
    ids = [smollm2_tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "c", "e", "x")]
    a, b, c, e, x = ids
    # "e" completes the grammar: plain decoding stops after it, so it is never a draft (a verify would
    # sample a token after it).
    assert grammar.valid_prefix([a, b, c, e]) == 3 and grammar.valid_prefix([a, x, c]) == 1
    assert grammar.valid_prefix([x]) == 0 and grammar.valid_prefix([]) == 0
    # With fast-forward, drafts stop before the first one after which the grammar forces text ("e" after "c"
    # here; "f" after "d" below): plain decoding appends the forced tokens there instead of sampling.
    assert grammar.valid_prefix([a, b, c, e], stop_before_forced=True) == 2
    choices = backend.compile(StructuredOutputsParams(regex="(a|x)(b|c)(d|e)f", param="guided_regex"))
    d, f = (smollm2_tokenizer.convert_tokens_to_ids(t) for t in ("d", "f"))
    assert choices.valid_prefix([a, b, d, f], stop_before_forced=True) == 2
    assert choices.valid_prefix([a, b, d, f]) == 3 and choices.valid_prefix([a, b, d, f], True) == 2  # unmoved
    before = allocate_token_bitmask(1, vocab)
    grammar.fill_bitmask(before, 0)
    rows = allocate_token_bitmask(3, vocab)
    grammar.fill_bitmasks_along(rows, 0, [a, b])

    def allowed(bitmask, row, token):
        return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)

    # Row 0: before any draft; row 1: after "a"; row 2: after "ab" (c or d next, not e).
    assert allowed(rows, 0, a) and not allowed(rows, 0, b)
    assert allowed(rows, 1, b) and not allowed(rows, 1, a)
    assert allowed(rows, 2, c) and not allowed(rows, 2, e)
    after = allocate_token_bitmask(1, vocab)
    grammar.fill_bitmask(after, 0)
    assert torch.equal(before, after) and grammar.accept_token(a)  # the state did not move
