"""The server's API process stays light: it never loads the model (the engine core hands it the tokenizer),
so torch's libraries are not even mapped into it, and it tokenizes exactly as the model's own tokenizer."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.model.loader import load_model_source


def _mapped_files(pid: int) -> set[str]:
    maps = Path(f"/proc/{pid}/maps")
    if not maps.exists():
        pytest.skip("no /proc on this platform")
    return {line.split(None, 5)[5].strip() for line in maps.read_text().splitlines() if len(line.split(None, 5)) == 6}


def test_the_api_process_maps_no_torch_library(smollm2_server, http):
    # A request first, so whatever serving a request needs is loaded too.
    response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200
    mapped = _mapped_files(smollm2_server.proc.pid)
    assert any("tokenizers" in path for path in mapped), "the tokenizer's library should be there"
    assert not [path for path in mapped if "libtorch" in path or "/torch/" in path]
    # The engine core is a child process, and it does hold torch: the check looks at the right process.
    core_pids = Path(f"/proc/{smollm2_server.proc.pid}/task/{smollm2_server.proc.pid}/children").read_text().split()
    assert any(any("libtorch" in path for path in _mapped_files(int(pid))) for pid in core_pids)


def test_the_handed_over_tokenizer_tokenizes_as_the_models_own(http):
    tokenizer = load_model_source(None).tokenizer
    text = "naïve café 🙂 中文 <|im_start|> tail"
    body = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert http.post("/tokenize", json={"messages": messages}).json()["tokens"] == \
        tokenizer.encode(rendered, add_special_tokens=False)
    ids = tokenizer.encode(text)
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == tokenizer.decode(ids)
