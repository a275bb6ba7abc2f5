"""Soak test of a running server: mixed streaming and non-streaming requests, random client
disconnects, at about twice the concurrency the server runs at once, for a fixed time.

    python -m benchmarks.soak http://127.0.0.1:8000 --server-pid PID --duration-s 1800 --clients 128

Afterwards it waits for the server to go idle and compares its memory (RSS of the server process and
its children, e.g. the engine core) and KV-cache usage with the values measured before the load.
Reported: requests by outcome (200, 429, 503, other 4xx, 5xx, transport errors, client disconnects),
tokens generated, and the before/after resource figures. A healthy server shows no 5xx, every
request answered or refused with 429/503, and memory and KV usage back near their idle values.
Bounded in time and count; talks only to the given URL (use a loopback address).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import httpx

WORDS = ("river mill grain wheel stone water morning farmer market bread harvest valley road bridge "
         "village lantern winter summer story letter garden window candle clock").split()


def rss_bytes(pid: int) -> int:
    """RSS of a process and its children (Linux /proc)."""
    total = 0
    pids = [pid] + _children(pid)
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


async def wait_idle(client: httpx.AsyncClient, url: str, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    stats: dict = {}
    while time.monotonic() < deadline:
        stats = (await client.get(url + "/stats", timeout=10)).json()
        if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0 and stats["kv_cache_usage"] == 0:
            break
        await asyncio.sleep(0.5)
    return stats


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, tally: Counter) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))
    stream = rng.random() < 0.5
    disconnect = rng.random() < 0.2
    body = {"prompt": prompt, "max_tokens": rng.randint(16, 128), "temperature": rng.choice([0.0, 0.8]),
            "stream": stream}
    try:
        if stream:
            async with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
                tally[str(response.status_code)] += 1
                chunks = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks += 1
                        tally["tokens"] += 1
                        if '"error"' in line:
                            tally["stream_error_event"] += 1
                        if disconnect and chunks >= 3:
                            tally["client_disconnect"] += 1
                            return  # leaving the block closes the connection mid-stream
        else:
            timeout = rng.uniform(0.5, 5.0) if disconnect else 300
            try:
                response = await client.post(url + "/v1/completions", json=body, timeout=timeout)
            except httpx.TimeoutException:
                tally["client_disconnect"] += 1
                return
            tally[str(response.status_code)] += 1
            if response.status_code == 200:
                tally["tokens"] += response.json()["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        tally["transport_error:" + type(exc).__name__] += 1


async def soak(url: str, server_pid: Optional[int], duration_s: float, clients: int, seed: int) -> dict:
    tally: Counter = Counter()
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 8)) as client:
        idle_before = await wait_idle(client, url)
        rss_before = rss_bytes(server_pid) if server_pid else None
        deadline = time.monotonic() + duration_s

        async def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < deadline:
                await one_request(client, url, rng, tally)

        started = time.monotonic()
        await asyncio.gather(*(worker(i) for i in range(clients)))
        elapsed = time.monotonic() - started
        idle_after = await wait_idle(client, url)
        health = (await client.get(url + "/health", timeout=10)).status_code
        rss_after = rss_bytes(server_pid) if server_pid else None
    statuses = {k: v for k, v in tally.items() if k.isdigit()}
    return {
        "duration_s": round(elapsed, 1), "clients": clients, "outcomes": dict(tally),
        "num_5xx": sum(v for k, v in statuses.items() if k.startswith("5")),
        "num_unanswered": sum(v for k, v in tally.items() if k.startswith("transport_error")),
        "health_after": health,
        "kv_cache_usage_before": idle_before.get("kv_cache_usage"),
        "kv_cache_usage_after": idle_after.get("kv_cache_usage"),
        "rss_before_mb": None if rss_before is None else round(rss_before / 2**20, 1),
        "rss_after_mb": None if rss_after is None else round(rss_after / 2**20, 1),
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:8000")
    parser.add_argument("--server-pid", type=int, default=None, help="for RSS before and after (with children)")
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--clients", type=int, default=128, help="concurrent clients (about 2x --max-num-seqs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = asyncio.run(soak(args.url.rstrip("/"), args.server_pid, args.duration_s, args.clients, args.seed))
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["num_5xx"] == 0 and result["num_unanswered"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
