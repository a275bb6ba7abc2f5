"""`tokenmill serve --model <Gemma 3 270M GGUF>` end to end: the real file (installed by `make gemma`), which
carries no chat template, chats with Gemma's, and continues text sensibly."""
from __future__ import annotations

import httpx
import pytest

CHAT_PROMPT_TOKENS = 16  # <bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n


@pytest.mark.slow
def test_gemma3_270m_answers_a_chat_request(gemma3_270m_server):
    assert "using tokenmill's Gemma3ForCausalLM template" in gemma3_270m_server.log_text()
    body = {"model": "gemma-3-270m-q4_k_m", "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": "What is the capital of France?"}]}
    reply = httpx.post(gemma3_270m_server.url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"].strip()
    assert choice["finish_reason"] in ("stop", "length")
    # The system message is folded into the user turn: "Answer briefly.\n\n" adds 4 tokens.
    assert data["usage"]["prompt_tokens"] == CHAT_PROMPT_TOKENS + 4


@pytest.mark.slow
def test_gemma3_270m_knows_the_capital_of_france(gemma3_270m_server):
    """Guards the weights (norm offsets, quantized blocks, local/global layers): a broken load scores
    gibberish here, as Gemma's (1 + w) norms read as w do (perplexity ~1e8 instead of ~6)."""
    body = {"model": "gemma-3-270m-q4_k_m", "prompt": "The capital of France is", "temperature": 0,
            "max_tokens": 1, "logprobs": 5}
    reply = httpx.post(gemma3_270m_server.url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    top = reply.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    assert " Paris" in top, top


@pytest.mark.slow
def test_gemma3_270m_serves_at_the_numerics_this_machine_chose(gemma3_270m_server):
    """`tokenmill serve` with no numerics flag: the hardware's choice, logged once and reported by /stats."""
    from tokenmill.config import EngineConfig
    from tokenmill.runner.numerics import detect_hardware, resolve_numerics

    chosen = resolve_numerics(EngineConfig(), detect_hardware("cpu", "auto"), block_weights=True)
    stats = httpx.get(gemma3_270m_server.url + "/stats", timeout=30).json()
    assert stats["numerics"] == chosen.as_dict()
    assert "numerics on cpu" in gemma3_270m_server.log_text()
    assert chosen.describe() in gemma3_270m_server.log_text()
