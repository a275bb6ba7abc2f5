"""One HTTP request, carried as plain data, run through an ASGI app in-process.

The Ray Serve front deployment reads a request, decides which engine replica serves it, and hands it
over as an `HttpRequest` (a method call between Ray actors, not a socket); the replica runs it through
tokenmill's own FastAPI app with `call_app` and streams back what the app sends: a `ResponseStart`
first, then the body's chunks as they come (SSE events of a stream arrive one by one).
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Union

# How long an app that has sent its last byte gets to return before it is cancelled.
APP_EXIT_GRACE_S = 5.0


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: Optional[tuple[str, int]] = None


@dataclass(slots=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]


def _scope(request: HttpRequest) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method.upper(), "scheme": "http", "path": request.path,
        "raw_path": request.path.encode("utf-8"), "query_string": request.query_string, "root_path": "",
        "headers": list(request.headers), "client": request.client, "server": None,
    }


async def call_app(app: Any, request: HttpRequest) -> AsyncIterator[Union[ResponseStart, bytes]]:
    """Runs `request` through the ASGI `app`: yields the response start, then non-empty body chunks.

    The app sees the whole body at once, then a disconnect when the caller stops reading early (a
    client that went away), which tokenmill's handlers answer by aborting the request in the engine.
    """
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(_scope(request), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    finished = False
    try:
        while True:
            message = await messages.get()
            if message is None:  # the app returned (or raised) before finishing its response
                task.result()
                raise RuntimeError("the app returned without completing its response")
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    finished = True
                    break
    finally:
        gone.set()
        if not finished:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError, Exception):
            await asyncio.wait_for(task, APP_EXIT_GRACE_S)
