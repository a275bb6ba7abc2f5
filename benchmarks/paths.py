"""Where the tooling reads its workload and writes its reports: relative to this checkout."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Sequence

DEFAULT_WORKLOAD_NAME = "workload-64.jsonl"


def repo_root() -> Path:
    """The checkout holding this package (<root>/benchmarks/paths.py)."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def default_workload_path() -> Path:
    """<repo root>/../shared/bench/workload-64.jsonl, the fixed throughput workload."""
    return repo_root().parent / "shared" / "bench" / DEFAULT_WORKLOAD_NAME


def module_command(module: str, argv: Sequence[str]) -> str:
    """The `python -m MODULE ARGS` line that reproduces a run (the interpreter relative to the cwd)."""
    python = sys.executable
    try:
        python = os.path.relpath(python)
    except ValueError:  # another drive (Windows)
        pass
    return f"{python} -m {module} {shlex.join(argv)}".rstrip()
