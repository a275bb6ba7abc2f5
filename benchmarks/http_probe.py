"""How responsive the HTTP loop stays while the engine is busy.

    python -m benchmarks.http_probe http://127.0.0.1:8000

Times GET /health over one kept-alive connection, first idle, then for as long as `tokenmill bench
serve` keeps streams generating (default: 16 streams of random 256-token prompts, 64 output tokens;
`--dataset file:../shared/bench/workload-64.jsonl --num-prompts 64 --max-concurrency 64` for the
64-stream comparison in docs/benchmarks.md, with `--result-json` keeping bench serve's report).
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time

import httpx


def probe(client: httpx.Client, url: str, count: int, gap_s: float) -> dict[str, float]:
    return summarize(probe_raw(client, url, count, gap_s))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="GET /health latency, idle and under `tokenmill bench serve` load")
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:8000")
    parser.add_argument("--dataset", default="random", help="as tokenmill bench serve's --dataset")
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--result-json", default=None, help="where bench serve writes its result")
    args = parser.parse_args(argv)
    url = args.url.rstrip("/")
    client = httpx.Client()
    print("idle", probe(client, url, 50, 0.05), flush=True)
    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "--log-level", "WARNING", "bench", "serve",
               "--base-url", url, "--dataset", args.dataset, "--num-prompts", str(args.num_prompts),
               "--max-concurrency", str(args.max_concurrency), "--disable-tqdm", "--no-sample-server"]
    if args.dataset == "random":
        command += ["--random-input-len", "256", "--random-output-len", "64"]
    if args.result_json:
        command += ["--result-json", args.result_json]
    load = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(5)  # let the streams start
        latencies: list[float] = []
        while load.poll() is None:  # probe for as long as the load runs
            latencies.extend(probe_raw(client, url, 10, 0.1))
        latencies.sort()
        print(f"busy ({args.max_concurrency} streams)", summarize(latencies), flush=True)
    finally:
        load.kill()
    return 0


def probe_raw(client: httpx.Client, url: str, count: int, gap_s: float) -> list[float]:
    latencies = []
    for _ in range(count):
        start = time.perf_counter()
        client.get(url + "/health", timeout=30)
        latencies.append((time.perf_counter() - start) * 1000)
        time.sleep(gap_s)
    return latencies


def summarize(latencies: list[float]) -> dict[str, float]:
    latencies = sorted(latencies)
    return {"n": len(latencies), "p50_ms": round(statistics.median(latencies), 1),
            "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))], 1), "max_ms": round(latencies[-1], 1)}


if __name__ == "__main__":
    sys.exit(main())
