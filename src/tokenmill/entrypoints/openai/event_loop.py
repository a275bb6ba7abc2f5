"""The API process's event loop: uvloop (a dependency everywhere but Windows, as in `uvicorn[standard]`)
where it imports, else asyncio's own.

Every stream's token costs the API process a few event-loop callbacks and a socket write; uvloop does
those in C, so the loop's work per engine step (and the wait a /health probe sees behind it) is shorter.
vLLM's API server runs on uvloop for the same reason.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main), on uvloop when it imports (TOKENMILL_EVENT_LOOP=asyncio keeps asyncio's loop)."""
    if os.environ.get("TOKENMILL_EVENT_LOOP", "auto") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)
