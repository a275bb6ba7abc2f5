"""Every bad input is a 4xx with an OpenAI error body naming the field; auth; request ids; the other routes."""
from __future__ import annotations

import json

import httpx
import pytest

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def raw(body: dict) -> bytes:
    """JSON with non-ASCII escaped: a lone surrogate travels as the escape "\\ud800"."""
    return json.dumps(body).encode()


# (path, JSON body or raw bytes, status, param)
CASES = {
    "malformed_json": (COMPLETIONS, b'{"prompt": "a",', 400, None),
    "body_not_an_object": (COMPLETIONS, b"[1, 2]", 400, None),
    "empty_body": (COMPLETIONS, b"", 400, None),
    "nan_temperature": (COMPLETIONS, b'{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    "max_tokens_wrong_type": (COMPLETIONS, {"prompt": "a", "max_tokens": "lots"}, 400, "max_tokens"),
    "max_tokens_negative": (COMPLETIONS, {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    "max_tokens_zero": (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    "n_zero": (COMPLETIONS, {"prompt": "a", "n": 0}, 400, "n"),
    "n_too_large": (COMPLETIONS, {"prompt": "a", "n": 100000}, 400, "n"),
    "top_p_above_one": (COMPLETIONS, {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    "temperature_negative": (COMPLETIONS, {"prompt": "a", "temperature": -0.5}, 400, "temperature"),
    "seed_above_int64": (COMPLETIONS, {"prompt": "a", "seed": 2**63}, 400, "seed"),
    "seed_below_int64": (COMPLETIONS, {"prompt": "a", "seed": -(2**63) - 1}, 400, "seed"),
    "too_many_logprobs": (COMPLETIONS, {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    "top_k_negative": (COMPLETIONS, {"prompt": "a", "top_k": -5}, 400, "top_k"),
    "presence_penalty_out_of_range": (COMPLETIONS, {"prompt": "a", "presence_penalty": 3}, 400, "presence_penalty"),
    "min_tokens_above_max_tokens": (COMPLETIONS, {"prompt": "a", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    "missing_prompt": (COMPLETIONS, {"max_tokens": 2}, 400, "prompt"),
    "prompt_wrong_type": (COMPLETIONS, {"prompt": 5}, 400, "prompt"),
    "empty_prompt": (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    "empty_prompt_list": (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    "empty_prompt_in_list": (COMPLETIONS, {"prompt": ["a", ""]}, 400, "prompt"),
    "empty_token_list": (COMPLETIONS, {"prompt": [[]]}, 400, "prompt"),
    "token_id_outside_vocab": (COMPLETIONS, {"prompt": [1, 10**9]}, 400, "prompt"),
    "token_id_negative": (COMPLETIONS, {"prompt": [-1]}, 400, "prompt"),
    "bools_as_token_ids": (COMPLETIONS, {"prompt": [True, False]}, 400, "prompt"),
    "prompt_longer_than_context": (COMPLETIONS, {"prompt": [1] * 1100}, 400, "prompt"),
    "max_tokens_beyond_context": (COMPLETIONS, {"prompt": "a", "max_tokens": 5000}, 400, "max_tokens"),
    "stop_wrong_type": (COMPLETIONS, {"prompt": "a", "stop": 3}, 400, "stop"),
    "stop_token_id_outside_vocab": (COMPLETIONS, {"prompt": "a", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    "logit_bias_bad_key": (COMPLETIONS, {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    "logit_bias_outside_vocab": (COMPLETIONS, {"prompt": "a", "logit_bias": {"999999999": 1}}, 400, "logit_bias"),
    "logit_bias_too_large": (COMPLETIONS, {"prompt": "a", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    "stream_options_without_stream": (COMPLETIONS, {"prompt": "a", "stream_options": {"include_usage": True}}, 400,
                                      "stream_options"),
    "suffix_unsupported": (COMPLETIONS, {"prompt": "a", "suffix": "b"}, 400, "suffix"),
    "unknown_model": (COMPLETIONS, {"prompt": "a", "model": "no-such-model"}, 404, "model"),
    "chat_unknown_model": (CHAT, {"messages": USER, "model": "gpt-4"}, 404, "model"),
    "chat_no_messages": (CHAT, {"messages": []}, 400, "messages"),
    "chat_messages_not_a_list": (CHAT, {"messages": "hi"}, 400, "messages"),
    "chat_bad_role": (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    "chat_image_part": (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
                        "messages[0].content"),
    "chat_top_logprobs_without_logprobs": (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    "chat_too_many_top_logprobs": (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400,
                                   "top_logprobs"),
    "chat_max_completion_tokens_zero": (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400,
                                        "max_completion_tokens"),
    "chat_beyond_context": (CHAT, {"messages": USER, "max_completion_tokens": 5000}, 400, "max_tokens"),
    "tokenize_nothing": ("/tokenize", {"text": "a"}, 400, "prompt"),
    # Text no UTF-8 encoder accepts, and control characters where they cannot appear.
    "prompt_lone_surrogate": (COMPLETIONS, raw({"prompt": "\ud800", "max_tokens": 1}), 400, "prompt"),
    "prompt_list_lone_surrogate": (COMPLETIONS, raw({"prompt": ["a", "b\udc00"], "max_tokens": 1}), 400,
                                   "prompt[1]"),
    "chat_content_lone_surrogate": (CHAT, raw({"messages": [{"role": "user", "content": "x\ud83d"}]}), 400,
                                    "messages[0].content"),
    "chat_content_part_lone_surrogate": (CHAT, raw({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udfff"}]}]}), 400, "messages[0].content[0].text"),
    "stop_lone_surrogate": (COMPLETIONS, raw({"prompt": "a", "stop": ["\ud800"]}), 400, "stop[0]"),
    "stop_nul": (COMPLETIONS, {"prompt": "a", "stop": "a\x00"}, 400, "stop"),
    "model_nul": (COMPLETIONS, {"prompt": "a", "model": "m\x00"}, 400, "model"),
    "user_control_character": (CHAT, {"messages": USER, "user": "bob\n"}, 400, "user"),
    "logit_bias_key_lone_surrogate": (COMPLETIONS, raw({"prompt": "a", "logit_bias": {"\ud800": 1}}), 400,
                                      "logit_bias"),
    "tokenize_lone_surrogate": ("/tokenize", raw({"prompt": "\ud800"}), 400, "prompt"),
    "tokenize_chat_lone_surrogate": ("/tokenize", raw({"messages": [{"role": "user", "content": "\ud800"}]}), 400,
                                     "messages[0].content"),
    # Chat template overrides: empty, unparsable, raising, rendering nothing (this one used to hang).
    "chat_template_empty": (CHAT, {"messages": USER, "chat_template": "", "max_tokens": 1}, 400, "chat_template"),
    "chat_template_blank": (CHAT, {"messages": USER, "chat_template": "  ", "max_tokens": 1}, 400, "chat_template"),
    "chat_template_unparsable": (CHAT, {"messages": USER, "chat_template": "{{ x", "max_tokens": 1}, 400,
                                 "chat_template"),
    "chat_template_raises": (CHAT, {"messages": USER, "chat_template": "{{ raise_exception('no') }}",
                                    "max_tokens": 1}, 400, "chat_template"),
    "chat_template_renders_nothing": (CHAT, {"messages": USER, "chat_template": "{% if false %}x{% endif %}",
                                             "max_tokens": 1}, 400, "chat_template"),
    "tokenize_chat_template_empty": ("/tokenize", {"messages": USER, "chat_template": ""}, 400, "chat_template"),
    "detokenize_outside_vocab": ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
}


def assert_error_body(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["param"] == param
    for leak in ("Traceback", ".py", "/work", "site-packages"):
        assert leak not in response.text
    return error


@pytest.mark.parametrize("case", sorted(CASES))
def test_invalid_requests_get_openai_error_bodies(http, case):
    path, body, status, param = CASES[case]
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert_error_body(response, status, param)


def test_server_survives_bad_input(smollm2_server, http):
    assert httpx.get(smollm2_server.url + "/health").status_code == 200
    assert http.get("/v1/models").status_code == 200


def test_context_length_error_says_so_before_compute(http, smollm2_server):
    error = assert_error_body(http.post(COMPLETIONS, json={"prompt": "a", "max_tokens": 1024}), 400, "max_tokens")
    assert error["code"] == "context_length_exceeded" and "1024" in error["message"]
    assert smollm2_server.stats()["num_requests_running"] == 0


def test_oversize_bodies_get_413(http, smollm2_server):
    big = b'{"prompt": "' + b"a" * (smollm2_server.max_body_bytes + 1000) + b'"}'
    assert_error_body(http.post(COMPLETIONS, content=big, headers={"content-type": "application/json"}), 413)

    def chunked():  # no Content-Length: the limit must hold for streamed bodies too
        for _ in range(12):
            yield b"x" * 100_000

    assert_error_body(http.post(COMPLETIONS, content=chunked(), headers={"content-type": "application/json"}), 413)


def test_a_json_body_without_a_json_content_type_is_told_so(http):
    """`curl -d` sends form-urlencoded and some clients send no Content-Type: the body is valid JSON, so the
    error names the header rather than calling the body malformed. A real non-object body still says that."""
    body = json.dumps({"prompt": "a", "max_tokens": 1}).encode()
    for headers in ({"content-type": "application/x-www-form-urlencoded"}, {}):
        error = assert_error_body(http.post(COMPLETIONS, content=body, headers=headers), 400)
        assert error["code"] == "invalid_content_type" and "Content-Type: application/json" in error["message"]
    error = assert_error_body(http.post(COMPLETIONS, content=b"[1, 2]", headers={"content-type": "application/json"}),
                              400)
    assert error["code"] == "invalid_body"


def test_unknown_routes_and_methods(http):
    assert_error_body(http.get("/v1/nothing-here"), 404)
    assert_error_body(http.get(COMPLETIONS), 405)


def test_api_keys(smollm2_server):
    url = smollm2_server.url
    first_key = smollm2_server.api_keys[0]
    assert_error_body(httpx.get(url + "/v1/models"), 401)
    assert_error_body(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error_body(httpx.get(url + "/v1/models", headers={"Authorization": f"Basic {first_key}"}), 401)
    # Authentication comes before the body is even read.
    assert_error_body(httpx.post(url + COMPLETIONS, content=b"{oops"), 401)
    for key in smollm2_server.api_keys:
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200


def test_request_ids(http):
    response = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "req-abc-1"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "req-abc-1"
    assert response.json()["id"] == "cmpl-req-abc-1"
    generated = http.get("/v1/models").headers["x-request-id"]
    assert len(generated) >= 16
    assert http.post(COMPLETIONS, json={}).headers["x-request-id"]  # errors carry one too


def test_models_tokenize_version_stats(http, smollm2_tokenizer):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1
    card = models["data"][0]
    assert card["object"] == "model" and card["max_model_len"] == 1024
    assert http.get(f"/v1/models/{card['id']}").json()["id"] == card["id"]
    assert_error_body(http.get("/v1/models/not-a-model"), 404, "model")

    text = "Hello world, tokens!"
    tokens = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                          "return_token_strs": True}).json()
    assert tokens["tokens"] == smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["max_model_len"] == 1024
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": text}
    assert_error_body(http.post("/tokenize", json={"prompt": "a", "model": "other"}), 404, "model")

    assert isinstance(http.get("/version").json()["version"], str)
    stats = http.get("/stats").json()
    assert {"num_requests_running", "num_requests_waiting", "kv_cache_usage"} <= set(stats)
    # the shared server runs --numerics exact
    assert stats["numerics"] == {**{name: {"value": "float32", "reason": "--numerics exact"}
                                    for name in ("dtype", "block_matmul", "kv_cache_dtype")},
                                 "weights": {"value": "as stored", "reason": "--numerics exact"}}


def test_openapi_schema_describes_the_api(http):
    schema = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id}", "/tokenize",
                 "/detokenize", "/health", "/version", "/stats"):
        assert path in schema["paths"], path
    components = schema["components"]["schemas"]
    completion = components["CompletionRequest"]["properties"]
    for field in ("prompt", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                  "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty", "logit_bias", "logprobs",
                  "echo", "stream", "stream_options", "priority", "user"):
        assert field in completion, field
    assert completion["n"]["maximum"] == 128
    chat = components["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_completion_tokens", "logprobs", "top_logprobs"} <= set(chat)
    assert "ErrorResponse" in components
    ok = schema["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert "text/event-stream" in ok and "application/json" in ok
