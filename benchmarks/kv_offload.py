"""The prefix cache's second tier (`--kv-offload-dir`), measured against live servers.

    python -m benchmarks.kv_offload restart   # TTFT right after a restart, tier vs a cold server
    python -m benchmarks.kv_offload tenants   # Zipf-distributed tenants whose prompts need 4x the KV cache
    python -m benchmarks.kv_offload overhead  # workload-64 with and without a tier it never hits

Each scenario starts `tokenmill serve` (the embedded model unless --model) as a subprocess per
configuration, one at a time, and sends synthetic token-id prompts (benchmarks.shared_prefix's ids) as
streaming completions; TTFT is the time to the first streamed token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

from benchmarks.paths import default_workload_path
from benchmarks.server_ready import wait_until_serving
from benchmarks.shared_prefix import MIN_TOKEN_ID

VOCAB = 49152  # the embedded SmolLM2's


class Server:
    def __init__(self, args: list[str], log: Path) -> None:
        self.port = _free_port()
        self.log = open(log, "ab")
        cmd = [sys.executable, "-m", "tokenmill.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port",
               str(self.port), "--served-model-name", "m", "--disable-log-requests", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        wait_until_serving(self.proc, self.url, log_hint=f"; see {log}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=10).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft": ttft, "e2e": time.perf_counter() - start, "usage": usage}


async def _run(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def bounded(prompt):
            async with limit:
                return await _one(client, url, prompt, max_tokens)
        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
    return list(results), time.perf_counter() - start


def run(server: Server, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    return asyncio.run(_run(server.url, prompts, max_tokens, concurrency))


def ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, VOCAB) for _ in range(count)]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summary(results: list[dict], seconds: float) -> dict:
    ttfts = [r["ttft"] for r in results]
    out_tokens = sum(r["usage"]["completion_tokens"] for r in results)
    cached = sum(r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in results)
    return {"requests": len(results), "seconds": round(seconds, 2), "output_tok_s": round(out_tokens / seconds, 1),
            "ttft_p50_s": round(statistics.median(ttfts), 3), "ttft_p95_s": round(pct(ttfts, 95), 3),
            "cached_prompt_tokens": cached}


def model_args(args) -> list[str]:
    return ["--model", args.model] if args.model else []


# ---- scenarios -----------------------------------------------------------------------------
def restart(args, work: Path) -> dict:
    """Documents of 2,000-4,000 tokens, one question each before a restart and another after; TTFT of the
    questions after the restart, against the same questions on a cold server (an empty tier)."""
    rng = random.Random(0)
    documents = [ids(rng, rng.randint(2000, 4000)) for _ in range(args.documents)]
    before = [d + ids(rng, 24) for d in documents]
    after = [d + ids(rng, 24) for d in documents]
    tier = work / "tier"
    base = [*model_args(args), "--kv-offload-dir", str(tier)]
    server = Server(base, work / "server.log")
    run(server, before, 8, 1)
    server.stop()
    restarted = Server(base, work / "server.log")
    warm, warm_s = run(restarted, after, args.max_tokens, 1)
    stats = restarted.stats().get("kv_offload")
    restarted.stop()
    cold_server = Server([*model_args(args), "--kv-offload-dir", str(work / "empty-tier")], work / "server.log")
    cold, cold_s = run(cold_server, after, args.max_tokens, 1)
    cold_server.stop()
    result = {"after_restart": summary(warm, warm_s), "cold": summary(cold, cold_s), "tier": stats}
    result["ttft_p50_ratio"] = round(result["cold"]["ttft_p50_s"] / result["after_restart"]["ttft_p50_s"], 2)
    return result


def tenants(args, work: Path) -> dict:
    """args.tenants system prompts of args.prefix_len tokens, requests Zipf-distributed over them, a KV
    cache holding a quarter of the prompts: with the tier and without. Each server first sees every
    tenant once (the warm-up, unmeasured: a server that has been serving these tenants for a while), then
    the measured requests."""
    rng = random.Random(1)
    prompts_of = [ids(rng, args.prefix_len) for _ in range(args.tenants)]
    weights = [1 / (rank + 1) ** args.zipf for rank in range(args.tenants)]
    picks = rng.choices(range(args.tenants), weights, k=args.requests)
    prompts = [prompts_of[t] + ids(rng, 32) for t in picks]
    bytes_per_token = args.kv_bytes_per_token
    budget = args.tenants * args.prefix_len * bytes_per_token // 4
    common = [*model_args(args), "--kv-cache-memory-bytes", str(budget)]
    results = {"kv_cache_bytes": budget, "distinct_tenants_hit": len(set(picks))}
    for name, extra in (("without tier", []), ("with tier", ["--kv-offload-dir", str(work / "tier")])):
        server = Server(common + extra, work / "server.log")
        run(server, [p + ids(random.Random(t), 8) for t, p in enumerate(prompts_of)], 1, args.concurrency)
        outcome, seconds = run(server, prompts, args.max_tokens, args.concurrency)
        results[name] = summary(outcome, seconds)
        results[name]["tier"] = server.stats().get("kv_offload")
        server.stop()
    results["throughput_ratio"] = round(results["with tier"]["output_tok_s"]
                                        / results["without tier"]["output_tok_s"], 2)
    results["ttft_p95_ratio"] = round(results["with tier"]["ttft_p95_s"] / results["without tier"]["ttft_p95_s"], 2)
    return results


def overhead(args, work: Path) -> dict:
    """workload-64's requests (no prefix shared) at 16 streams, without and with a tier, alternated."""
    rows = [json.loads(line) for line in Path(args.workload).read_text().splitlines() if line.strip()]
    prompts = [r["prompt_token_ids"] for r in rows][:args.requests]
    results: dict = {}
    for round_index in range(args.rounds):
        for name, extra in (("without tier", []),
                            ("with tier", ["--kv-offload-dir", str(work / f"tier{round_index}")])):
            server = Server([*model_args(args), *extra], work / "server.log")
            outcome, seconds = run(server, prompts, args.max_tokens, args.concurrency)
            results.setdefault(name, []).append(summary(outcome, seconds))
            server.stop()
    tput = {name: sum(r["output_tok_s"] for r in runs) / len(runs) for name, runs in results.items()}
    results["throughput_ratio"] = round(tput["with tier"] / tput["without tier"], 3)
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=("restart", "tenants", "overhead"))
    parser.add_argument("--model", help="model path (default: the embedded SmolLM2)")
    parser.add_argument("--documents", type=int, default=8, help="restart: documents (prefixes)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--tenants", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=2000)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-bytes-per-token", type=int, default=30 * 2 * 3 * 64 * 2,
                        help="the model's KV bytes per token (default: SmolLM2's with a 16-bit cache)")
    parser.add_argument("--workload", default=str(default_workload_path()))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tokenmill-kv-offload-"))
    try:
        result = {"restart": restart, "tenants": tenants, "overhead": overhead}[args.scenario](args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
