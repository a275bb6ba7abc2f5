from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_prints_the_greedy_completion(tiny_llama_dir):
    from tokenmill import LLM, SamplingParams

    expected = LLM(str(tiny_llama_dir), num_kv_blocks=64, numerics="exact").generate(
        "Hello", SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0].outputs[0].text
    result = run_cli("generate", "--model", str(tiny_llama_dir), "--prompt", "Hello", "--max-tokens", "6",
                     "--num-kv-blocks", "64")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"


def test_bad_arguments_give_one_line_errors(tmp_path):
    result = run_cli("generate", "--prompt", "x", "--max-tokens", "-3")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "max_tokens" in result.stderr
    result = run_cli("generate", "--prompt", "x", "--kv-cache-memory-bytes", "lots")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_cli("generate", "--prompt", "x", "--model", str(tmp_path / "missing"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_auto_tool_choice_needs_a_parser():
    result = run_cli("serve", "--enable-auto-tool-choice", "--port", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--tool-call-parser" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = run_cli("serve", "--tool-call-parser", "nonesuch")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_speculative_config_flag(tiny_llama_dir):
    from tokenmill import LLM, SamplingParams

    spec = run_cli("generate", "--model", str(tiny_llama_dir), "--prompt", "a b a b a b", "--max-tokens", "8",
                   "--num-kv-blocks", "64", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    assert spec.returncode == 0, spec.stderr
    # The same greedy request without drafts, in this process: `generate` prints the completion's text.
    plain = LLM(str(tiny_llama_dir), num_kv_blocks=64).generate("a b a b a b",
                                                                SamplingParams(max_tokens=8, temperature=0.0),
                                                                use_tqdm=False)[0].outputs[0].text
    assert spec.stdout == plain + "\n"
    for bad in ("{not json", '{"method": "eagle"}'):
        result = run_cli("generate", "--prompt", "x", "--speculative-config", bad)
        assert result.returncode in (1, 2) and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "speculative" in result.stderr
