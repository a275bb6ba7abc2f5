"""How responsive the HTTP loop stays while the engine is busy.

    python -m benchmarks.http_probe http://127.0.0.1:8000

Times GET /health over one kept-alive connection, first idle, then for as long as `tokenmill bench
serve` keeps streams generating (default: 16 streams of random 256-token prompts, 64 output tokens;
`--dataset file:../shared/bench/workload-64.jsonl --num-prompts 64 --max-concurrency 64` for the
64-stream comparison in docs/benchmarks.md, with `--result-json` keeping bench serve's report).

`--floor` also starts a bare ASGI app under uvicorn (one route, no engine, no middleware) and probes it
in turn with the server, under the same load. On a machine whose cores the engine keeps busy, most of a
loaded /health tail is the time the kernel takes to give the woken server, and then the woken probe, a
CPU; the bare app's tail measures that floor in the same seconds, so the server's excess over it is what
its own design adds, comparable between sittings whose machines run at different speeds.
"""
from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="GET /health latency, idle and under `tokenmill bench serve` load")
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:8000")
    parser.add_argument("--dataset", default="random", help="as tokenmill bench serve's --dataset")
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--result-json", default=None, help="where bench serve writes its result")
    parser.add_argument("--floor", action="store_true",
                        help="also probe a bare uvicorn app under the same load (the machine's floor)")
    parser.add_argument("--latencies-json", default=None,
                        help="where to write every loaded probe's latency (ms), per target, for pooling rounds")
    parser.add_argument("--serve-floor", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_floor is not None:
        return serve_floor(args.serve_floor)
    url = args.url.rstrip("/")
    floor = FloorApp() if args.floor else None
    try:
        targets = {"server": (httpx.Client(), url)}
        if floor is not None:
            targets["floor"] = (httpx.Client(), floor.url)
        for name, (client, target) in targets.items():
            print(f"idle {name}", summarize(probe_raw(client, target, 50, 0.05)), flush=True)
        busy = run_under_load(targets, url, args)
        for name, latencies in busy.items():
            print(f"busy ({args.max_concurrency} streams) {name}", summarize(latencies), flush=True)
        if args.latencies_json:
            with open(args.latencies_json, "w", encoding="utf-8") as out:
                json.dump(busy, out)
        if floor is not None:
            excess = percentile(busy["server"], 0.99) - percentile(busy["floor"], 0.99)
            print(f"server p99 over the floor's: {excess:+.1f} ms", flush=True)
    finally:
        if floor is not None:
            floor.stop()
    return 0


def run_under_load(targets: dict[str, tuple[httpx.Client, str]], url: str, args) -> dict[str, list[float]]:
    """Probes every target in turn (the first one alternating) for as long as the load runs."""
    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "--log-level", "WARNING", "bench", "serve",
               "--base-url", url, "--dataset", args.dataset, "--num-prompts", str(args.num_prompts),
               "--max-concurrency", str(args.max_concurrency), "--disable-tqdm", "--no-sample-server"]
    if args.dataset == "random":
        command += ["--random-input-len", "256", "--random-output-len", "64"]
    if args.result_json:
        command += ["--result-json", args.result_json]
    load = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latencies: dict[str, list[float]] = {name: [] for name in targets}
    names = list(targets)
    try:
        time.sleep(5)  # let the streams start
        rounds = 0
        while load.poll() is None:  # probe for as long as the load runs
            order = names if rounds % 2 == 0 else names[::-1]
            for name in order:
                client, target = targets[name]
                latencies[name].extend(probe_raw(client, target, 1, 0.1 / len(names)))
            rounds += 1
    finally:
        load.kill()
    return latencies


class FloorApp:
    """The bare app in a child process on a free port (this module, --serve-floor PORT)."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        # `benchmarks` is a package of the checkout, not installed: the child starts from the checkout's root.
        self.process = subprocess.Popen([sys.executable, "-m", "benchmarks.http_probe", "--serve-floor", str(port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        cwd=Path(__file__).resolve().parents[1])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/health", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("the floor app did not start")

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


async def _bare_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


def serve_floor(port: int) -> int:
    import uvicorn

    uvicorn.run(_bare_app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off")
    return 0


def probe_raw(client: httpx.Client, url: str, count: int, gap_s: float) -> list[float]:
    latencies = []
    for _ in range(count):
        start = time.perf_counter()
        client.get(url + "/health", timeout=30)
        latencies.append((time.perf_counter() - start) * 1000)
        time.sleep(gap_s)
    return latencies


def percentile(latencies: list[float], q: float) -> float:
    ordered = sorted(latencies)
    return ordered[int(q * (len(ordered) - 1))]


def summarize(latencies: list[float]) -> dict[str, float]:
    latencies = sorted(latencies)
    return {"n": len(latencies), "p50_ms": round(statistics.median(latencies), 1),
            "p99_ms": round(percentile(latencies, 0.99), 1), "max_ms": round(latencies[-1], 1)}


if __name__ == "__main__":
    sys.exit(main())
