"""Process helpers for tests that check which processes a server leaves behind (Linux /proc)."""
from __future__ import annotations

from pathlib import Path


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


def is_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
