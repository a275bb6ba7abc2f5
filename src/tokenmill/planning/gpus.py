"""Known accelerators for `tokenmill plan`: memory as the driver reports it and peak memory bandwidth.

Memory is what `nvidia-smi` / `rocm-smi` show as total (a little under the marketing figure for some
cards); bandwidth is the vendor's peak for the usual variant (SXM for A100/H100/H200).
"""
from __future__ import annotations

import json
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


def _key(name: str) -> str:
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    return _ALIASES.get(key, key)


def find_gpu(name: str) -> DeviceSpec:
    key = _key(name)
    if key not in KNOWN_GPUS:
        known = ", ".join(spec.name for spec in KNOWN_GPUS.values())
        raise InvalidRequestError(f"unknown GPU {name!r}; known: {known} (or give --memory-gib)")
    return KNOWN_GPUS[key]


CPU_PRICE_KEY = "cpu"  # a --price-table entry for the host a --memory-gib plan describes


def load_price_table(path: str) -> dict[str, float]:
    """The operator's prices per device hour (JSON: {"H100-80GB": 3.0, "L4": 0.8, "cpu": 0.4}; any currency),
    keyed by the known GPUs' names or aliases and "cpu". Prices differ by cloud, region and commitment and
    change over time, so tokenmill ships none: the operator's own table fills the plan's cost."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"cannot read the price table {path}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"{path}: expected a JSON object mapping device names to prices per hour")
    prices: dict[str, float] = {}
    for name, price in data.items():
        key = _key(str(name))
        if key != CPU_PRICE_KEY and key not in KNOWN_GPUS:
            known = ", ".join(spec.name for spec in KNOWN_GPUS.values())
            raise InvalidRequestError(f"{path}: unknown device {name!r} (known: {known}, or {CPU_PRICE_KEY})")
        if isinstance(price, bool) or not isinstance(price, (int, float)) or not price > 0:
            raise InvalidRequestError(f"{path}: the price of {name!r} must be a positive number")
        prices[key] = float(price)
    return prices


def device_price(prices: dict[str, float], device: DeviceSpec) -> Optional[float]:
    """The table's price of this device (a known GPU by name; any other device is the "cpu" host)."""
    key = _key(device.name)
    return prices.get(key if key in KNOWN_GPUS else CPU_PRICE_KEY)


def custom_device(memory_gib: float, bandwidth_gbps: Optional[float] = None) -> DeviceSpec:
    if not memory_gib > 0:
        raise InvalidRequestError("--memory-gib must be positive")
    return DeviceSpec(f"{memory_gib:g} GiB device", memory_gib, bandwidth_gbps)
