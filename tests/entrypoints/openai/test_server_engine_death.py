"""The engine core process killed under load: requests in flight end with errors (never hang),
/health turns 503 at once, and the server exits non-zero for its supervisor to restart it."""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from proc_util import child_pids, kill_under_load


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the engine core process")
def test_killed_engine_core_fails_requests_in_flight_and_exits_non_zero(start_server, tiny_llama_dir):
    server = start_server(["--model", str(tiny_llama_dir), "--max-model-len", "1024", "--num-kv-blocks", "128"])
    url = server.url
    (core_pid,) = child_pids(server.proc.pid)
    killed_at, events, (status, payload) = kill_under_load(url, core_pid)
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 503 and time.monotonic() - killed_at < 2.0
    assert health.json()["error"]["code"] == "engine_dead"
    # The stream ends with an error event, then [DONE].
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead" and error["message"]
    assert status == 500 and payload["error"]["code"] == "engine_dead"
    assert server.proc.wait(timeout=30) == 1
