"""`tokenmill bench compare` and the result tables: ties under 10%, markdown, PNG plots."""
from __future__ import annotations

import json
import sys

import pytest

from tokenmill.bench.report import (
    compare_results,
    format_serve_table,
    format_sweep_table,
    load_result,
    verdict,
)
from tokenmill.entrypoints import cli
from tokenmill.errors import InvalidRequestError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _point(concurrency: int, scale: float, ttft_scale: float = 1.0) -> dict:
    """A synthetic `bench serve` result: throughput × scale, latencies × ttft_scale."""
    point = {"kind": "serve", "max_concurrency": concurrency, "request_rate": "inf", "completed": 8, "failed": 0,
             "duration": 2.0, "total_input_tokens": 800, "total_output_tokens": 400,
             "request_throughput": 4.0 * scale, "request_goodput": None, "output_throughput": 200.0 * scale,
             "total_token_throughput": 600.0 * scale, "max_concurrent_requests": concurrency,
             "ttfts": [0.01 * ttft_scale * (i + 1) for i in range(8)], "errors": [""] * 8,
             "server": {"peak_rss_bytes": 500 * 2**20, "queue_depth_p95": 0.0}}
    for metric, base in (("ttft", 40.0), ("tpot", 10.0), ("itl", 10.0), ("e2el", 400.0)):
        for stat, factor in (("mean", 1.0), ("median", 1.0), ("std", 0.1), ("p50", 1.0), ("p90", 1.5),
                             ("p95", 1.6), ("p99", 1.8), ("max", 2.0)):
            point[f"{stat}_{metric}_ms"] = base * factor * concurrency ** 0.5 * ttft_scale
    return point


def _sweep(label: str, scale: float, ttft_scale: float = 1.0) -> dict:
    return {"kind": "sweep", "label": label, "points": [_point(c, scale, ttft_scale) for c in (1, 4, 16)]}


def test_verdict_marks_ties_under_ten_percent():
    assert verdict(100.0, 105.0, True) == (pytest.approx(0.05), "tie")
    assert verdict(100.0, 95.0, False)[1] == "tie"
    assert verdict(100.0, 120.0, True) == (pytest.approx(0.2), "better")
    assert verdict(100.0, 120.0, False)[1] == "worse"  # higher latency
    assert verdict(100.0, 80.0, False)[1] == "better"
    assert verdict(100.0, 109.9, True)[1] == "tie" and verdict(100.0, 110.1, True)[1] == "better"
    assert verdict(None, 3.0, True) == (None, "n/a") and verdict(0.0, 0.0, True)[1] == "tie"


def test_compare_results_five_percent_tie_twenty_percent_not():
    base, close, far = _sweep("a", 1.0), _sweep("b", 1.05, 1.05), _sweep("c", 1.2, 1.2)
    out = compare_results([base, close, far], ["a", "b", "c"])
    assert out["concurrencies"] == ["1", "4", "16"]
    rows = {(r["concurrency"], r["metric"]): r for r in out["rows"]}
    throughput, ttft = rows[("4", "output_throughput")], rows[("4", "p95_ttft_ms")]
    assert throughput["diffs"]["b"]["verdict"] == "tie" and ttft["diffs"]["b"]["verdict"] == "tie"
    assert throughput["diffs"]["c"]["verdict"] == "better" and ttft["diffs"]["c"]["verdict"] == "worse"
    assert out["summary"]["b"]["better"] == out["summary"]["b"]["worse"] == 0
    assert ("4", "request_goodput") not in rows  # absent everywhere: no row
    with pytest.raises(InvalidRequestError):
        compare_results([base], ["a"])


def test_compare_cli_writes_markdown_and_valid_pngs(tmp_path, capsys):
    paths = []
    for name, data in (("a", _sweep("tokenmill", 1.0)), ("b", _sweep("vllm", 1.2, 0.8))):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    single = tmp_path / "single.json"
    single.write_text(json.dumps(_point(4, 1.05)))
    out_dir = tmp_path / "report"
    code = cli.main(["bench", "compare", *map(str, paths), str(single), "--labels", "tm,vllm,one",
                           "--output-dir", str(out_dir)])
    assert code == 0
    markdown = (out_dir / "report.md").read_text()
    assert "| output throughput (tok/s) |" in markdown and "## Concurrency 4" in markdown
    assert "+5.0% tie" in markdown and "+20.0% better" in markdown
    assert "## Concurrency 1" not in markdown  # the single run only measured concurrency 4
    for name in ("throughput_vs_concurrency.png", "ttft_cdf.png", "latency_throughput.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 1000
        assert f"]({name})" in markdown
    assert json.loads((out_dir / "compare.json").read_text())["labels"] == ["tm", "vllm", "one"]
    capsys.readouterr()

    code = cli.main(["bench", "compare", str(paths[0]), str(paths[1]), "--labels", "x",
                           "--output-dir", str(out_dir)])
    assert code == 1 and "--labels has 1 names for 2 results" in capsys.readouterr().err


def test_compare_turns_each_servers_price_into_a_cost_per_token(tmp_path, capsys):
    from tokenmill.bench.report import apply_prices

    # A GPU server 3x as fast at 10x the price against a CPU host: the host's tokens are the cheaper ones.
    gpu, cpu = _sweep("gpu", 3.0), _sweep("cpu", 1.0)
    apply_prices([gpu, cpu], [10.0, 1.0])
    out = compare_results([gpu, cpu], ["gpu", "cpu"])
    row = next(r for r in out["rows"] if r["concurrency"] == "4" and r["metric"] == "cost.per_million_output_tokens")
    assert row["values"]["gpu"] == pytest.approx(10.0 / (600.0 * 3600) * 1e6)
    assert row["values"]["cpu"] == pytest.approx(1.0 / (200.0 * 3600) * 1e6)
    assert row["diffs"]["cpu"]["verdict"] == "better"  # lower cost per token
    with pytest.raises(InvalidRequestError, match="one per result"):
        apply_prices([gpu, cpu], [1.0, 2.0, 3.0])
    paths = []
    for name, data in (("gpu", _sweep("gpu", 3.0)), ("cpu", _sweep("cpu", 1.0))):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    assert cli.main(["bench", "compare", *map(str, paths), "--price-per-hour", "10,1",
                     "--output-dir", str(tmp_path / "report")]) == 0
    assert "| cost per 1M output tokens |" in (tmp_path / "report" / "report.md").read_text()
    capsys.readouterr()


def test_compare_without_matplotlib_fails_with_a_one_line_hint(tmp_path, capsys, monkeypatch):
    paths = []
    for name, data in (("a", _sweep("tokenmill", 1.0)), ("b", _sweep("vllm", 1.2, 0.8))):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    code = cli.main(["bench", "compare", *map(str, paths), "--output-dir", str(tmp_path / "report")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1
    assert "pip install 'tokenmill[bench]'" in err
    assert not (tmp_path / "report" / "report.md").exists()


def test_load_result_and_tables(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"engine": "tokenmill", "output_tok_s": 3}))
    with pytest.raises(InvalidRequestError, match="not a `tokenmill bench serve`"):
        load_result(bad)
    point = _point(4, 1.0)
    table = format_serve_table(point)
    assert "Serving Benchmark Result" in table and "P95 TTFT (ms):" in table and "Median E2EL (ms):" in table
    assert "P50" not in table  # the median line stands for it
    assert "Peak server memory (MiB):" in table
    sweep = format_sweep_table(_sweep("a", 1.0))
    assert len(sweep.splitlines()) == 2 + 3
