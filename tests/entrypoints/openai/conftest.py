"""Server fixtures: the real OpenAI server started as a subprocess on a free port.

One SmolLM2 server (the default model, API keys on) is shared by the whole session, since its start
costs ~20 s; tests that must stop a server start their own on the tiny random Llama.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import httpx
import pytest

API_KEY = "tm-test-key"
SECOND_API_KEY = "tm-test-key-2"
MAX_BODY_BYTES = 1_000_000
STARTUP_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server_log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def smollm2_server(server_log_dir) -> Iterator[ServerProcess]:
    """The default model (SmolLM2-135M-Instruct) in the exact numerics (its greedy tokens are HF's), two API keys,
    a 1 MB body limit."""
    server = ServerProcess(
        ["--numerics", "exact", "--max-model-len", "1024", "--num-kv-blocks", "160", "--api-key", API_KEY,
         "--api-key", SECOND_API_KEY,
         "--max-request-body-bytes", str(MAX_BODY_BYTES), "--shutdown-timeout", "5", "--disable-access-log"],
        server_log_dir, api_key=API_KEY)
    # Tests read these from the fixture: importing conftest from a test module is ambiguous.
    server.api_keys = [API_KEY, SECOND_API_KEY]
    server.max_body_bytes = MAX_BODY_BYTES
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def openai_client(smollm2_server):
    import openai

    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(smollm2_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=smollm2_server.url, headers=smollm2_server.headers, timeout=120) as client:
        yield client


@pytest.fixture
def start_server(server_log_dir) -> Iterator[Callable[..., ServerProcess]]:
    """Starts servers that a test may stop itself; any still running at the end are stopped."""
    started: list[ServerProcess] = []

    def start(args: list[str], env: Optional[dict[str, str]] = None, api_key: Optional[str] = None) -> ServerProcess:
        server = ServerProcess(args, server_log_dir, env=env, api_key=api_key)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def gemma3_270m_server(gemma3_270m_gguf, server_log_dir) -> Iterator[ServerProcess]:
    """`tokenmill serve --model <the real Gemma 3 270M GGUF>` (skipped when its package is not installed)."""
    # 500 blocks of 3 layers: each of the five windowed groups may hold its 512-token window and a 1,024-token
    # chunk (97 blocks), and the global group the whole context.
    server = ServerProcess(["--model", str(gemma3_270m_gguf), "--max-model-len", "512", "--num-kv-blocks", "500",
                            "--disable-access-log"], server_log_dir, entry=("-m", "tokenmill.entrypoints.cli", "serve"))
    try:
        yield server.wait_ready()
    finally:
        server.stop()
