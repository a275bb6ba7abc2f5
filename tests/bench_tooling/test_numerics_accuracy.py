"""benchmarks.numerics_accuracy's command line: modes by name, and a one-line error for one it does not know
(before any model loads)."""
from __future__ import annotations

import pytest

from benchmarks import numerics_accuracy


def test_an_unknown_mode_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        numerics_accuracy.main(["--modes", "default,defalt"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "mode 'defalt': expected 'default', 'exact' or BLOCK_MATMUL:KV_CACHE_DTYPE" in err
    assert "Traceback" not in err


def test_exact_names_the_float32_pair(monkeypatch, capsys, tmp_path):
    seen = []

    def fake_engine(model, text, context_size, max_chunks, mode):
        seen.append(mode)
        numerics = {"block_matmul": {"value": "float32"}, "kv_cache_dtype": {"value": "float32"}}
        return {"mode": mode, "numerics": numerics, "perplexity": 2.0, "stderr": 0.1, "tokens": 10, "seconds": 1.0}

    monkeypatch.setattr(numerics_accuracy, "engine_perplexity", fake_engine)
    text = tmp_path / "text.txt"
    text.write_text("Some text to score.\n")
    numerics_accuracy.main(["--modes", "exact", "--file", str(text), "--llama-perplexity", str(tmp_path / "none")])
    assert seen == ["float32:float32"]
    assert "float32, KV float32" in capsys.readouterr().out
