"""Host memory a process holds, and handing memory freed during model loading back to the OS.

Loading a GGUF streams every tensor through numpy and torch once (dequantized to check the kept
blocks, packed into the kernel's layout); glibc keeps most of those freed pages in its heap, so
without a trim the engine process would carry ~400 MB it no longer uses for its whole life.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional


def process_rss_bytes(pid: Optional[int] = None) -> Optional[int]:
    """Resident set size of `pid` (default: this process) from /proc; None where /proc is missing or
    the process is gone."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_freed_memory() -> None:
    """Return free heap pages to the OS (glibc's malloc_trim; a no-op elsewhere). No garbage collection
    here: finalizers of unrelated objects (a zmq context's term()) must not run at this point."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def freeze_startup_heap() -> None:
    """Take every object alive now (modules, the model's and tokenizer's Python objects, the block pool)
    out of the cyclic garbage collector's sight, once a serving process has started. A full collection
    walks every tracked object (hundreds of thousands in an engine core, a quarter-second pause on 2
    cores), a pause that stalls a step or every stream's next token whenever the
    oldest generation comes due. Frozen, a collection walks only what was made since. vLLM's engine
    core freezes its startup heap too. Without a collection first (see release_freed_memory): the
    garbage left at this point was measured at a few dozen objects, which stay."""
    gc.freeze()


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """What the engine process holds once it is ready to serve, in bytes."""

    weights: int  # parameters and block-quantized storage, counted once per storage (a tied head once)
    buffers: int  # the model's other tensors: rotary tables (max_model_len x rotary dims, per rope)
    kv_cache: int  # the KV cache tensors (device memory on accelerators, host memory on CPU)
    activations: int  # resident growth over the warm-up step (CPU; at most WARM_UP_TOKENS tokens)
    rss: Optional[int]  # the process's resident set size after the warm-up
    warm_up_tokens: int = 0  # the warm-up step's tokens (0: none ran here)

    def describe(self) -> str:
        def mib(n: int) -> str:
            return f"{n / 2**20:.1f} MiB"

        text = (f"weights {mib(self.weights)}, rotary tables {mib(self.buffers)}, KV cache {mib(self.kv_cache)}, "
                f"activations {mib(self.activations)}"
                + (f" (a {self.warm_up_tokens}-token step)" if self.warm_up_tokens else ""))
        if self.rss is not None:
            rest = self.rss - self.weights - self.buffers - self.kv_cache - self.activations
            text += f"; process RSS {mib(self.rss)} (runtime, tokenizer and kernels: {mib(max(rest, 0))})"
        return text
