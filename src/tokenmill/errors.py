"""The typed exception hierarchy. The server maps these to OpenAI error bodies."""
from __future__ import annotations


class TokenmillError(Exception):
    """Base class of every error tokenmill raises on purpose."""

    http_status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(TokenmillError, ValueError):
    """Bad input from a user: wrong value, out of range, too long."""

    http_status = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(TokenmillError):
    http_status = 404
    error_type = "not_found_error"


class RequestRejectedError(TokenmillError):
    """Admission control refused the request (queue full, waited too long)."""

    http_status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float = 1.0, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, param, code)
        self.retry_after_s = retry_after_s


class RateLimitExceededError(RequestRejectedError):
    """An API key went over its requests or tokens per minute (see entrypoints/openai/rate_limit.py)."""

    error_type = "rate_limit_exceeded"


class ModelUnavailableError(RequestRejectedError):
    """The requested model is loading or being unloaded (a server of several models): 503 with Retry-After."""

    http_status = 503
    error_type = "service_unavailable"


class RequestTimeoutError(TokenmillError):
    """The request ran past the server's --request-timeout, or the engine stopped producing its output."""

    http_status = 504
    error_type = "timeout"


class AdminAuthError(TokenmillError):
    """An /admin request without the server's admin key."""

    http_status = 401
    error_type = "authentication_error"


class ServiceUnavailableError(TokenmillError):
    """The server cannot finish the request now (it is shutting down)."""

    http_status = 503
    error_type = "service_unavailable"


class EngineDeadError(TokenmillError):
    """The engine loop died; the server answers 503 until restarted."""

    http_status = 503
    error_type = "service_unavailable"


class EngineFailedError(TokenmillError):
    """The engine core died while this request was in flight (the server then exits to be restarted)."""

    http_status = 500
    error_type = "internal_server_error"


class ModelLoadError(TokenmillError):
    """The model could not be found or loaded (bad path, unsupported architecture)."""

    http_status = 500
    error_type = "model_load_error"


class MissingDependencyError(TokenmillError):
    """An optional dependency (an extra such as tokenmill[bench]) is not installed."""

    http_status = 500
    error_type = "internal_error"
