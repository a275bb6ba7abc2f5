"""/v1/chat/completions over HTTP on SmolLM2 (its chat template), driven by the official openai client."""
from __future__ import annotations

import json

import pytest

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_name(openai_client) -> str:
    return openai_client.models.list().data[0].id


def test_chat_stream_matches_non_stream(openai_client, model_name, http):
    full = openai_client.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=6,
                                                 temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    # The prompt is the chat template's rendering, the same one /tokenize counts.
    counted = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert full.usage.prompt_tokens == counted
    assert full.usage.completion_tokens <= 6

    # max_tokens (OpenAI's older name) works the same way.
    chunks = list(openai_client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == []
    streamed = chunks[-1].usage
    assert (streamed.prompt_tokens, streamed.completion_tokens, streamed.total_tokens) == (
        full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens)
    # The same prompt again: its full blocks come from the prefix cache, and usage says how many.
    assert streamed.prompt_tokens_details.cached_tokens == (counted - 1) // 16 * 16 > 0
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_chat_n_and_logprobs(openai_client, model_name):
    kwargs = dict(model=model_name, messages=MESSAGES, n=2, max_completion_tokens=3, temperature=1.0, seed=99,
                  logprobs=True, top_logprobs=2)
    full = openai_client.chat.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1]
    total = 0
    for choice in full.choices:
        content = choice.logprobs.content
        assert len(content) >= 1
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            assert entry.bytes == list(entry.token.encode("utf-8"))
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        total += len(content)
    assert full.usage.completion_tokens == total

    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role]
    finishes = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(roles) == [0, 1] and sorted(finishes) == [0, 1]
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in (0, 1)}
    # The same seed gives the same samples whether streamed or not.
    assert texts == {c.index: c.message.content for c in full.choices}


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "The capital of France is"}),
])
def test_stream_chunks_carry_a_null_finish_reason_until_the_end(http, model_name, path, body):
    # As OpenAI's and vLLM's chunks do: clients test `finish_reason !== null` on the raw JSON.
    choices = []
    with http.stream("POST", path, json={"model": model_name, "max_tokens": 4, "temperature": 0, "stream": True,
                                         **body}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices.extend(json.loads(line[len("data: "):])["choices"])
    assert choices and all("finish_reason" in c and "logprobs" in c for c in choices)
    assert [c["finish_reason"] for c in choices][-1] == "length"
    assert all(c["finish_reason"] is None for c in choices[:-1])
