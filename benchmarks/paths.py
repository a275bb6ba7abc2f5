"""Where the tooling reads its workload and writes its reports: relative to this checkout."""
from __future__ import annotations

from pathlib import Path

DEFAULT_WORKLOAD_NAME = "workload-64.jsonl"


def repo_root() -> Path:
    """The checkout holding this package (<root>/benchmarks/paths.py)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def default_workload_path() -> Path:
    """<repo root>/../shared/bench/workload-64.jsonl, the fixed throughput workload."""
    return repo_root().parent / "shared" / "bench" / DEFAULT_WORKLOAD_NAME
