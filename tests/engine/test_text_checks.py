"""The shared text check: lone surrogates anywhere, control characters in identifiers, NUL in stop strings."""
from __future__ import annotations

import pytest

from tokenmill.engine.input_processor import InputProcessor, check_chat_template
from tokenmill.engine.text_checks import check_text, find_bad_text
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams


def test_free_text_keeps_ordinary_control_characters():
    assert find_bad_text({"prompt": "a\nb\tc\r", "messages": [{"role": "user", "content": "x\x00y"}]}) is None


@pytest.mark.parametrize("body, param", [
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": ["ok", "\udc00"]}, "prompt[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages[0].content[0].text"),
    ({"logit_bias": {"\ud800": 1}}, "logit_bias"),
    ({"model": "a\x00"}, "model"),
    ({"user": "a\x1b[31m"}, "user"),
    ({"stop": ["fine", "a\x00"]}, "stop[1]"),
])
def test_bad_text_is_found_with_its_path(body, param):
    found = find_bad_text(body)
    assert found is not None and found[0] == param


def test_check_text_raises_naming_the_field():
    with pytest.raises(InvalidRequestError) as info:
        check_text("x\ud800", "prompt")
    assert info.value.param == "prompt" and info.value.http_status == 400


@pytest.mark.parametrize("template", ["", "   ", "{{ x", "{% for %}"])
def test_bad_chat_templates_are_refused(template):
    with pytest.raises(InvalidRequestError) as info:
        check_chat_template(template)
    assert info.value.param == "chat_template"


def test_zero_token_prompts_are_refused_at_validation():
    processor = InputProcessor(tokenizer=None, max_model_len=64, vocab_size=100)
    with pytest.raises(InvalidRequestError) as info:
        processor.validate([], SamplingParams(max_tokens=4))
    assert info.value.code == "empty_prompt"
