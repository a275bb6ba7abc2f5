"""The gate every HTTP request passes: request id, shutdown draining, API keys and their request rate
limits, body size, in-flight count.

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware, because the latter wraps `receive`
and would hide the client's disconnect from the handlers that must abort on it. Rejections happen here,
before FastAPI parses anything, so a client without a key gets 401 even for a malformed body.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence

from tokenmill.entrypoints.openai.errors import error_body
from tokenmill.entrypoints.openai.rate_limit import REASON, KeyPolicy, RateLimiter
from tokenmill.errors import RateLimitExceededError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Past this many bytes beyond the limit we stop reading an oversize body and just answer 413;
# reading a little keeps small-oversize clients from seeing a reset instead of the answer.
_DRAIN_EXTRA_BYTES = 16 * 1024 * 1024
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=\-]{1,128}$")
_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass
class ServerLifecycle:
    """Shared between the middleware and the uvicorn server that drains on SIGTERM."""

    draining: bool = False
    inflight: int = 0


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, lifecycle: ServerLifecycle, api_keys: Sequence[str] = (),
                 max_body_bytes: Optional[int] = None, limiter: Optional[RateLimiter] = None,
                 on_rejected: Optional[Callable[[str], None]] = None,
                 on_response: Optional[Callable[[str, str, int], None]] = None) -> None:
        """on_response(path, method, status): called once per answered request (its status as sent)."""
        self.app = app
        self.on_response = on_response
        self.lifecycle = lifecycle
        # Without a limiter (build_app makes one from --api-key and --api-keys-file): keys without limits.
        self.limiter = limiter if limiter is not None else RateLimiter({key: KeyPolicy() for key in api_keys if key})
        self.max_body_bytes = max_body_bytes
        self.on_rejected = on_rejected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        send = _with_header(send, b"x-request-id", request_id.encode())
        if self.on_response is not None:
            send = _observing_status(send, scope, self.on_response)
        # /health answers for itself (it tells a dead engine core from a shutdown).
        if self.lifecycle.draining and scope["path"] != "/health":
            await _reject(send, 503, "the server is shutting down", "service_unavailable", "shutting_down",
                          [(b"connection", b"close")])
            return
        if self.limiter and _is_api_path(scope["path"]):
            key = self._authorized(scope)
            if key is None:
                await _reject(send, 401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                              "authentication_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                return
            scope["state"]["api_key"] = key
            if scope.get("method") == "POST":
                try:
                    self.limiter.charge_request(key)
                except RateLimitExceededError as exc:
                    if self.on_rejected is not None:
                        self.on_rejected(REASON)
                    await _reject(send, 429, exc.message, exc.error_type, exc.code or REASON,
                                  [(b"retry-after", str(int(exc.retry_after_s)).encode())])
                    return
        if self.max_body_bytes is not None and scope.get("method") in _METHODS_WITH_BODY:
            body, too_large, disconnected = await self._read_body(scope, receive)
            if disconnected:
                return
            if too_large:
                await _reject(send, 413, f"the request body is larger than the limit of {self.max_body_bytes} bytes",
                              "invalid_request_error", "request_too_large", [(b"connection", b"close")])
                return
            receive = _replay(body, receive)
        self.lifecycle.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.inflight -= 1

    def _authorized(self, scope: Scope) -> Optional[str]:
        """The key the request presents, if it is one of ours (compared in constant time)."""
        token = bearer_token(_header(scope, b"authorization") or b"")
        return None if token is None else self.limiter.match(token)

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, bool, bool]:
        """(body, too large, client disconnected); an oversize body is read and dropped, up to a cap."""
        limit = self.max_body_bytes or 0
        declared = _header(scope, b"content-length")
        too_large = declared is not None and declared.isdigit() and int(declared) > limit
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", too_large, True
            data = message.get("body", b"")
            size += len(data)
            too_large = too_large or size > limit
            if not too_large:
                chunks.append(data)
            if not message.get("more_body", False) or size > limit + _DRAIN_EXTRA_BYTES:
                return b"".join(chunks), too_large, False


def bearer_token(authorization: bytes) -> Optional[bytes]:
    """The token of an 'Authorization: Bearer <token>' header value, or None for another scheme."""
    scheme, _, token = authorization.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


def _is_api_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def _header(scope: Scope, name: bytes) -> Optional[bytes]:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def _request_id(scope: Scope) -> str:
    given = _header(scope, b"x-request-id")
    if given is not None:
        text = given.decode("latin-1").strip()
        if _REQUEST_ID.match(text):
            return text
    return uuid.uuid4().hex


def _with_header(send: Send, name: bytes, value: bytes) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", []) if h[0].lower() != name]
            message = {**message, "headers": headers + [(name, value)]}
        await send(message)

    return wrapped


def _replay(body: bytes, receive: Receive) -> Receive:
    """Hands the buffered body to the app once, then the real channel, which reports disconnects."""
    delivered = False

    async def replayed() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _reject(send: Send, status: int, message: str, error_type: str, code: str,
                  extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(error_body(message, error_type, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _observing_status(send: Send, scope: Scope, on_response: Callable[[str, str, int], None]) -> Send:
    """`send`, reporting the response's status once, as it starts (refusals here and the app's answers alike)."""

    async def observed(message) -> None:
        if message["type"] == "http.response.start":
            on_response(scope["path"], scope.get("method", ""), int(message["status"]))
        await send(message)

    return observed
