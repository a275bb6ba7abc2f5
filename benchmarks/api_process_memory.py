"""The server's API process: startup time and resident memory (the engine core's too, for scale).

    python -m benchmarks.api_process_memory [--runs 2] [-- extra `tokenmill serve` arguments]

Starts `tokenmill serve` (the embedded default model unless told otherwise) with the code this
interpreter imports (PYTHONPATH picks a checkout), times the first GET /health answered 200, reads the
API process's RSS (/proc/<pid>/status VmRSS, what `ps -o rss` shows) and whether torch is mapped into
it, then sends a few chat completions (8 requests, 4 at a time, 32 tokens each) and reads its RSS and
peak RSS (VmHWM) again, with /stats' memory section. Prints one JSON line per run.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.server_ready import wait_until_serving


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_once(extra: list[str], requests: int = 8, concurrency: int = 4) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--port", str(port),
                             "--disable-access-log", "--disable-log-requests", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_serving(proc, url, timeout_s=float("inf"), poll_s=0.05)
        ready_s = time.monotonic() - started
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        result = {"startup_to_health_s": round(ready_s, 2), "torch_mapped": "libtorch" in maps,
                  "api_rss_mib_at_start": round(_status_kib(proc.pid, "VmRSS") / 1024, 1)}
        body = {"model": httpx.get(url + "/v1/models").json()["data"][0]["id"], "max_tokens": 32, "temperature": 0,
                "messages": [{"role": "user", "content": "Write a short poem about the sea."}]}

        def chat(_):
            return httpx.post(url + "/v1/chat/completions", json=body, timeout=300).status_code

        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            codes = list(pool.map(chat, range(requests)))
        assert codes == [200] * requests, codes
        memory = httpx.get(url + "/stats").json()["memory"]
        result.update(api_rss_mib_after_requests=round(_status_kib(proc.pid, "VmRSS") / 1024, 1),
                      api_peak_rss_mib=round(_status_kib(proc.pid, "VmHWM") / 1024, 1),
                      engine_rss_mib=round((memory.get("engine_rss_bytes") or 0) / 2**20, 1))
        return result
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="startup time and RSS of tokenmill serve's API process")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("serve_args", nargs="*", help="extra `tokenmill serve` arguments (after --)")
    args = parser.parse_args(argv)
    for _ in range(args.runs):
        print(json.dumps(run_once(args.serve_args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
