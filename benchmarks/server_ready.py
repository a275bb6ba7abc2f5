"""Waiting for a `tokenmill serve` the tooling started to answer, shared by the scripts that start one."""
from __future__ import annotations

import subprocess
import time

import httpx


def wait_until_serving(proc: subprocess.Popen, url: str, timeout_s: float = 300.0, poll_s: float = 0.25,
                       log_hint: str = "") -> None:
    """Polls GET {url}/health until it answers 200; raises RuntimeError if the server exits first or is not
    ready within timeout_s (log_hint: where its output went, for the message)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}{log_hint}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s{log_hint}")
