"""Tool calling over HTTP on SmolLM2 with the official openai client: a named function and "required"
force valid calls through structured outputs; bad tools are 400s naming the field."""
from __future__ import annotations

import json
import re

import httpx
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 24},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "maxLength": 24}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_name(openai_client) -> str:
    return openai_client.models.list().data[0].id


def _check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")


def test_named_function_gives_one_valid_call(openai_client, model_name):
    response = openai_client.chat.completions.create(
        model=model_name, messages=ASK, tools=[WEATHER, TIME], max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    _check_weather(call.function.arguments)


def test_named_function_streams_its_arguments(openai_client, model_name):
    chunks = list(openai_client.chat.completions.create(
        model=model_name, messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in (d.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather"
    assert all(call.index == 0 and call.function.name is None for call in calls[1:])
    _check_weather("".join(call.function.arguments or "" for call in calls))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_required_gives_calls_of_the_given_tools(openai_client, model_name, stream):
    kwargs = dict(model=model_name, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120,
                  temperature=0, parallel_tool_calls=False)
    if stream:
        calls, reasons = [], []
        for chunk in openai_client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices:
                calls.extend(chunk.choices[0].delta.tool_calls or [])
                reasons.append(chunk.choices[0].finish_reason)
        finish = reasons[-1]
    else:
        choice = openai_client.chat.completions.create(**kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
    # OpenAI's finish reason for required calls (a named function's stays "stop").
    assert finish == "tool_calls" and len(calls) == 1  # parallel_tool_calls=False: one call
    call = calls[0]
    assert call.function.name in ("get_weather", "get_time") and call.id
    if call.function.name == "get_weather":
        _check_weather(call.function.arguments)
    else:
        assert set(json.loads(call.function.arguments)) == {"zone"}


def test_auto_without_a_parser_replies_in_text(openai_client, model_name):
    response = openai_client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER], max_tokens=8,
                                                     temperature=0)
    message = response.choices[0].message
    assert message.tool_calls is None and message.content


BAD = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "maybe"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra,param", BAD)
def test_bad_tools_are_400s_naming_the_field(smollm2_server, model_name, extra, param, stream):
    body = {"model": model_name, "messages": ASK, "max_tokens": 8, "stream": stream, **extra}
    response = httpx.post(f"{smollm2_server.url}/v1/chat/completions", json=body, headers=smollm2_server.headers,
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_auto_with_the_hermes_parser_turns_tagged_calls_into_tool_calls(start_server, tiny_llama_dir):
    """The model's reply is pinned to a hermes-format call with a regex, so the parser's path through
    the server is what is tested (a random tiny model never writes one by itself)."""
    server = start_server(["--model", str(tiny_llama_dir), "--max-model-len", "512", "--num-kv-blocks", "64",
                           "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    reply = 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}</tool_call>'
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 60, "temperature": 0,
            "structured_outputs": {"regex": re.sub(r"([.{}])", r"\\\1", reply)}}
    url = f"{server.url}/v1/chat/completions"
    choice = httpx.post(url, json=body, timeout=120).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("chatcmpl-tool-")
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "unit": "celsius"}

    streamed, calls, reasons = "", [], []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += c["delta"].get("content") or ""
                    calls += c["delta"].get("tool_calls") or []
                    reasons.append(c.get("finish_reason"))
    assert streamed == "Checking. " and reasons[-1] == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo", "unit": "celsius"}]


def test_a_tool_result_turn_is_served(openai_client, model_name):
    """An agent's next request carries the assistant's call (content null) and the tool's answer."""
    first = openai_client.chat.completions.create(
        model=model_name, messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message
    call = first.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    reply = openai_client.chat.completions.create(model=model_name, messages=messages, tools=[WEATHER],
                                                  tool_choice="none", max_tokens=12, temperature=0)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None


def test_replies_without_calls_carry_no_tool_calls_key(http):
    body = {"messages": ASK, "max_tokens": 2, "temperature": 0}
    message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert set(message) == {"role", "content"}
