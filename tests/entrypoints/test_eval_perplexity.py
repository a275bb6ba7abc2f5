"""`tokenmill eval perplexity`: windows as llama-perplexity cuts them, the engine's figure against a hand
computation with HF transformers on the same tiny model, and the command's output and errors."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tokenmill.entrypoints.eval_cli import (
    adds_bos,
    evaluate_perplexity,
    perplexity_from_logprobs,
    perplexity_windows,
    scored_positions,
)
from tokenmill.errors import InvalidRequestError

TEXT = ("The river runs past the mill, and the mill grinds the grain that the farmers bring from the hills. "
        "In winter the water freezes and the wheel stands still; in spring it turns again. ") * 12


def test_windows_follow_llama_perplexity():
    tokens = list(range(100, 135))  # 35 tokens: three windows of 10, a tail of 5 dropped
    windows = perplexity_windows(tokens, 10)
    assert windows == [list(range(100, 110)), list(range(110, 120)), list(range(120, 130))]
    assert perplexity_windows(tokens, 10, bos_token_id=1) == [[1, *range(101, 110)], [1, *range(111, 120)],
                                                             [1, *range(121, 130)]]
    assert perplexity_windows(tokens, 10, max_windows=2) == windows[:2]
    # the second half of a window, each token with at least half a window before it
    assert list(scored_positions(10)) == [6, 7, 8, 9]
    assert list(scored_positions(512)) == list(range(257, 512))
    with pytest.raises(InvalidRequestError, match="at least 40"):
        perplexity_windows(tokens, 20)


def test_perplexity_and_its_error_from_logprobs():
    logprobs = [-1.0, -2.0, -3.0]
    ppl, stderr = perplexity_from_logprobs(logprobs)
    assert ppl == pytest.approx(math.exp(2.0))
    # llama-perplexity: sqrt((mean(nll^2) - mean(nll)^2) / (n - 1)) * ppl
    assert stderr == pytest.approx(math.sqrt((14 / 3 - 4) / 2) * math.exp(2.0))


def test_engine_perplexity_equals_a_hand_computation_with_hf(tiny_llama_dir):
    """Exact numerics: the engine's windows scored by HF transformers in float32, one window at a time."""
    from transformers import AutoModelForCausalLM

    from tokenmill import LLM

    llm = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_model_len=256, numerics="exact",
              max_num_batched_tokens=96)
    result = evaluate_perplexity(llm, TEXT, context_size=64)
    tokenizer = llm.get_tokenizer()
    windows = perplexity_windows(tokenizer(TEXT).input_ids, 64, adds_bos(tokenizer))
    assert result.windows == len(windows) >= 4 and result.tokens_scored == len(windows) * 31

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    nll = []
    with torch.no_grad():
        for window in windows:
            logprobs = torch.log_softmax(hf(torch.tensor([window])).logits[0].float(), dim=-1)
            nll += [-logprobs[p - 1, window[p]].item() for p in scored_positions(64)]
    expected = math.exp(sum(nll) / len(nll))
    assert result.perplexity == pytest.approx(expected, rel=1e-4)
    assert result.perplexity > 1.0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_the_command_prints_and_writes_the_result(tiny_llama_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "ppl.json"
    result = run_cli("eval", "perplexity", "--model", str(tiny_llama_dir), "--file", str(text), "--context-size",
                     "64", "--max-chunks", "3", "--num-kv-blocks", "64", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("perplexity ") and "over 93 tokens (3 windows of 64" in result.stdout
    body = json.loads(out.read_text())
    assert body["windows"] == 3 and body["tokens_scored"] == 93 and body["perplexity"] > 1.0
    assert set(body["numerics"]) == {"weights", "dtype", "block_matmul", "kv_cache_dtype"}

    short = tmp_path / "short.txt"
    short.write_text("too short")
    result = run_cli("eval", "perplexity", "--model", str(tiny_llama_dir), "--file", str(short),
                     "--num-kv-blocks", "64")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("tokenmill: error: the text has")
    assert "needs at least 1024" in result.stderr
