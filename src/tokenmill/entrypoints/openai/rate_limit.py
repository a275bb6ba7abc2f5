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

With `--api-server-count N` the limits hold for the whole server, not per process: API server 0 moves
the buckets into a small file in the server's run directory (`RateLimiter.share`), which servers
1..N-1 map (`RateLimiter(keys, shared_path=...)`); every charge reads and updates it under an
exclusive `flock`, so a key's limit is spent once whichever process takes its requests. The clock is
CLOCK_MONOTONIC, which every process on the host reads alike.
"""
from __future__ import annotations

import array
import contextlib
import fcntl
import hmac
import json
import math
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from tokenmill.errors import RateLimitExceededError

REASON = "rate_limit"  # the label of tokenmill:request_rejected_total
_SETTINGS = ("tenant", "requests_per_minute", "tokens_per_minute")


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    tenant: Optional[str] = None
    requests_per_minute: Optional[float] = None
    tokens_per_minute: Optional[float] = None


@dataclass(frozen=True, slots=True)
class TokenBucket:
    """A bucket of `per_minute` that refills continuously; its level and the time of its last refill
    live at `slot` of the limiter's state (local, or shared by the API servers)."""

    per_minute: float
    slot: int

    def take(self, state: "BucketState", cost: float, now: float) -> Optional[float]:
        """Takes `cost` and returns None, or returns the seconds until it could (taking nothing)."""
        with state.locked() as values:
            level_at, updated_at = 2 * self.slot, 2 * self.slot + 1
            rate = self.per_minute / 60.0
            level = min(self.per_minute, values[level_at] + max(0.0, now - values[updated_at]) * rate)
            values[updated_at] = now
            if cost <= level:
                values[level_at] = level - cost
                return None
            values[level_at] = level
            return (cost - level) / rate


class BucketState:
    """Every bucket's (level, last refill) pair in one process's memory."""

    def __init__(self, initial: list[float]) -> None:
        self.values: Any = list(initial)

    @contextlib.contextmanager
    def locked(self) -> Iterator[Any]:
        yield self.values  # one event loop per process: nothing else changes it meanwhile

    def close(self) -> None:
        pass


class SharedBucketState(BucketState):
    """The pairs in a file every API server maps, read and changed under an exclusive flock."""

    def __init__(self, path: str, size: int, initial: Optional[list[float]] = None) -> None:
        # initial given: create the file (API server 0, before servers 1..N-1 start); else attach to it.
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if initial is not None else 0)
        self._fd = os.open(path, flags, 0o600)
        try:
            if initial is not None:
                os.write(self._fd, array.array("d", initial).tobytes())
            if os.fstat(self._fd).st_size != size * 8:
                raise ValueError(f"{path} holds other rate-limit buckets than this server's keys")
            self._map = mmap.mmap(self._fd, size * 8)
        except BaseException:
            os.close(self._fd)
            raise
        self.values = memoryview(self._map).cast("d")

    @contextlib.contextmanager
    def locked(self) -> Iterator[Any]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield self.values
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self.values.release()
        self._map.close()
        os.close(self._fd)


class RateLimiter:
    """The server's API keys: which one a request presents, its tenant, and its buckets.

    shared_path: attach to the buckets API server 0 shared there (`share`) instead of keeping them here;
    `keys` must be server 0's, in its order (it hands them over with the path)."""

    def __init__(self, keys: dict[str, KeyPolicy], shared_path: Optional[str] = None) -> None:
        self.policies = dict(keys)
        self._encoded = [(key.encode(), key) for key in self.policies]
        limits = [(kind, key, getattr(policy, kind)) for kind in ("requests_per_minute", "tokens_per_minute")
                  for key, policy in self.policies.items() if getattr(policy, kind) is not None]
        self._requests = {key: TokenBucket(limit, slot) for slot, (kind, key, limit) in enumerate(limits)
                          if kind == "requests_per_minute"}
        self._tokens = {key: TokenBucket(limit, slot) for slot, (kind, key, limit) in enumerate(limits)
                        if kind == "tokens_per_minute"}
        now = time.monotonic()
        self._initial = [value for _, _, limit in limits for value in (float(limit), now)]  # full buckets
        self.shared_path = shared_path if limits else None  # where the buckets are kept, when shared
        self._state = (SharedBucketState(shared_path, len(self._initial)) if self.shared_path
                       else BucketState(self._initial))

    def __bool__(self) -> bool:
        return bool(self.policies)

    def share(self, path: str) -> None:
        """Moves the buckets into a new file at `path` for API servers 1..N-1 to attach to (call before
        any request is charged; nothing to share without limits)."""
        if self._initial:
            self._state = SharedBucketState(path, len(self._initial), self._initial)
            self.shared_path = path

    def close(self) -> None:
        self._state.close()

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
            wait = bucket.take(self._state, 1, time.monotonic() if now is None else now)
            if wait is not None:
                raise _exceeded(f"this API key is limited to {bucket.per_minute:g} requests per minute", wait)

    def charge_tokens(self, key: Optional[str], cost: int, now: Optional[float] = None) -> None:
        bucket = self._tokens.get(key) if key is not None else None
        if bucket is None:
            return
        if cost > bucket.per_minute:
            raise _exceeded(f"this request may use {cost} tokens (prompt + n x max_tokens), more than this API "
                            f"key's limit of {bucket.per_minute:g} tokens per minute; lower max_tokens", 60.0)
        wait = bucket.take(self._state, cost, time.monotonic() if now is None else now)
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
