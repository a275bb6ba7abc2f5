"""How responsive the HTTP loop stays while the engine is busy.

    python -m benchmarks.http_probe http://127.0.0.1:8000

Times GET /health over one kept-alive connection, first idle, then while `tokenmill bench serve`
keeps 16 streams generating (random 256-token prompts, 64 output tokens).
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time

import httpx


def probe(client: httpx.Client, url: str, count: int, gap_s: float) -> dict[str, float]:
    latencies = []
    for _ in range(count):
        start = time.perf_counter()
        client.get(url + "/health", timeout=30)
        latencies.append((time.perf_counter() - start) * 1000)
        time.sleep(gap_s)
    latencies.sort()
    return {"p50_ms": round(statistics.median(latencies), 1),
            "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))], 1), "max_ms": round(latencies[-1], 1)}


def main(argv: list[str] | None = None) -> int:
    url = (argv or sys.argv[1:] or ["http://127.0.0.1:8000"])[0].rstrip("/")
    client = httpx.Client()
    print("idle", probe(client, url, 50, 0.05), flush=True)
    load = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "--log-level", "WARNING", "bench", "serve",
         "--base-url", url, "--dataset", "random", "--random-input-len", "256", "--random-output-len", "64",
         "--num-prompts", "32", "--max-concurrency", "16", "--disable-tqdm", "--no-sample-server"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(5)  # let the 16 streams start
        print("busy (16 streams)", probe(client, url, 150, 0.1), flush=True)
    finally:
        load.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
