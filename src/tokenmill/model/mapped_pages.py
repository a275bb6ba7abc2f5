"""Releasing pages of a read-only file mapping once their contents are copied out: a checkpoint is mapped
whole (GGUF by gguf-py, safetensors by safetensors), and every page read stays in the process's resident set
until the mapping closes, so a multi-GB file would sit beside the weights built from it for the whole load.
madvise(MADV_DONTNEED) drops them from the resident set; they stay in the page cache, and read back from
there if touched again."""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import Any

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4  # Linux's value


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def file_mappings(path: str) -> list[tuple[int, int]]:
    """The address ranges this process maps from `path` (from /proc/self/maps; none where that is absent)."""
    target = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip() == target:
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        pass
    return ranges


def release_mapped_pages(address: int, nbytes: int) -> None:
    """Drops the whole pages inside [address, address + nbytes) of a read-only file mapping from the
    resident set (a neighbour's partial pages stay); a no-op where madvise is not available. Only for
    memory mapped from a file read-only: anonymous memory would read back as zeros."""
    begin = -(-address // _PAGE) * _PAGE
    end = (address + nbytes) // _PAGE * _PAGE
    if _LIBC is not None and end > begin:
        _LIBC.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), _MADV_DONTNEED)
