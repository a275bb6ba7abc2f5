"""use_beam_search on /v1/completions equals the offline beam search on the same weights."""
from __future__ import annotations

import httpx
import pytest

from tokenmill import LLM
from tokenmill.beam_search import BeamSearchParams


@pytest.mark.slow
def test_http_beam_search_matches_offline(start_server, tiny_llama_dir):
    server = start_server(["--model", str(tiny_llama_dir), "--max-model-len", "512", "--num-kv-blocks", "128"])
    prompt = [12, 345, 678, 91, 2345]
    body = {"prompt": prompt, "max_tokens": 6, "n": 3, "use_beam_search": True, "ignore_eos": True,
            "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=512)
    offline = llm.beam_search([{"prompt_token_ids": prompt}],
                              BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
    assert [c["text"] for c in data["choices"]] == [s.text for s in offline.sequences]
    assert data["usage"]["completion_tokens"] == 18 and data["usage"]["prompt_tokens"] == 5
    stream = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True},
                        headers=server.headers, timeout=60)
    assert stream.status_code == 400 and stream.json()["error"]["param"] == "stream"
    too_wide = httpx.post(f"{server.url}/v1/completions", json={**body, "n": 50}, headers=server.headers, timeout=60)
    assert too_wide.status_code == 400 and too_wide.json()["error"]["param"] == "n"
