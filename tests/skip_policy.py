"""Which skips a test run may report: each skip reason must be explained by this machine (a CPU feature it
lacks, no CUDA device, no /proc) or by an opt-in marker; any other skip (an extra not installed, a tool
missing, a fixture that gave up) fails the run, so the suite cannot pass by skipping. `make test` installs
every extra and tool the suite needs. TOKENMILL_ALLOW_SKIPS=1 lets a partial local setup report them
without failing."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Callable


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


def _lacks(*flags: str) -> Callable[[], bool]:
    return lambda: not set(flags) <= _cpu_flags()


def _has(*flags: str) -> Callable[[], bool]:
    return lambda: set(flags) <= _cpu_flags()


def _old_triton() -> bool:
    """A triton below 3.7 (the one a CUDA torch pins) cannot run its interpreter under NumPy 2."""
    try:
        from importlib.metadata import version

        major, minor = (int(part) for part in version("triton").split(".")[:2])
    except Exception:  # noqa: BLE001 - not installed: then the skip is not explained
        return False
    return (major, minor) < (3, 7)


# (reason pattern, whether this machine explains it, what explains it)
EXPLAINED: list[tuple[str, Callable[[], bool], str]] = [
    (r"needs a CUDA device", _no_cuda, "no CUDA device"),
    (r"select it with -m fuzz", lambda: True, "opt-in marker"),
    (r"no AMX-BF16 on this CPU", _lacks("amx_bf16"), "no amx_bf16"),
    (r"no AMX-BF16, and no MKL bfloat16 GEMM", _lacks("amx_bf16"), "no amx_bf16"),
    (r"no AMX-BF16 tiles or AVX-512 BF16", _lacks("avx512_bf16"), "no avx512_bf16"),
    (r"no AVX-512 BF16 on this CPU", _lacks("avx512_bf16"), "no avx512_bf16"),
    (r"bfloat16-int8 fell back on this CPU", _lacks("amx_bf16"), "no amx_bf16"),
    (r"bfloat16 products over a bfloat16 cache here", _has("avx512_bf16"), "avx512_bf16: tested in its own file"),
    (r"neither AVX2 nor AVX-512 VNNI", _lacks("avx2"), "no avx2"),
    (r"no AVX-512 VNNI \+ VBMI", lambda: not {"avx512_vnni", "avx512vbmi"} <= _cpu_flags(), "no avx512_vnni/vbmi"),
    (r"this CPU has no AVX2", _lacks("avx2"), "no avx2"),
    (r"needs an AVX-512 CPU", _lacks("avx512f"), "no avx512f"),
    (r"/proc|madvise", lambda: not sys.platform.startswith("linux"), "not Linux"),
    (r"no CPU flash kernel with log-sum-exp", lambda: True, "this torch build's kernels"),
    (r"needs triton >= 3\.7", _old_triton, "a triton below 3.7 installed"),
    (r"cpu kernels switched off", lambda: bool(os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS")),
     "TOKENMILL_DISABLE_CPU_KERNELS"),
]


def unexplained(reasons: list[str]) -> list[str]:
    """The skip reasons nothing in EXPLAINED accounts for on this machine."""
    return [reason for reason in reasons
            if not any(re.search(pattern, reason) and applies() for pattern, applies, _ in EXPLAINED)]
