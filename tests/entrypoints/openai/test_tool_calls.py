"""Tool calling without a model: planning tool_choice, extracting calls, and the streamed deltas."""
from __future__ import annotations

import json

import pytest

from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat, _ChoiceState
from tokenmill.entrypoints.openai.tool_calls import extract_tool_calls, plan_tool_calls, streamable_text_len
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import CompletionOutput

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_plans_follow_tool_choice():
    assert plan_tool_calls(None, None, None, None).mode == "none"
    assert plan_tool_calls([WEATHER], None, None, None).mode == "auto"  # OpenAI's default with tools
    assert plan_tool_calls([WEATHER], "none", None, "hermes").mode == "none"
    auto = plan_tool_calls([WEATHER], "auto", None, "hermes")
    assert auto.mode == "auto" and auto.parser == "hermes" and auto.constraint is None
    named = plan_tool_calls([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    assert named.mode == "named" and named.constraint.json == WEATHER["function"]["parameters"]
    required = plan_tool_calls([WEATHER, TIME], "required", False, None)
    schema = required.constraint.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert "maxItems" not in plan_tool_calls([WEATHER], "required", None, None).constraint.json


def _grammar_accepts(tokenizer, schema: dict, text: str) -> bool:
    from tokenmill.sampling_params import StructuredOutputsParams
    from tokenmill.structured.llguidance_backend import LLGuidanceBackend

    backend = LLGuidanceBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammar = backend.compile(StructuredOutputsParams(json=schema))
    return all(grammar.accept_token(token) for token in tokenizer.encode(text))


def test_required_calls_hold_a_name_and_parameters_only(smollm2_tokenizer):
    schema = plan_tool_calls([WEATHER, TIME], "required", None, None).constraint.json
    assert _grammar_accepts(smollm2_tokenizer, schema, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert not _grammar_accepts(smollm2_tokenizer, schema,
                                '[{"name": "get_weather", "parameters": {"city": "Oslo"}, "errorCode": 1}]')
    # The tool's own schema decides what its parameters may hold (this one leaves them open).
    assert _grammar_accepts(smollm2_tokenizer, schema,
                            '[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}]')


@pytest.mark.parametrize("tools,choice,param", [
    (None, "required", "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([WEATHER], 7, "tool_choice"),
    ([{"type": "function"}], "auto", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "auto", "tools"),
    ([WEATHER, WEATHER], "auto", "tools"),
    (["get_weather"], "auto", "tools"),
])
def test_bad_tools_or_choice_name_the_field(tools, choice, param):
    with pytest.raises(InvalidRequestError) as info:
        plan_tool_calls(tools, choice, None, None)
    assert info.value.param == param


def test_extracting_calls():
    named = plan_tool_calls([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    got = extract_tool_calls(named, '{"city": "Oslo"}')
    assert [(c.name, c.arguments) for c in got.calls] == [("get_weather", '{"city": "Oslo"}')] and got.content is None
    required = plan_tool_calls([WEATHER, TIME], "required", None, None)
    got = extract_tool_calls(required, '[{"name": "get_time", "parameters": {}}, '
                                       '{"name": "get_weather", "parameters": {"city": "Zürich"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_time", {}),
                                                                       ("get_weather", {"city": "Zürich"})]
    assert len({c.id for c in got.calls}) == 2
    assert extract_tool_calls(required, '[{"name": "get_time", "param') is None  # cut short: stays text
    hermes = plan_tool_calls([WEATHER], "auto", None, "hermes")
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    got = extract_tool_calls(hermes, text)
    assert got.content == "Let me look." and got.content_end == text.index("<tool_call>")
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", {"city": "Rome"})]
    assert extract_tool_calls(hermes, "no calls here") is None
    assert extract_tool_calls(hermes, "<tool_call>{not json}</tool_call>") is None
    assert extract_tool_calls(plan_tool_calls([WEATHER], "auto", None, None), text) is None  # no parser: text


def test_hermes_holds_back_a_possible_tag_while_streaming():
    hermes = plan_tool_calls([WEATHER], "auto", None, "hermes")
    assert streamable_text_len(hermes, "Hello <tool") == len("Hello ")
    assert streamable_text_len(hermes, "Hello <b>") == len("Hello <b>")
    assert streamable_text_len(hermes, "Hi <tool_call>{") == len("Hi ")
    assert streamable_text_len(plan_tool_calls([WEATHER], "required", None, None), "[{") == 0


def _stream(plan, texts: list[str], finish: str = "stop") -> list:
    serving = OpenAIServingChat(engine=None, model_name="m")
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)
    state, choices = _ChoiceState(), []
    sent = ""
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        # Streams carry deltas: the text and token ids new since the previous output.
        comp = CompletionOutput(index=0, text=text[len(sent):], token_ids=[i], finish_reason=finish if last else None)
        sent = text
        choice = serving._delta(body, state, comp, "", plan)
        if choice is not None:
            choices.append(choice)
    return choices


def test_streamed_named_call_sends_id_and_name_once_then_arguments():
    plan = plan_tool_calls([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    choices = _stream(plan, ['{"ci', '{"city": "Os', '{"city": "Oslo"}'])
    calls = [c.delta.tool_calls[0] for c in choices if c.delta.tool_calls]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].type == "function"
    assert all(c.id is None and c.function.name is None for c in calls[1:])
    assert "".join(c.function.arguments for c in calls) == '{"city": "Oslo"}'
    assert all(c.delta.content is None for c in choices)
    assert choices[-1].finish_reason == "stop"


def test_streamed_hermes_reply_streams_text_then_the_calls():
    plan = plan_tool_calls([WEATHER], "auto", None, "hermes")
    texts = ["Sure", "Sure. <tool", 'Sure. <tool_call>{"name": "get_weather", ',
             'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>']
    choices = _stream(plan, texts)
    assert "".join(c.delta.content or "" for c in choices) == "Sure. "
    calls = [call for c in choices for call in (c.delta.tool_calls or [])]
    assert [(c.name, json.loads(c.arguments)) for c in (call.function for call in calls)] == \
        [("get_weather", {"city": "Rome"})]
    assert choices[-1].finish_reason == "tool_calls"
    # A reply without calls streams all of its text, the held-back tail included, and finishes as it did.
    choices = _stream(plan, ["a <to", "a <tone>"])
    assert "".join(c.delta.content or "" for c in choices) == "a <tone>" and choices[-1].finish_reason == "stop"


def test_streamed_required_calls_arrive_with_the_finish():
    plan = plan_tool_calls([WEATHER], "required", None, None)
    choices = _stream(plan, ['[{"name"', '[{"name": "get_weather", "parameters": {"city": "Lima"}}]'])
    assert len(choices) == 1 and choices[0].finish_reason == "tool_calls"
    assert json.loads(choices[0].delta.tool_calls[0].function.arguments) == {"city": "Lima"}
    # Cut short by max_tokens: the partial JSON comes back as text with finish_reason "length".
    choices = _stream(plan, ['[{"name"'], finish="length")
    assert choices[-1].delta.content == '[{"name"' and choices[-1].finish_reason == "length"
