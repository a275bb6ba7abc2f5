"""Fuzzing the HTTP API: whatever the body, the server answers (never 5xx) within seconds and stays healthy.

Hypothesis builds bodies for /v1/completions, /v1/chat/completions, /tokenize and /detokenize from
each route's fields, mixing valid values with wrong types, nested nulls, huge numbers, invalid Unicode
(lone surrogates, sent escaped) and long strings; max_tokens stays small so answers come fast. A short
run is part of the normal suite; `pytest -m fuzz` runs the long one.
"""
from __future__ import annotations

import json
import urllib.parse

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ANSWER_WITHIN_S = 20.0  # generous: the CPU may be shared; a hang takes far longer
ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]

weird_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "\n\t", "{{ x", "\u202e", "😀", "a" * 5000]),
)
weird_number = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, 1e308, -1e308, 1e-308, 0.5, -0.0]),
    st.floats(allow_nan=False, allow_infinity=False),
)
junk = st.recursive(
    st.one_of(st.none(), st.booleans(), weird_number, weird_text),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(weird_text, inner, max_size=4)),
    max_leaves=12,
)
small_tokens = st.lists(st.integers(min_value=-5, max_value=60000), max_size=8)
max_tokens = st.one_of(st.integers(min_value=1, max_value=4), junk)
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), junk),
     "content": st.one_of(weird_text, st.none(), st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                   "text": weird_text}), max_size=2),
                          junk)})
sampling = {
    "temperature": st.one_of(st.floats(0, 2), junk), "top_p": st.one_of(st.floats(0.01, 1), junk),
    "top_k": st.one_of(st.integers(-2, 100), junk), "n": st.one_of(st.integers(1, 2), junk),
    "seed": weird_number, "stop": st.one_of(weird_text, st.lists(weird_text, max_size=3), junk),
    "logit_bias": st.one_of(st.dictionaries(st.integers(-1, 60000).map(str), weird_number, max_size=3), junk),
    "presence_penalty": weird_number, "logprobs": junk, "user": st.one_of(weird_text, junk),
    "stream": st.booleans(), "model": st.one_of(st.none(), weird_text), "min_tokens": junk,
    "stop_token_ids": st.one_of(small_tokens, junk), "priority": weird_number, "echo": junk,
}
bodies = {
    "/v1/completions": st.fixed_dictionaries(
        {"prompt": st.one_of(weird_text, small_tokens, st.lists(weird_text, max_size=3), junk),
         "max_tokens": max_tokens}, optional=sampling),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": st.one_of(st.lists(message, min_size=1, max_size=3), junk), "max_tokens": max_tokens},
        optional={**sampling, "chat_template": st.one_of(weird_text, junk), "chat_template_kwargs": junk,
                  "tools": junk, "tool_choice": junk, "response_format": junk, "top_logprobs": junk}),
    "/tokenize": st.one_of(st.fixed_dictionaries({"prompt": st.one_of(weird_text, junk)},
                                                 optional={"add_special_tokens": junk, "model": junk}),
                           st.fixed_dictionaries({"messages": st.one_of(st.lists(message, max_size=2), junk)},
                                                 optional={"chat_template": junk})),
    "/detokenize": st.fixed_dictionaries({"tokens": st.one_of(small_tokens, junk)}, optional={"model": junk}),
}
request = st.one_of(*[st.tuples(st.just(route), st.one_of(bodies[route], junk)) for route in ROUTES])


def send(client: httpx.Client, route: str, body) -> httpx.Response:
    # Non-ASCII escaped, so lone surrogates travel as JSON escapes as a client would send them.
    payload = json.dumps(body).encode()
    return client.post(route, content=payload, headers={"content-type": "application/json"},
                       timeout=ANSWER_WITHIN_S)


def check(client: httpx.Client, route: str, body) -> None:
    response = send(client, route, body)  # a timeout raises: a request that hangs fails the test
    assert response.status_code < 500, (route, body, response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"]


def run_fuzz(server, examples: int) -> None:
    with httpx.Client(base_url=server.url, headers=server.headers) as client:
        @settings(max_examples=examples, deadline=None, derandomize=examples <= 100,
                  suppress_health_check=list(HealthCheck))
        @given(request)
        def fuzz(case) -> None:
            check(client, *case)

        fuzz()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


HAND_WRITTEN = [
    ("/v1/completions", {"prompt": "\ud800", "max_tokens": 1}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 1e308}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2**70}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 1, "seed": 2**70, "temperature": 1e308}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 1, "logit_bias": {"1": 1e308}}),
    ("/v1/completions", {"prompt": [[None]], "max_tokens": 1}),
    ("/v1/completions", {"prompt": None, "max_tokens": None, "stop": [None]}),
    ("/v1/completions", {"prompt": {"prompt": {"prompt": None}}}),
    ("/v1/completions", {"prompt": "x" * 200_000, "max_tokens": 1}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 1, "stop": "s" * 100_000}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 1, "user": "u" * 100_000, "model": None}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc00"}], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [None], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template": "",
                              "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                              "chat_template_kwargs": {"\ud800": None}, "tools": [None]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                              "response_format": {"type": "json_schema", "json_schema": None}}),
    ("/tokenize", {"prompt": "\ud800"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{% for %}"}),
    ("/detokenize", {"tokens": [2**70]}),
    ("/detokenize", {"tokens": [None, "a", 1e308]}),
]


@pytest.mark.parametrize("route, body", HAND_WRITTEN)
def test_hand_written_bad_input_is_never_a_server_error(smollm2_server, http, route, body):
    check(http, route, body)


def test_fuzz_short(smollm2_server):
    run_fuzz(smollm2_server, examples=60)


@pytest.mark.fuzz
def test_fuzz_long(smollm2_server):
    run_fuzz(smollm2_server, examples=2000)


# ---- every route of the server's own /openapi.json ----------------------------------------------
def schema_strategy(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Values for a JSON-schema node of the spec: of its type (weird ones) or junk of any type."""
    if "$ref" in schema:
        schema = components.get(schema["$ref"].rsplit("/", 1)[-1], {})
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        return st.one_of(*[schema_strategy(o, components, depth) for o in options[:6]], junk)
    kind = schema.get("type")
    if "enum" in schema or "const" in schema:
        return st.one_of(st.sampled_from(schema.get("enum") or [schema.get("const")]), junk)
    if kind == "string":
        return weird_text
    if kind in ("integer", "number"):
        return weird_number
    if kind == "boolean":
        return st.one_of(st.booleans(), junk)
    if kind == "array" and depth < 3:
        return st.one_of(st.lists(schema_strategy(schema.get("items", {}), components, depth + 1), max_size=3), junk)
    if kind == "object" and depth < 3 and "properties" in schema:
        return object_strategy(schema, components, depth + 1)
    return junk


def object_strategy(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Objects with the schema's required fields and any of its optional ones, each value weird."""
    properties = schema.get("properties", {})
    required = set(schema.get("required", []))
    return st.fixed_dictionaries(
        {name: schema_strategy(sub, components, depth) for name, sub in properties.items() if name in required},
        optional={name: schema_strategy(sub, components, depth) for name, sub in properties.items()
                  if name not in required})


def openapi_cases(spec: dict) -> st.SearchStrategy:
    """(method, path, path parameters, body) over every route the server documents in /openapi.json:
    bodies shaped by each route's request schema (field names and types from the spec, values weird),
    or junk; path parameters filled with weird text."""
    components = spec.get("components", {}).get("schemas", {})
    cases = []
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            params = [p["name"] for p in operation.get("parameters", []) if p.get("in") == "path"]
            path_values = st.fixed_dictionaries({name: st.one_of(weird_text, st.just("../x")) for name in params})
            schema = (operation.get("requestBody", {}).get("content", {}).get("application/json", {})
                      .get("schema"))
            body = st.none()
            if schema is not None:
                body = st.one_of(schema_strategy(schema, components).map(_small_generation), junk)
            cases.append(st.tuples(st.just(method.upper()), st.just(path), path_values, body))
    return st.one_of(*cases)


def _small_generation(body):
    """Bodies may ask for thousands of tokens (leaving max_tokens out means the rest of the context):
    cap what a fuzz case can make the engine do, so a slow answer is never mistaken for a hang."""
    if isinstance(body, dict):
        if "max_tokens" not in body and ("messages" in body or "prompt" in body):
            body["max_tokens"] = 4
        for field in ("max_tokens", "max_completion_tokens"):
            value = body.get(field)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 4:
                body[field] = 4
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
            body["n"] = 2
    return body


def check_route(client: httpx.Client, method: str, path: str, path_values: dict, body) -> None:
    url = path
    for name, value in path_values.items():
        quoted = urllib.parse.quote(value.encode("utf-8", "surrogatepass"), safe="")
        url = url.replace("{" + name + "}", quoted or "x")
    if method == "GET":
        response = client.get(url, timeout=ANSWER_WITHIN_S)
    else:
        response = client.request(method, url, content=json.dumps(body).encode(),
                                  headers={"content-type": "application/json"}, timeout=ANSWER_WITHIN_S)
    assert response.status_code < 500, (method, url, str(body)[:300], response.status_code, response.text[:300])


def run_openapi_fuzz(server, examples: int) -> None:
    with httpx.Client(base_url=server.url, headers=server.headers) as client:
        spec = client.get("/openapi.json").json()
        assert {"/v1/completions", "/v1/chat/completions", "/v1/models/{model_id}"} <= set(spec["paths"])

        @settings(max_examples=examples, deadline=None, derandomize=examples <= 100,
                  suppress_health_check=list(HealthCheck))
        @given(openapi_cases(spec))
        def fuzz(case) -> None:
            check_route(client, *case)

        fuzz()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_fuzz_every_openapi_route_short(smollm2_server):
    run_openapi_fuzz(smollm2_server, examples=60)


@pytest.mark.fuzz
def test_fuzz_every_openapi_route_long(smollm2_server):
    run_openapi_fuzz(smollm2_server, examples=2000)
