"""`tokenmill serve --enable-lora --lora-modules NAME=PATH` (with two engine cores, each loading the adapters
its requests use): a request's `model` picks an adapter (its text is HF transformers + PEFT's greedy text),
/v1/models lists the adapters as vLLM does, adapters are loaded and unloaded at run time, and unknown names or
bad adapters get OpenAI-style errors."""
from __future__ import annotations

import httpx

from model_factory import build_peft_adapter, hf_greedy, hf_with_adapter

PROMPT = list(range(300, 340))


def complete(server, model: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def test_adapters_by_model_name_listed_loaded_and_unloaded(start_server, tiny_llama_dir, smollm2_tokenizer,
                                                           tmp_path):
    first = build_peft_adapter(tmp_path / "first", tiny_llama_dir, seed=11)
    second = build_peft_adapter(tmp_path / "second", tiny_llama_dir, seed=12, rank=4, targets=("q_proj", "v_proj"))
    server = start_server(["--model", str(tiny_llama_dir), "--served-model-name", "base", "--numerics", "exact",
                           "--enable-lora", "--max-loras", "2", "--data-parallel-size", "2",
                           "--lora-modules", f"first={first}",
                           '{"name": "second", "path": "%s"}' % second])
    cards = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        ("base", None, cards[0]["root"]), ("first", "base", str(first)), ("second", "base", str(second))]
    assert httpx.get(server.url + "/v1/models/first", timeout=10).json()["parent"] == "base"

    want = smollm2_tokenizer.decode(hf_greedy(hf_with_adapter(tiny_llama_dir, first), PROMPT, 8))
    answer = complete(server, "first")
    assert answer.status_code == 200 and answer.json()["model"] == "first"
    assert answer.json()["choices"][0]["text"] == want
    assert complete(server, "base").json()["choices"][0]["text"] != want
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"model": "second", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == "second"

    stats = server.stats()["lora"]
    assert stats == {"running": {}, "waiting": {}}  # nothing in flight now
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'tokenmill:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
    tokenized = httpx.post(server.url + "/tokenize", json={"model": "second", "prompt": "hi"}, timeout=10)
    assert tokenized.status_code == 200 and tokenized.json()["tokens"]
    missing = complete(server, "third")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    third = build_peft_adapter(tmp_path / "third", tiny_llama_dir, seed=13)
    loaded = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": str(third)},
                        timeout=30)
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    assert complete(server, "third").status_code == 200  # a third adapter: it takes the least recent slot
    again = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": str(third)},
                       timeout=30)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)},
                     timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    unloaded = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "third"}, timeout=30)
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    assert complete(server, "third").status_code == 404
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "third"},
                      timeout=30).status_code == 404
    assert [c["id"] for c in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]] == [
        "base", "first", "second"]
