"""`tokenmill check URL`: every check passes on a healthy server and the exit status is 0; a server that
answers 500 to long prompts (a fault injected by a proxy in front of a real server) fails exactly those
checks and exits 1; a missing API key fails the API checks."""
from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import pytest

from tokenmill.bench.check import CheckConfig, run_checks
from tokenmill.entrypoints.cli import main


def test_a_healthy_server_passes_every_check(smollm2_server, capsys):
    code = main(["check", smollm2_server.url, "--api-key", smollm2_server.api_keys[0], "--slo-ttft-ms", "60000"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0, lines
    # What the engine runs on: the device and why, then the numerics it chose (not a check).
    info = [line for line in lines if line.startswith("INFO ")]
    assert len(info) == 1 and info[0].startswith("INFO engine: device cpu (") and "block matmul" in info[0]
    lines = [line for line in lines if not line.startswith("INFO ")]
    assert len(lines) == 11 and all(line.startswith("PASS ") for line in lines[:-1]), lines
    assert lines[-1] == "OK: 10 of 10 checks passed"
    names = [line.split(":")[0] for line in lines[:-1]]
    assert "PASS /health" in names and "PASS /metrics" in names and "PASS structured output (JSON schema)" in names
    assert sum("streamed" in name for name in names) == 3 and any(name.startswith("PASS long prompt") for name in names)
    assert all("TTFT" in line and "tokens/s" in line for line in lines if "streamed" in line)


def test_a_server_failing_long_prompts_fails_the_check(smollm2_server, capsys):
    with FaultyProxy(smollm2_server.url, max_prompt_chars=2000) as proxy:  # longer than the medium prompt
        code = main(["check", proxy.url, "--api-key", smollm2_server.api_keys[0]])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 1
    failed = [line for line in lines if line.startswith("FAIL ")]
    assert len(failed) == 2 and all(line.startswith("FAIL long prompt") and "HTTP 500" in line for line in failed)
    assert lines[-1] == "FAILED: 8 of 10 checks passed"


def test_without_the_api_key_the_api_checks_fail(smollm2_server):
    cfg = CheckConfig(smollm2_server.url)
    assert not run_checks(cfg, report=lambda line: None)
    results = {result.name: result for result in cfg.results}
    assert results["/health"].ok and results["/metrics"].ok
    assert not results["/v1/models"].ok and "HTTP 401" in results["/v1/models"].detail
    assert len(cfg.results) == 3  # no model, nothing to ask


def test_slo_numbers_fail_slow_streams(smollm2_server):
    cfg = CheckConfig(smollm2_server.url, api_key=smollm2_server.api_keys[0], slo_tpot_ms=0.001)
    assert not run_checks(cfg, report=lambda line: None)
    slow = [r for r in cfg.results if not r.ok]
    assert len(slow) == 3 and all("streamed" in r.name and "above the SLO of 0.001 ms" in r.detail for r in slow)


class FaultyProxy:
    """An HTTP proxy to `upstream` that answers 500 (an OpenAI error body) to any completion whose prompt is
    longer than max_prompt_chars, in a thread of its own."""

    def __init__(self, upstream: str, max_prompt_chars: int) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        async def forward(request: Request) -> Response:
            body = await request.body()
            if request.url.path == "/v1/completions" and len(json.loads(body).get("prompt", "")) > max_prompt_chars:
                error = {"error": {"message": "injected fault", "type": "internal_error", "code": None, "param": None}}
                return Response(json.dumps(error), status_code=500, media_type="application/json")
            async with httpx.AsyncClient(timeout=120) as client:
                answer = await client.request(request.method, upstream + request.url.path, content=body,
                                              headers={k: v for k, v in request.headers.items() if k != "host"})
            headers = {k: v for k, v in answer.headers.items() if k not in ("content-length", "transfer-encoding")}
            return Response(answer.content, status_code=answer.status_code, headers=headers)

        app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[self._sock])),
                                        daemon=True)

    def __enter__(self) -> "FaultyProxy":
        self._thread.start()
        for _ in range(100):
            if self._server.started:
                return self
            threading.Event().wait(0.05)
        pytest.fail("the proxy did not start")

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
