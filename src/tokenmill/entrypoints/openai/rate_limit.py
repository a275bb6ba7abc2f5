"""API keys with a tenant and per-minute limits: requests per minute and tokens per minute per key.

Keys come from `--api-key` (repeatable; no limits, no tenant) and from `--api-keys-file PATH`, a JSON
object mapping each key to its settings (all optional):

    {"sk-alice": {"tenant": "alice", "requests_per_minute": 60, "tokens_per_minute": 20000},
     "sk-batch": {"tenant": "batch", "tokens_per_minute": 100000},
     "sk-admin": {}}

Each limit is a token bucket holding a minute's worth (so a key may burst up to its limit) that
refills continuously. A request is counted when it arrives (POST /v1/*, in the middleware, before the
body is parsed); its tokens are counted once its prompt is tokenized and validated, before it reaches
the engine, as prompt tokens + n x max_tokens (max_tokens filled in as the room left in the context
when the request leaves it out), the most it can cost. Either refusal is a 429 with `Retry-After`
(whole seconds until the bucket holds enough) and an OpenAI error of type `rate_limit_exceeded`.

The key's tenant replaces the request's `user` field, which the `fair` scheduling policy shares
tokens by, and is written into the request log line.
"""
from __future__ import annotations

import hmac
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from tokenmill.errors import RateLimitExceededError

REASON = "rate_limit"  # the label of tokenmill:request_rejected_total
_SETTINGS = ("tenant", "requests_per_minute", "tokens_per_minute")


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    tenant: Optional[str] = None
    requests_per_minute: Optional[float] = None
    tokens_per_minute: Optional[float] = None


@dataclass(slots=True)
class TokenBucket:
    per_minute: float
    level: float = field(init=False)
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.level = self.per_minute

    def take(self, cost: float, now: float) -> Optional[float]:
        """Takes `cost` and returns None, or returns the seconds until it could (taking nothing)."""
        rate = self.per_minute / 60.0
        self.level = min(self.per_minute, self.level + max(0.0, now - self.updated) * rate)
        self.updated = now
        if cost <= self.level:
            self.level -= cost
            return None
        return (cost - self.level) / rate


class RateLimiter:
    """The server's API keys: which one a request presents, its tenant, and its buckets."""

    def __init__(self, keys: dict[str, KeyPolicy]) -> None:
        self.policies = dict(keys)
        self._encoded = [(key.encode(), key) for key in self.policies]
        self._requests = {k: TokenBucket(p.requests_per_minute) for k, p in self.policies.items()
                          if p.requests_per_minute is not None}
        self._tokens = {k: TokenBucket(p.tokens_per_minute) for k, p in self.policies.items()
                        if p.tokens_per_minute is not None}

    def __bool__(self) -> bool:
        return bool(self.policies)

    def match(self, presented: bytes) -> Optional[str]:
        """The key `presented` equals, compared in constant time against every key (the time taken
        does not say which one nearly matched)."""
        found = None
        for encoded, key in self._encoded:
            if hmac.compare_digest(presented, encoded):
                found = key
        return found

    def tenant(self, key: Optional[str]) -> Optional[str]:
        policy = self.policies.get(key) if key is not None else None
        return policy.tenant if policy is not None else None

    def charge_request(self, key: str, now: Optional[float] = None) -> None:
        bucket = self._requests.get(key)
        if bucket is not None:
            wait = bucket.take(1, time.monotonic() if now is None else now)
            if wait is not None:
                raise _exceeded(f"this API key is limited to {bucket.per_minute:g} requests per minute", wait)

    def charge_tokens(self, key: Optional[str], cost: int, now: Optional[float] = None) -> None:
        bucket = self._tokens.get(key) if key is not None else None
        if bucket is None:
            return
        if cost > bucket.per_minute:
            raise _exceeded(f"this request may use {cost} tokens (prompt + n x max_tokens), more than this API "
                            f"key's limit of {bucket.per_minute:g} tokens per minute; lower max_tokens", 60.0)
        wait = bucket.take(cost, time.monotonic() if now is None else now)
        if wait is not None:
            raise _exceeded(f"this API key is limited to {bucket.per_minute:g} tokens per minute "
                            f"(this request counts {cost}: prompt + n x max_tokens)", wait)


def _exceeded(message: str, wait_s: float) -> RateLimitExceededError:
    return RateLimitExceededError(f"Rate limit reached: {message}.", retry_after_s=max(1, math.ceil(wait_s)),
                                  code="rate_limit_exceeded")


def load_api_keys_file(path: str) -> dict[str, KeyPolicy]:
    """Reads the --api-keys-file JSON (see the module docstring); ValueError says what is wrong."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the API keys file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object mapping each API key to its settings")
    keys: dict[str, KeyPolicy] = {}
    for key, settings in data.items():
        settings = {} if settings is None else settings
        if not key or not isinstance(settings, dict) or set(settings) - set(_SETTINGS):
            raise ValueError(f"{path}: key {key[:4]!r}...: settings must be an object with {', '.join(_SETTINGS)}")
        tenant = settings.get("tenant")
        if tenant is not None and not isinstance(tenant, str):
            raise ValueError(f"{path}: tenant must be a string")
        limits = [settings.get(name) for name in _SETTINGS[1:]]
        for value in limits:
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{path}: limits must be positive numbers")
        keys[key] = KeyPolicy(tenant, *limits)
    return keys


def request_key(request: Any) -> Optional[str]:
    """The API key the middleware matched for this HTTP request (None without keys)."""
    return getattr(getattr(request, "state", None), "api_key", None)
