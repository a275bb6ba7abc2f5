"""Structured outputs over HTTP on SmolLM2: OpenAI's response_format and vLLM's structured_outputs /
guided_* extras, driven by the official openai client."""
from __future__ import annotations

import json
import re

import pytest

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_name(openai_client) -> str:
    return openai_client.models.list().data[0].id


def test_response_format_json_schema(openai_client, model_name):
    response = openai_client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=120,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    person = json.loads(choice.message.content)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and len(person["name"]) <= 20
    assert isinstance(person["age"], int) and person["age"] >= 0


def test_response_format_json_object_streams(openai_client, model_name):
    prompt = 'Reply with a JSON object with one key, "answer", whose value is the capital of France.'
    chunks = openai_client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": prompt}], max_tokens=120, temperature=0,
        stream=True, response_format={"type": "json_object"})
    text, reasons = "", []
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "stop", text
    assert "answer" in json.loads(text)


def test_vllm_extras_choice_regex_and_n(openai_client, model_name):
    response = openai_client.completions.create(
        model=model_name, prompt="Is water wet? Answer:", max_tokens=8, n=3, temperature=1.0, seed=5,
        extra_body={"guided_choice": [" yes", " no"]})
    assert sorted({c.index for c in response.choices}) == [0, 1, 2]
    assert all(c.text in (" yes", " no") and c.finish_reason == "stop" for c in response.choices)
    response = openai_client.completions.create(
        model=model_name, prompt="The first moon landing was on", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": r" [0-9]{4}-[0-9]{2}-[0-9]{2}"}})
    assert re.fullmatch(r" [0-9]{4}-[0-9]{2}-[0-9]{2}", response.choices[0].text)


BAD_CONSTRAINTS = [
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {}}, "structured_outputs"),
]
BEAM_WITH_CONSTRAINT = ({"use_beam_search": True, "n": 2, "guided_choice": ["a", "b"]}, "use_beam_search")
CASES = [(*case, stream) for case in BAD_CONSTRAINTS for stream in (False, True)] + [(*BEAM_WITH_CONSTRAINT, False)]


@pytest.mark.parametrize("extra, param, stream", CASES)
def test_bad_constraints_are_400_before_any_stream(http, model_name, extra, param, stream):
    response = http.post("/v1/completions", json={"model": model_name, "prompt": "x", "max_tokens": 4,
                                                  "stream": stream, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert "Traceback" not in error["message"] and "\n" not in error["message"]
