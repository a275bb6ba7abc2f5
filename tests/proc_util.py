"""Process helpers for tests that check which processes a server leaves behind (Linux /proc)."""
from __future__ import annotations

import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports that nothing listens on now. The sockets stay bound until all are
    chosen: separate `free_port()` calls may hand back the same just-released port twice."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def child_pids(pid: int) -> list[int]:
    """The pids whose parent is `pid` (field 4 of /proc/PID/stat)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry.name))
    return children


def descendants(pid: int) -> set[int]:
    """Every process below `pid`: its children, theirs, and so on."""
    found, stack = set(), [pid]
    while stack:
        for child in child_pids(stack.pop()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def stop_process(proc: subprocess.Popen, timeout_s: float, sig: int | None = None) -> None:
    """Signals `proc` (SIGTERM unless `sig` says) and waits for it to exit; kills it after timeout_s."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM if sig is None else sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def thread_niceness(pid: int) -> set[int]:
    """The niceness of each of the process's threads (field 19 of /proc/PID/task/TID/stat)."""
    values = set()
    for task in (Path("/proc") / str(pid) / "task").iterdir():
        try:
            values.add(int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]))
        except OSError:
            continue  # a thread that ended meanwhile
    return values


def is_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def still_alive(pids, timeout_s: float) -> list[int]:
    """Waits up to timeout_s for the processes to exit; the pids still running then."""
    import time

    deadline = time.monotonic() + timeout_s
    while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return sorted(pid for pid in pids if is_alive(pid))


def kill_under_load(url: str, pid: int) -> tuple[float, list[str], tuple]:
    """A non-streaming and a streaming 900-token completion in flight; `pid` is SIGKILLed after the stream's
    5th event. Returns (when it was killed, the stream's data events, (status, body) of the non-streaming)."""
    import os
    import signal
    import threading
    import time

    import httpx

    results: dict = {}

    def non_streaming() -> None:
        response = httpx.post(url + "/v1/completions", timeout=60,
                              json={"prompt": "Hello", "max_tokens": 900, "ignore_eos": True})
        results["full"] = (response.status_code, response.json())

    thread = threading.Thread(target=non_streaming)
    thread.start()
    body = {"prompt": "Hi", "max_tokens": 900, "ignore_eos": True, "stream": True}
    killed_at = None
    events: list[str] = []
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if len(events) == 5:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
    thread.join(60)
    assert killed_at is not None, "the stream ended before the kill"
    return killed_at, events, results["full"]
