"""/v1/completions over HTTP on SmolLM2, driven by the official openai client."""
from __future__ import annotations

import pytest

PROMPT = "The capital of France is"
OTHER_PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model_name(openai_client) -> str:
    return openai_client.models.list().data[0].id


@pytest.fixture(scope="module")
def greedy(openai_client, model_name):
    """The greedy 8-token completion of PROMPT, shared by the tests that derive expectations from it."""
    return openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0)


def _stream_text(chunks) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.mark.slow
def test_greedy_output_matches_hf_transformers(openai_client, model_name, smollm2_hf, smollm2_tokenizer):
    import torch

    prompt_ids = smollm2_tokenizer.encode(PROMPT)
    response = openai_client.completions.create(
        model=model_name, prompt=prompt_ids, max_tokens=16, temperature=0, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True})
    got = [int(token.removeprefix("token_id:")) for token in response.choices[0].logprobs.tokens]

    with torch.no_grad():
        out = smollm2_hf.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False,
                                  pad_token_id=smollm2_tokenizer.eos_token_id)
    expected = out[0, len(prompt_ids):].tolist()
    eos = smollm2_tokenizer.eos_token_id
    if eos in expected:  # both stop at EOS; the engine may or may not report the EOS token itself
        expected = expected[:expected.index(eos)]
        got = got[:got.index(eos)] if eos in got else got
    assert got == expected
    assert response.choices[0].text == smollm2_tokenizer.decode(expected, skip_special_tokens=True)
    assert response.usage.prompt_tokens == len(prompt_ids)


def test_stream_matches_non_stream_with_usage(openai_client, model_name, greedy, smollm2_tokenizer):
    chunks = list(openai_client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert _stream_text(chunks) == greedy.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [greedy.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    usage = greedy.usage
    assert chunks[-1].usage.model_dump() == usage.model_dump()
    assert usage.prompt_tokens == len(smollm2_tokenizer.encode(PROMPT))
    assert usage.completion_tokens == 8 or greedy.choices[0].finish_reason == "stop"
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")


def test_prompt_list_and_n_index_choices_prompt_major(openai_client, model_name, smollm2_tokenizer):
    """Choice i*n+j is sample j of prompt i, streaming or not; the same seed gives the same text."""
    kwargs = dict(model=model_name, prompt=[PROMPT, OTHER_PROMPT], n=2, max_tokens=3, temperature=1.0, seed=1234,
                  extra_body={"ignore_eos": True})
    full = openai_client.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    prompt_tokens = len(smollm2_tokenizer.encode(PROMPT)) + len(smollm2_tokenizer.encode(OTHER_PROMPT))
    assert full.usage.prompt_tokens == prompt_tokens
    assert full.usage.completion_tokens == 4 * 3

    chunks = list(openai_client.completions.create(**kwargs, stream=True))
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert finishes == {i: ["length"] for i in range(4)}
    assert texts == {c.index: c.text for c in full.choices}


def test_best_of_returns_the_n_most_likely_of_its_samples(openai_client, model_name):
    """best_of=4, n=2 generates the four samples n=4 would (same seed) and returns the two with the highest
    cumulative logprob, best first; usage counts all four; no logprobs unless asked for."""
    kwargs = dict(model=model_name, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=99,
                  extra_body={"ignore_eos": True})
    samples = openai_client.completions.create(**kwargs, n=4, logprobs=0).choices
    ranked = sorted(samples, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert len({c.text for c in samples}) > 2  # the ranking has something to choose
    best = openai_client.completions.create(**kwargs, n=2, best_of=4)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == 4 * 4


@pytest.mark.parametrize("extra, message", [({"n": 3, "best_of": 2}, "greater than or equal to n"),
                                            ({"best_of": 3, "stream": True}, "stream"),
                                            ({"prompt": [PROMPT] * 9, "best_of": 128}, "(prompts x best_of)")])
def test_best_of_refusals(http, model_name, extra, message):
    response = http.post("/v1/completions", json={"model": model_name, "prompt": PROMPT, "max_tokens": 2, **extra})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "best_of" and message in error["message"]


def test_token_id_prompts(openai_client, model_name, smollm2_tokenizer):
    first, second = smollm2_tokenizer.encode(PROMPT), smollm2_tokenizer.encode(OTHER_PROMPT)
    response = openai_client.completions.create(model=model_name, prompt=[first, second], max_tokens=1,
                                                temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.prompt_tokens == len(first) + len(second)


def test_stop_strings_end_text_and_never_leak_into_chunks(openai_client, model_name, greedy):
    reference = greedy.choices[0].text
    stop = "." if "." in reference else reference.strip()[-1]
    expected = reference[:reference.index(stop)]
    response = openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0,
                                                stop=[stop])
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert choice.model_extra.get("stop_reason") == stop

    # A stop string of several tokens: no chunk may carry the part that precedes its detection.
    words = reference[len(expected):].split()
    long_stop = " ".join(words[1:3]) if len(words) >= 3 else stop
    expected = reference[:reference.index(long_stop)]
    chunks = list(openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0,
                                                   stop=[long_stop], stream=True))
    assert _stream_text(chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_logprobs_and_echo(openai_client, model_name, smollm2_tokenizer):
    prompt_len = len(smollm2_tokenizer.encode(PROMPT))
    response = openai_client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, temperature=0,
                                                echo=True, logprobs=2)
    choice = response.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == prompt_len + 2
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    # The greedy token is the most likely one.
    last_top = logprobs.top_logprobs[-1]
    assert logprobs.token_logprobs[-1] == pytest.approx(max(last_top.values()), abs=1e-4)
    assert response.usage.prompt_tokens == prompt_len and response.usage.completion_tokens == 2
