"""Several models behind one server: each answers by its name and aliases with its own weights (HF's greedy
text), adapters of one model route to it, /v1/models and /metrics cover every model; models load and unload at
run time through the admin routes (an unload drains: a stream in flight finishes, new requests get 503 with
Retry-After, then 404); under a memory budget the least recently used idle model makes room, and a request for
a known model that is not loaded waits while it loads (--load-on-demand)."""
from __future__ import annotations

import json
import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from model_factory import build_peft_adapter, build_tiny_llama, hf_greedy, hf_with_adapter
from tokenmill.child_process import may_raise_priority

PROMPT = list(range(300, 340))
ADMIN = {"Authorization": "Bearer tm-admin"}


def hf_model(directory):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def complete(server, model, max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    if model is not None:
        body["model"] = model
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def text_of(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def write_models(path, entries) -> str:
    path.write_text(json.dumps({"models": entries}))
    return str(path)


def test_two_models_answer_by_name_and_load_and_unload_at_run_time(start_server, tiny_llama_dir, smollm2_tokenizer,
                                                                  tmp_path):
    other_dir = build_tiny_llama(tmp_path / "other", smollm2_tokenizer, seed=7)
    adapter = build_peft_adapter(tmp_path / "adapter", other_dir, seed=5)
    models = write_models(tmp_path / "models.json", [
        {"model": str(tiny_llama_dir), "served_model_name": ["alpha", "a"]},
        {"model": str(other_dir), "served_model_name": "beta", "enable_lora": True,
         "lora_modules": [f"beta-tuned={adapter}"]},
        {"model": str(tiny_llama_dir), "served_model_name": "gamma", "load": False},
    ])
    server = start_server(["--models-config", models, "--numerics", "exact", "--kv-cache-memory-bytes", "64MiB",
                           "--admin-key", "tm-admin", "--shutdown-timeout", "60"])

    cards = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("alpha", None), ("a", None), ("beta", None),
                                                        ("beta-tuned", "beta")]
    # Each name reaches its own weights: HF transformers' greedy text of that model (or model + adapter).
    alpha_text = smollm2_tokenizer.decode(hf_greedy(hf_model(tiny_llama_dir), PROMPT, 8))
    beta_text = smollm2_tokenizer.decode(hf_greedy(hf_model(other_dir), PROMPT, 8))
    tuned_text = smollm2_tokenizer.decode(hf_greedy(hf_with_adapter(other_dir, adapter), PROMPT, 8))
    assert len({alpha_text, beta_text, tuned_text}) == 3
    for model, want in (("alpha", alpha_text), ("a", alpha_text), (None, alpha_text), ("beta", beta_text),
                        ("beta-tuned", tuned_text)):
        answer = complete(server, model)
        assert text_of(answer) == want, model
        assert answer.json()["model"] == {None: "alpha", "a": "alpha"}.get(model, model)
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["model"] == "beta"
    assert httpx.post(server.url + "/tokenize", json={"model": "beta", "prompt": "hi"}, timeout=10).status_code == 200
    unknown = complete(server, "delta")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    not_loaded = complete(server, "gamma")
    assert not_loaded.status_code == 404 and not_loaded.json()["error"]["code"] == "model_not_loaded"

    # One exposition, each series labelled with its model; /stats per model, listing every model.
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    finished = {(s.labels["model_name"], s.labels["finished_reason"]): s.value
                for s in families["tokenmill:request_success"].samples if s.name.endswith("_total")}
    assert finished[("alpha", "length")] == 3 and finished[("beta", "length")] == 3
    stats = httpx.get(server.url + "/stats", params={"model": "beta"}).json()
    assert stats["model"] == "beta" and stats["num_finished_requests"] == 3
    assert [(m["name"], m["state"]) for m in stats["models"]] == [("alpha", "loaded"), ("beta", "loaded"),
                                                                  ("gamma", "unloaded")]

    # The admin routes need the admin key (the API routes stay open: no --api-key here).
    assert httpx.get(server.url + "/admin/models").status_code == 401
    assert httpx.post(server.url + "/admin/models/load", json={"model": "gamma"},
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    loaded = httpx.post(server.url + "/admin/models/load", json={"model": "gamma"}, headers=ADMIN, timeout=120)
    assert loaded.status_code == 200 and loaded.json()["memory_bytes"] > 0
    if may_raise_priority(10):  # a load beside serving models runs at the lowest priority, then serves at 10
        log = server.log_text()
        assert "loading at the lowest CPU priority" in log and "loaded; engine core niceness back to 10" in log
    assert text_of(complete(server, "gamma")) == alpha_text
    added = httpx.post(server.url + "/admin/models/load", headers=ADMIN, timeout=120,
                       json={"model": str(other_dir), "served_model_name": "delta", "max_num_seqs": 4})
    assert added.status_code == 200, added.text
    assert text_of(complete(server, "delta")) == beta_text
    for body, param in (({"model": str(tmp_path / "missing")}, "model"),
                        ({"model": "/x", "max_num_sqs": 4}, "max_num_sqs"),
                        ({"model": str(other_dir), "served_model_name": "a"}, "served_model_name")):
        refused = httpx.post(server.url + "/admin/models/load", json=body, headers=ADMIN, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text

    # Unloading alpha while a stream runs on it: the stream finishes whole, new requests get 503 with
    # Retry-After while it drains, 404 afterwards; beta serves throughout.
    streamed: list[str] = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"model": "alpha", "prompt": PROMPT, "max_tokens": 960, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}) as stream:
        lines = stream.iter_lines()
        streamed.append(next(line for line in lines if line.startswith("data:")))
        unloaded: list[httpx.Response] = []
        unloading = threading.Thread(target=lambda: unloaded.append(httpx.post(
            server.url + "/admin/models/unload", json={"model": "a"}, headers=ADMIN, timeout=120)))
        unloading.start()
        draining = None
        for _ in range(200):
            draining = complete(server, "alpha", max_tokens=1)
            if draining.status_code != 200:
                break
        assert draining.status_code == 503 and draining.headers["retry-after"] == "5"
        assert draining.json()["error"]["code"] == "model_unloading"
        assert text_of(complete(server, "beta")) == beta_text
        streamed += [line for line in lines if line.startswith("data:")]
    unloading.join()
    assert unloaded[0].status_code == 200 and unloaded[0].json()["unloaded"] is True
    assert streamed[-1] == "data: [DONE]"
    assert json.loads(streamed[-2][5:])["usage"]["completion_tokens"] == 960
    gone = complete(server, "alpha")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert [c["id"] for c in httpx.get(server.url + "/v1/models").json()["data"]] == [
        "beta", "beta-tuned", "gamma", "delta"]
    assert text_of(complete(server, None)) == beta_text  # the first model left answers requests without a model
    listing = httpx.get(server.url + "/admin/models", headers=ADMIN).json()
    assert [(m["name"], m["state"]) for m in listing["models"]] == [("beta", "loaded"), ("gamma", "loaded"),
                                                                    ("delta", "loaded")]
    assert listing["memory"]["loads"] == 4 and listing["memory"]["unloads"] == 1
    assert httpx.get(server.url + "/health").status_code == 200


def test_memory_budget_unloads_the_least_recently_used_idle_model_and_loads_on_demand(start_server, tiny_llama_dir,
                                                                                     smollm2_tokenizer, tmp_path):
    other_dir = build_tiny_llama(tmp_path / "other", smollm2_tokenizer, seed=7)
    models = write_models(tmp_path / "models.yaml", [
        {"model": str(tiny_llama_dir), "served_model_name": "alpha"},
        {"model": str(other_dir), "served_model_name": "beta", "load": False},
    ])
    # One engine core of a tiny model holds ~450 MiB (mostly the runtime), so two do not fit in 800 MiB.
    server = start_server(["--models-config", models, "--numerics", "exact", "--kv-cache-memory-bytes", "32MiB",
                           "--admin-key", "tm-admin", "--models-memory-budget", "800MiB", "--load-on-demand"])
    alpha_text = text_of(complete(server, "alpha"))
    beta_text = smollm2_tokenizer.decode(hf_greedy(hf_model(other_dir), PROMPT, 8))

    assert text_of(complete(server, "beta")) == beta_text  # waits while beta loads, alpha unloaded to make room
    listing = httpx.get(server.url + "/admin/models", headers=ADMIN).json()
    assert [(m["name"], m["state"]) for m in listing["models"]] == [("alpha", "unloaded"), ("beta", "loaded")]
    assert listing["memory"]["used_bytes"] <= listing["memory"]["budget_bytes"]

    # Requests for alpha arriving together wait for one load; beta makes room.
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(complete(server, "alpha"))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [text_of(answer) for answer in answers] == [alpha_text] * 3
    listing = httpx.get(server.url + "/admin/models", headers=ADMIN).json()
    assert [(m["name"], m["state"]) for m in listing["models"]] == [("alpha", "loaded"), ("beta", "unloaded")]
    assert listing["memory"]["loads"] == 3 and listing["memory"]["unloads"] == 2
    assert listing["models"][0]["memory_bytes"] <= listing["memory"]["budget_bytes"]

    # An admin unload that keeps the model known: the next request for it loads it again.
    kept = httpx.post(server.url + "/admin/models/unload", json={"model": "alpha", "forget": False}, headers=ADMIN,
                      timeout=60)
    assert kept.status_code == 200
    assert text_of(complete(server, "alpha")) == alpha_text

    # A model that alone exceeds the budget is refused, naming it.
    too_big = httpx.post(server.url + "/admin/models/load", headers=ADMIN, timeout=60,
                         json={"model": str(other_dir), "served_model_name": "huge", "kv_cache_memory_bytes": "2GiB"})
    assert too_big.status_code == 400 and "more than --models-memory-budget" in too_big.json()["error"]["message"]
    assert complete(server, "huge").status_code == 404
