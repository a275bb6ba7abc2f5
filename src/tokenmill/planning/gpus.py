"""Known accelerators for `tokenmill plan`: memory as the driver reports it and peak memory bandwidth.

Memory is what `nvidia-smi` / `rocm-smi` show as total (a little under the marketing figure for some
cards); bandwidth is the vendor's peak for the usual variant (SXM for A100/H100/H200).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tokenmill.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str
    memory_gib: float
    bandwidth_gbps: Optional[float]  # GB/s; None when unknown (e.g. a CPU given by --memory-gib)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)


KNOWN_GPUS: dict[str, DeviceSpec] = {spec.name.lower(): spec for spec in (
    DeviceSpec("A100-40GB", 40.0, 1555.0),
    DeviceSpec("A100-80GB", 80.0, 2039.0),
    DeviceSpec("H100-80GB", 79.6, 3350.0),
    DeviceSpec("H200", 140.4, 4800.0),
    DeviceSpec("L4", 22.5, 300.0),
    DeviceSpec("L40S", 45.0, 864.0),
    DeviceSpec("A10G", 22.5, 600.0),
    DeviceSpec("RTX-4090", 24.0, 1008.0),
    DeviceSpec("MI300X", 192.0, 5300.0),
)}

_ALIASES = {"a100": "a100-80gb", "a100-40g": "a100-40gb", "a100-80g": "a100-80gb", "h100": "h100-80gb",
            "h100-sxm": "h100-80gb", "h200-141gb": "h200", "4090": "rtx-4090", "rtx4090": "rtx-4090",
            "l40s-48gb": "l40s", "mi300": "mi300x"}


def find_gpu(name: str) -> DeviceSpec:
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key not in KNOWN_GPUS:
        known = ", ".join(spec.name for spec in KNOWN_GPUS.values())
        raise InvalidRequestError(f"unknown GPU {name!r}; known: {known} (or give --memory-gib)")
    return KNOWN_GPUS[key]


def custom_device(memory_gib: float, bandwidth_gbps: Optional[float] = None) -> DeviceSpec:
    if not memory_gib > 0:
        raise InvalidRequestError("--memory-gib must be positive")
    return DeviceSpec(f"{memory_gib:g} GiB device", memory_gib, bandwidth_gbps)
