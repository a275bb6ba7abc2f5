"""The suite's skip policy (tests/skip_policy.py): a skip passes only where this machine explains it."""
from __future__ import annotations

import torch

from skip_policy import _cpu_flags, unexplained


def test_a_missing_tool_or_extra_is_never_explained():
    reasons = ["Skipped: nginx is not installed (Debian's nginx-light package; `make test` installs it)",
               "Skipped: could not import 'ray': No module named 'ray'",
               "Skipped: random model produced no usable stop text"]
    assert unexplained(reasons) == reasons


def test_cpu_and_device_reasons_follow_this_machine():
    flags = _cpu_flags()
    assert unexplained(["Skipped: needs a CUDA device"]) == ([] if not torch.cuda.is_available()
                                                            else ["Skipped: needs a CUDA device"])
    amx = "Skipped: no AMX-BF16 on this CPU"
    assert unexplained([amx]) == ([amx] if "amx_bf16" in flags else [])
    avx2 = "Skipped: this CPU has no AVX2"
    assert unexplained([avx2]) == ([avx2] if "avx2" in flags else [])
    assert unexplained(["Skipped: long fuzz run: select it with -m fuzz"]) == []
