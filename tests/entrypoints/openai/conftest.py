"""Server fixtures: the real OpenAI server started as a subprocess on a free port.

One SmolLM2 server (the default model, API keys on) is shared by the whole session, since its start
costs ~20 s; tests that must stop a server start their own on the tiny random Llama.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Optional

import httpx
import pytest

from server_process import ServerProcess

API_KEY = "tm-test-key"
SECOND_API_KEY = "tm-test-key-2"
MAX_BODY_BYTES = 1_000_000


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
