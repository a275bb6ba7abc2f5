"""The API process runs on uvloop (a declared dependency), unless told to keep asyncio's own loop."""
from __future__ import annotations

import asyncio

import uvloop

from tokenmill.entrypoints.openai import event_loop


async def _loop_class() -> type:
    return type(asyncio.get_running_loop())


def test_the_api_process_loop_is_uvloop(monkeypatch):
    monkeypatch.delenv("TOKENMILL_EVENT_LOOP", raising=False)
    assert issubclass(event_loop.run(_loop_class()), uvloop.Loop)


def test_tokenmill_event_loop_asyncio_keeps_asyncios_loop(monkeypatch):
    monkeypatch.setenv("TOKENMILL_EVENT_LOOP", "asyncio")
    loop_class = event_loop.run(_loop_class())
    assert not issubclass(loop_class, uvloop.Loop) and issubclass(loop_class, asyncio.BaseEventLoop)
