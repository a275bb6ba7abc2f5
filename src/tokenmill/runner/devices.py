"""Which device the engine runs on, and why: an explicit `--device cuda` that torch cannot use is refused
before anything loads, with the cause (a CPU-only torch build, no device visible, a driver torch cannot
use); the default falls back to the CPU, with a warning when the machine has an NVIDIA driver torch cannot
use (the reason is logged, and reported on /stats as `device`)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from tokenmill.errors import ModelLoadError

NVIDIA_DRIVER_VERSION = Path("/proc/driver/nvidia/version")


def _nvidia_driver() -> Optional[str]:
    """The loaded NVIDIA kernel driver's version line, or None where none is loaded."""
    try:
        return NVIDIA_DRIVER_VERSION.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return None


def cuda_problem(driver: Optional[str] = None) -> Optional[str]:
    """Why torch cannot run on a CUDA device here, or None when it can (`driver`: the loaded NVIDIA driver's
    version line, read here when not given)."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (f"this torch build ({torch.__version__}) has no CUDA support (a CPU-only wheel); install a CUDA "
                "build of torch to use the GPU")
    if torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every device"
    driver = driver or _nvidia_driver()
    if driver is None:
        return "torch sees no CUDA device and no NVIDIA driver is loaded (no /proc/driver/nvidia)"
    return (f"torch (built for CUDA {torch.version.cuda}) cannot use the loaded NVIDIA driver ({driver}): the "
            "driver may be older than that CUDA version, or the device is unavailable")


def choose_device(name: Optional[str]) -> tuple[torch.device, str]:
    """(the device, why it was chosen). Raises ModelLoadError for an explicit CUDA device torch cannot use."""
    if name is not None:
        device = torch.device(name)
        if device.type == "cuda":
            problem = cuda_problem()
            if problem is not None:
                raise ModelLoadError(f"--device {name}: {problem}")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ModelLoadError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
        return device, "--device"
    if torch.cuda.is_available():
        return torch.device("cuda"), "default: a CUDA device torch can use"
    driver = _nvidia_driver()
    problem = cuda_problem(driver) if driver is not None else None
    if problem is not None:
        return torch.device("cpu"), f"default, on the CPU although an NVIDIA driver is loaded: {problem}"
    return torch.device("cpu"), "default: no CUDA device"
