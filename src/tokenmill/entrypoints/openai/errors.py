"""Every failure leaves the server as an OpenAI error body: {"error": {"message", "type", "param", "code"}}.

Messages are built from exception text we wrote ourselves or from pydantic's field messages, never from
tracebacks, so no file path or internal detail reaches a client.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from tokenmill.errors import RequestRejectedError, TokenmillError

logger = logging.getLogger(__name__)

_HTTP_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


def error_body(message: str, error_type: str, param: Optional[str] = None,
               code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(status: int, message: str, error_type: Optional[str] = None, param: Optional[str] = None,
                   code: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    error_type = error_type or _HTTP_ERROR_TYPES.get(status, "internal_error")
    return JSONResponse(error_body(message, error_type, param, code), status_code=status, headers=headers)


def tokenmill_error_response(exc: TokenmillError) -> JSONResponse:
    headers = None
    if isinstance(exc, RequestRejectedError):
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    # 503 and 504 messages say why (shutting down, timed out); other 5xx hide their detail.
    message = exc.message if exc.http_status < 500 or exc.http_status in (503, 504) else "internal server error"
    return error_response(exc.http_status, message, exc.error_type, exc.param, exc.code, headers)


# Pydantic puts union members and model names into `loc` ("str", "list[int]", "ChatMessage",
# "function-after[...]"); they are not field names, so they are dropped from `param`.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none)$|[\[\]\-]|^[A-Z]")


def _field_path(loc: Sequence[Any]) -> Optional[str]:
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] in ("body", "query", "path") else loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and not _TYPE_TAG.search(item):
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def _validation_message(error: dict[str, Any], param: Optional[str]) -> str:
    if error.get("type") == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": ")
    msg = str(error.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if error.get("type") == "invalid_text":  # the message already names the field
        return msg
    if error.get("type") == "missing":
        return f"'{param}' is required" if param else "a required field is missing"
    return f"invalid value for '{param}': {msg}" if param else msg


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors()) or [{"msg": "invalid request", "loc": ()}]
    error = errors[0]
    if error.get("type") == "json_invalid":
        return error_response(400, _validation_message(error, None), code="invalid_json")
    # A model-level check (the shared text check) names its field in ctx; otherwise the location does.
    param = (error.get("ctx") or {}).get("param") or _field_path(error.get("loc", ()))
    if param is None and error.get("type") in ("model_attributes_type", "missing", "dict_type", "model_type"):
        if isinstance(error.get("input"), (bytes, bytearray)):
            # FastAPI parses a body as JSON only under a JSON content type (no header at all is refused too,
            # against cross-site requests); `curl -d` sends form-urlencoded, the usual way to get here.
            return error_response(400, "the request body must be JSON sent with 'Content-Type: application/json'",
                                  code="invalid_content_type")
        return error_response(400, "the request body must be a JSON object", code="invalid_body")
    code = {"missing": "missing_field", "invalid_text": "invalid_text"}.get(error.get("type"), "invalid_value")
    return error_response(400, _validation_message(error, param), param=param, code=code)


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(TokenmillError)
    async def _tokenmill_error(_: Request, exc: TokenmillError) -> JSONResponse:
        if exc.http_status >= 500:
            logger.error("request failed: %s", exc)
        return tokenmill_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # The traceback goes to the server log only.
        logger.exception("unexpected error while serving a request")
        return error_response(500, "internal server error", "internal_error")
