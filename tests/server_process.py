"""A tokenmill server started as a subprocess on a free port, for live-server tests: the OpenAI server
fixtures (tests/entrypoints/openai/conftest.py), the dashboard's browser test and the reverse-proxy test."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from proc_util import free_port, stop_process

STARTUP_TIMEOUT_S = 240.0


class ServerProcess:
    """`python -m tokenmill.entrypoints.openai.api_server ...` (or another `entry`, such as the `tokenmill
    serve` CLI) with its output in a log file."""

    def __init__(self, args: list[str], log_dir: Path, env: Optional[dict[str, str]] = None,
                 api_key: Optional[str] = None,
                 entry: tuple[str, ...] = ("-m", "tokenmill.entrypoints.openai.api_server")) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.log_path = log_dir / f"server-{self.port}.log"
        cmd = [sys.executable, *entry, "--host", "127.0.0.1", "--port", str(self.port), *args]
        environment = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
        environment.update(env or {})
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=environment)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> "ServerProcess":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def request_log(self) -> list[dict]:
        """The JSON lines of the tokenmill.requests logger."""
        records = []
        for line in self.log_text().splitlines():
            if line.startswith("{") and '"request_finished"' in line:
                records.append(json.loads(line))
        return records

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", timeout=10).json()

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        """Polls /stats until nothing runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout_s
        stats = self.stats()
        while time.monotonic() < deadline:
            if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0 \
                    and stats["kv_cache_usage"] == 0:
                break
            time.sleep(0.05)
            stats = self.stats()
        return stats

    def stop(self, timeout_s: float = 60.0) -> Optional[int]:
        stop_process(self.proc, timeout_s)
        self._log.close()
        return self.proc.returncode
