"""Reports of benchmark results: the `vllm bench serve`-style table, the sweep table, and `bench compare`
(a markdown report plus PNG plots that sets results side by side, differences under 10% counting as ties).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from tokenmill.errors import InvalidRequestError, MissingDependencyError

TIE_THRESHOLD = 0.10
_METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                  "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
_METRIC_SHORT = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


# ---- single runs -------------------------------------------------------------------------------------
def _line(label: str, value: Any, width: int = 50) -> str:
    if value is None:
        shown = "n/a"
    elif isinstance(value, float):
        shown = f"{value:.2f}"
    else:
        shown = str(value)
    return f"{label:<{width - 10}}{shown:>10}" if len(shown) <= 10 else f"{label:<{width - 10}}{shown}"


def _banner(title: str, fill: str, width: int = 50) -> str:
    return f"{' ' + title + ' ' if title else ''}".center(width, fill)


def format_serve_table(result: dict[str, Any]) -> str:
    """The result as `vllm bench serve` prints it (plus P90/P95, failures, goodput and server memory)."""
    lines = [_banner("Serving Benchmark Result", "=")]
    segments = result.get("segments")
    if segments:
        lines += [_line("Warm-up, excluded (s):", segments["warmup_s"]),
                  _line("Stable segment, measured (s):", segments["stable_s"]),
                  _line("Drain, excluded (s):", segments["drain_s"]),
                  _line("Requests sent (all segments):", segments["requests_sent"])]
    lines += [_line("Successful requests:", result["completed"]),
             _line("Failed requests:", result["failed"]),
             _line("Maximum request concurrency:", result.get("max_concurrency")),
             _line("Request rate configured (RPS):", result.get("request_rate")),
             _line("Benchmark duration (s):", result["duration"]),
             _line("Total input tokens:", result["total_input_tokens"]),
             _line("Total generated tokens:", result["total_output_tokens"]),
             _line("Request throughput (req/s):", result["request_throughput"])]
    if result.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", result["request_goodput"]))
    cost = result.get("cost")
    if cost:
        lines.append(_line("Cost per 1M output tokens:", cost["per_million_output_tokens"]))
        lines.append(_line("Cost per 1M tokens (in + out):", cost["per_million_tokens"]))
    verdict = result.get("verdict")
    if verdict:
        lines.append(_line("P95 TTFT and TPOT within the SLO:", "yes" if verdict["meets_slo"] else "NO"))
    lines += [_line("Output token throughput (tok/s):", result["output_throughput"]),
              _line("Total Token throughput (tok/s):", result["total_token_throughput"]),
              _line("Peak concurrent requests:", result.get("max_concurrent_requests"))]
    server = result.get("server") or {}
    if server.get("peak_rss_bytes") is not None:
        lines.append(_line("Peak server memory (MiB):", server["peak_rss_bytes"] / 2**20))
    if server.get("queue_depth_p95") is not None:
        lines.append(_line("P95 queue depth (waiting requests):", server["queue_depth_p95"]))
    percentiles = sorted((k[1:-len("_ttft_ms")] for k in result if re.fullmatch(r"p[0-9.]+_ttft_ms", k)),
                         key=float)
    for metric, title in _METRIC_TITLES.items():
        short = _METRIC_SHORT[metric]
        lines.append(_banner(title, "-"))
        lines.append(_line(f"Mean {short} (ms):", result.get(f"mean_{metric}_ms")))
        lines.append(_line(f"Median {short} (ms):", result.get(f"median_{metric}_ms")))
        for q in percentiles:
            if float(q) != 50:
                lines.append(_line(f"P{q} {short} (ms):", result.get(f"p{q}_{metric}_ms")))
    lines.append("=" * 50)
    errors = sorted({e for e in result.get("errors", []) if e})
    if errors:
        lines.append(f"errors ({result['failed']} requests): " + "; ".join(errors[:3]))
    return "\n".join(lines)


def _fmt(value: Optional[float], digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def format_sweep_table(sweep: dict[str, Any]) -> str:
    """One row per concurrency."""
    header = (f"{'conc':>5} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p95':>9} {'TPOT p50':>9} "
              f"{'ITL p50':>8} {'E2EL p50':>9} {'failed':>6} {'peak MiB':>9}")
    rows = [header, "-" * len(header)]
    for p in sweep["points"]:
        rss = (p.get("server") or {}).get("peak_rss_bytes")
        rows.append(f"{str(p.get('max_concurrency')):>5} {_fmt(p['request_throughput'], 2):>8} "
                    f"{_fmt(p['output_throughput']):>10} {_fmt(p.get('median_ttft_ms')):>9} "
                    f"{_fmt(p.get('p95_ttft_ms')):>9} {_fmt(p.get('median_tpot_ms')):>9} "
                    f"{_fmt(p.get('median_itl_ms')):>8} {_fmt(p.get('median_e2el_ms')):>9} {p['failed']:>6} "
                    f"{_fmt(None if rss is None else rss / 2**20, 0):>9}")
    return "\n".join(rows)


# ---- compare -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class CompareMetric:
    key: str  # a result key; "server.x" reads result["server"]["x"] (and "cost.x" result["cost"]["x"])
    title: str
    higher_is_better: bool


COMPARE_METRICS = (
    CompareMetric("output_throughput", "output throughput (tok/s)", True),
    CompareMetric("request_throughput", "request throughput (req/s)", True),
    CompareMetric("request_goodput", "goodput (req/s)", True),
    CompareMetric("median_ttft_ms", "TTFT p50 (ms)", False),
    CompareMetric("p95_ttft_ms", "TTFT p95 (ms)", False),
    CompareMetric("median_tpot_ms", "TPOT p50 (ms)", False),
    CompareMetric("p95_tpot_ms", "TPOT p95 (ms)", False),
    CompareMetric("median_itl_ms", "ITL p50 (ms)", False),
    CompareMetric("median_e2el_ms", "E2E latency p50 (ms)", False),
    CompareMetric("p95_e2el_ms", "E2E latency p95 (ms)", False),
    CompareMetric("server.peak_rss_bytes", "peak server memory (bytes)", False),
    CompareMetric("cost.per_million_output_tokens", "cost per 1M output tokens", False),
)


def verdict(base: Optional[float], other: Optional[float], higher_is_better: bool,
            tie_threshold: float = TIE_THRESHOLD) -> tuple[Optional[float], str]:
    """(relative difference of `other` against `base`, "tie" | "better" | "worse" | "n/a")."""
    if base is None or other is None:
        return None, "n/a"
    if base == other:
        return 0.0, "tie"
    rel = (other - base) / abs(base) if base else math.copysign(math.inf, other - base)
    if abs(rel) < tie_threshold:
        return rel, "tie"
    return rel, "better" if (rel > 0) == higher_is_better else "worse"


def load_result(path: str | Path) -> dict[str, Any]:
    """A `bench serve` or `bench sweep` JSON, as a sweep (a single run is a sweep of one point)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"cannot read the result {path}: {exc}") from None
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "serve":
        return {"kind": "sweep", "label": data.get("label"), "points": [data]}
    if kind == "sweep" and data.get("points"):
        return data
    raise InvalidRequestError(f"{path} is not a `tokenmill bench serve` or `bench sweep` result")


def _value(point: dict[str, Any], key: str) -> Optional[float]:
    if "." in key:
        section, name = key.split(".", 1)
        return (point.get(section) or {}).get(name)
    return point.get(key)


def _point_key(point: dict[str, Any]) -> str:
    if point.get("max_concurrency") is not None:
        return str(point["max_concurrency"])
    return f"rate {point.get('request_rate')}"


def compare_results(results: Sequence[dict[str, Any]], labels: Sequence[str],
                    tie_threshold: float = TIE_THRESHOLD) -> dict[str, Any]:
    """Every result against the first (the baseline), at each concurrency they all measured."""
    if len(results) < 2 or len(labels) != len(results):
        raise InvalidRequestError("compare needs at least two results and one label per result")
    keyed = [{_point_key(p): p for p in r["points"]} for r in results]
    common = [k for k in keyed[0] if all(k in other for other in keyed[1:])]
    if not common and all(len(r["points"]) == 1 for r in results):
        keyed, common = [{"run": r["points"][0]} for r in results], ["run"]
    if not common:
        raise InvalidRequestError("the results share no concurrency to compare at")
    rows, tally = [], {label: {"better": 0, "worse": 0, "tie": 0} for label in labels[1:]}
    for key in common:
        for metric in COMPARE_METRICS:
            values = [_value(points[key], metric.key) for points in keyed]
            if all(v is None for v in values):
                continue
            row: dict[str, Any] = {"concurrency": key, "metric": metric.key, "title": metric.title,
                                   "values": dict(zip(labels, values)), "diffs": {}}
            for label, value in zip(labels[1:], values[1:]):
                rel, word = verdict(values[0], value, metric.higher_is_better, tie_threshold)
                row["diffs"][label] = {"rel_diff": rel, "verdict": word}
                if word in tally[label]:
                    tally[label][word] += 1
            rows.append(row)
    return {"labels": list(labels), "baseline": labels[0], "tie_threshold": tie_threshold,
            "concurrencies": common, "rows": rows, "summary": tally}


def _cell(metric: str, value: Optional[float]) -> str:
    if value is None:
        return "n/a"
    if metric.endswith("bytes"):
        return f"{value / 2**20:,.0f} MiB"
    return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.1f}"


def render_markdown(comparison: dict[str, Any], plots: Sequence[str]) -> str:
    labels, base = comparison["labels"], comparison["baseline"]
    pct = comparison["tie_threshold"] * 100
    out = ["# Benchmark comparison", "",
           f"Baseline: **{base}**. Differences under {pct:g}% are marked as ties.", ""]
    for key in comparison["concurrencies"]:
        out += [f"## Concurrency {key}" if key != "run" else "## Results", "",
                "| metric | " + " | ".join(labels) + " | "
                + " | ".join(f"{label} vs {base}" for label in labels[1:]) + " |",
                "|---" * (2 * len(labels)) + "|"]
        for row in (r for r in comparison["rows"] if r["concurrency"] == key):
            cells = [_cell(row["metric"], row["values"][label]) for label in labels]
            diffs = []
            for label in labels[1:]:
                d = row["diffs"][label]
                shown = "" if d["rel_diff"] is None or math.isinf(d["rel_diff"]) else f"{d['rel_diff'] * 100:+.1f}% "
                diffs.append(f"{shown}{d['verdict']}")
            out.append(f"| {row['title']} | " + " | ".join(cells) + " | " + " | ".join(diffs) + " |")
        out.append("")
    out += ["## Summary", ""]
    for label, counts in comparison["summary"].items():
        out.append(f"- **{label}** vs {base}: {counts['better']} better, {counts['worse']} worse, "
                   f"{counts['tie']} ties")
    if plots:
        out += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(out) + "\n"


# ---- plots -------------------------------------------------------------------------------------------
PLOT_EXTRA_HINT = "plotting needs matplotlib: pip install 'tokenmill[bench]'"


def _pyplot() -> Any:
    """matplotlib's pyplot, imported on first use: it is an optional extra, not a dependency."""
    try:
        import matplotlib
    except ImportError:
        raise MissingDependencyError(PLOT_EXTRA_HINT) from None

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_throughput_vs_concurrency(results: Sequence[dict[str, Any]], labels: Sequence[str], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for result, label in zip(results, labels):
        pts = sorted((p["max_concurrency"], p["output_throughput"]) for p in result["points"]
                     if p.get("max_concurrency") is not None)
        if pts:
            ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="max concurrency", ylabel="output tokens/s", title="Throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def plot_ttft_cdf(results: Sequence[dict[str, Any]], labels: Sequence[str], path: Path,
                  concurrency: Optional[str] = None) -> None:
    """TTFT CDF of each result at one concurrency (the highest they share), or each one's last point."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for result, label in zip(results, labels):
        points = {_point_key(p): p for p in result["points"]}
        point = points.get(concurrency or "", result["points"][-1])
        ttfts = sorted(t * 1000.0 for t in point.get("ttfts", []) if t is not None)
        if ttfts:
            ax.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post",
                    label=f"{label} (conc {_point_key(point)})")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF", ylim=(0, 1.02))
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def plot_latency_throughput(results: Sequence[dict[str, Any]], labels: Sequence[str], path: Path) -> None:
    """Median end-to-end latency against output throughput, one point per concurrency."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for result, label in zip(results, labels):
        pts = [(p["output_throughput"], p.get("median_e2el_ms"), _point_key(p)) for p in result["points"]]
        pts = sorted(pt for pt in pts if pt[1] is not None)
        ax.plot([x for x, _, _ in pts], [y / 1000.0 for _, y, _ in pts], marker="o", label=label)
        for x, y, key in pts:
            ax.annotate(key, (x, y / 1000.0), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set(xlabel="output tokens/s", ylabel="median E2E latency (s)", title="Latency vs throughput")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def apply_prices(results: Sequence[dict[str, Any]], prices_per_hour: Sequence[float]) -> None:
    """Sets each point's `cost` from its result's price an hour (one price for all results, or one each)."""
    from tokenmill.bench.serve import token_cost

    prices = list(prices_per_hour) * len(results) if len(prices_per_hour) == 1 else list(prices_per_hour)
    if len(prices) != len(results) or not all(price > 0 for price in prices):
        raise InvalidRequestError(f"--price-per-hour takes one positive price, or one per result ({len(results)})")
    for result, price in zip(results, prices):
        for point in result["points"]:
            point["cost"] = token_cost(point, price)


def write_compare_report(paths: Sequence[str | Path], labels: Optional[Sequence[str]], output_dir: str | Path,
                         tie_threshold: float = TIE_THRESHOLD,
                         prices_per_hour: Optional[Sequence[float]] = None) -> dict[str, Any]:
    """Loads the results, writes report.md, compare.json and the PNG plots; returns the comparison.
    prices_per_hour: what each result's server costs an hour (one for all, or one per result): every point then
    gets its cost per million tokens at its measured throughput (a GPU's price against a CPU host's)."""
    results = [load_result(p) for p in paths]
    if prices_per_hour:
        apply_prices(results, prices_per_hour)
    if labels is None:
        labels = [r.get("label") or Path(p).stem for r, p in zip(results, paths)]
    if len(labels) != len(results):
        raise InvalidRequestError(f"--labels has {len(labels)} names for {len(results)} results")
    if len(set(labels)) != len(labels):
        raise InvalidRequestError("labels must differ; pass --labels a,b,...")
    comparison = compare_results(results, list(labels), tie_threshold)
    _pyplot()  # without matplotlib, fail before writing a report that lacks its plots
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots: list[str] = []
    shared = [k for k in comparison["concurrencies"] if k != "run"]
    for name, draw in (("throughput_vs_concurrency.png", plot_throughput_vs_concurrency),
                       ("latency_throughput.png", plot_latency_throughput)):
        draw(results, labels, out / name)
        plots.append(str(out / name))
    plot_ttft_cdf(results, labels, out / "ttft_cdf.png", _highest(shared))
    plots.append(str(out / "ttft_cdf.png"))
    comparison["plots"] = plots
    markdown = render_markdown(comparison, plots)
    (out / "report.md").write_text(markdown, encoding="utf-8")
    (out / "compare.json").write_text(json.dumps(comparison, indent=2), encoding="utf-8")
    comparison["markdown"] = markdown
    return comparison


def _highest(keys: Sequence[str]) -> Optional[str]:
    numeric = [k for k in keys if k.isdigit()]
    return max(numeric, key=int) if numeric else None
