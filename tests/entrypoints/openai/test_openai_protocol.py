"""The request models and error mapping on their own (no server, no engine)."""
from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tokenmill.entrypoints.openai.errors import validation_error_response
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.errors import InvalidRequestError

VOCAB = 1000


@pytest.mark.parametrize("prompt, expected", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_shapes(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", [5, None, [True], [1, "a"], [[1], "a"], [[1.5]], {"a": 1}])
def test_bad_prompt_shapes_name_the_prompt(prompt):
    with pytest.raises(ValidationError) as info:
        CompletionRequest(prompt=prompt)
    assert info.value.errors()[0]["loc"] == ("prompt",)


def test_empty_prompt_list():
    with pytest.raises(InvalidRequestError) as info:
        CompletionRequest(prompt=[]).prompts()
    assert info.value.param == "prompt"


def test_sampling_params_mapping():
    request = CompletionRequest(prompt="a", n=3, temperature=0.5, top_k=VOCAB + 10, stop="x", seed=7,
                                logit_bias={"5": -100}, stop_token_ids=[2], ignore_eos=True, min_tokens=1)
    params = request.sampling_params(max_tokens=request.max_tokens, logprobs=None, prompt_logprobs=None,
                                     vocab_size=VOCAB)
    assert (params.n, params.temperature, params.max_tokens, params.seed) == (3, 0.5, 16, 7)
    assert params.top_k is None  # at least the vocabulary means no top-k
    assert params.stop == ["x"] and params.logit_bias == {5: -100.0} and params.stop_token_ids == [2]
    assert params.ignore_eos and params.min_tokens == 1
    defaults = CompletionRequest(prompt="a").sampling_params(max_tokens=16, logprobs=None, prompt_logprobs=None,
                                                            vocab_size=VOCAB)
    assert (defaults.temperature, defaults.top_p, defaults.repetition_penalty) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("field, value", [("logit_bias", {"7000": 1}), ("logit_bias", {"x": 1}),
                                          ("stop_token_ids", [VOCAB])])
def test_token_ids_are_checked_against_the_vocabulary(field, value):
    request = CompletionRequest(prompt="a", **{field: value})
    with pytest.raises(InvalidRequestError) as info:
        request.sampling_params(max_tokens=1, logprobs=None, prompt_logprobs=None, vocab_size=VOCAB)
    assert info.value.param == field


def test_chat_fields():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]}],
                                    max_tokens=5, max_completion_tokens=7, logprobs=True)
    assert request.messages[0].to_template_dict() == {"role": "user", "content": "a\nb"}
    assert request.effective_max_tokens == 7 and request.num_top_logprobs == 0
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).num_top_logprobs is None


def _error_for(errors: list[dict]) -> dict:
    import json

    return json.loads(validation_error_response(RequestValidationError(errors)).body)["error"]


def test_validation_errors_name_the_field_path():
    error = _error_for([{"type": "literal_error", "loc": ("body", "messages", 0, "role"), "msg": "bad role"}])
    assert error["param"] == "messages[0].role" and "bad role" in error["message"]
    # Union members and model names in the location are not fields.
    error = _error_for([{"type": "int_type", "loc": ("body", "TokenizeChatRequest", "messages", 2, "str"),
                         "msg": "nope"}])
    assert error["param"] == "messages[2]"
    error = _error_for([{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error",
                         "ctx": {"error": "Expecting value"}}])
    assert error["param"] is None and error["code"] == "invalid_json"


@pytest.mark.parametrize("cls, required", [(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
                                           (CompletionRequest, {"prompt": "hi"})])
def test_null_fields_take_their_defaults(cls, required):
    """Clients that serialize every field send OpenAI's nullable ones as null ("n": null, "stream": null):
    each reads as its default, never as a 400."""
    defaults = cls(**required)
    for name in cls.model_fields:
        if name not in required:
            assert getattr(cls(**required, **{name: None}), name) == getattr(defaults, name), name
    with pytest.raises(ValidationError):  # a required field stays required
        cls(**{key: None for key in required})
