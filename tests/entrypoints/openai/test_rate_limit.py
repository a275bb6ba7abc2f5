"""Unit tests of the API key registry: buckets, key matching, tenants, the keys file."""
from __future__ import annotations

import json
import multiprocessing

import pytest

from tokenmill.entrypoints.openai.rate_limit import (
    BucketState,
    KeyPolicy,
    RateLimiter,
    TokenBucket,
    load_api_keys_file,
)
from tokenmill.errors import RateLimitExceededError


def test_bucket_bursts_to_its_limit_then_refills_per_second():
    now = 100.0
    bucket, state = TokenBucket(60, slot=0), BucketState([60.0, now])  # one per second
    assert all(bucket.take(state, 1, now) is None for _ in range(60))
    assert bucket.take(state, 1, now) == pytest.approx(1.0)
    assert bucket.take(state, 1, now + 1.0) is None


SHARED_KEYS = {"free": KeyPolicy(), "a": KeyPolicy(requests_per_minute=300, tokens_per_minute=1000),
               "b": KeyPolicy(requests_per_minute=5)}
NOW = 1e9  # far past the buckets' creation: every charge sees the same moment, so nothing refills


def _charge_requests(path: str, key: str, attempts: int, accepted) -> None:
    limiter = RateLimiter(SHARED_KEYS, shared_path=path)  # as API server i > 0 attaches
    for _ in range(attempts):
        try:
            limiter.charge_request(key, now=NOW)
            with accepted.get_lock():
                accepted.value += 1
        except RateLimitExceededError:
            pass
    limiter.close()


def test_api_servers_sharing_the_buckets_spend_each_limit_once(tmp_path):
    path = str(tmp_path / "rate-limits")
    server0 = RateLimiter(SHARED_KEYS)
    server0.share(path)
    server1 = RateLimiter(SHARED_KEYS, shared_path=path)
    # One key's tokens, spent through either server.
    server0.charge_tokens("a", 600, now=NOW)
    with pytest.raises(RateLimitExceededError):
        server1.charge_tokens("a", 600, now=NOW)
    server1.charge_tokens("a", 400, now=NOW)
    # Other keys and kinds keep their own buckets.
    for _ in range(5):
        server1.charge_request("b", now=NOW)
    with pytest.raises(RateLimitExceededError):
        server0.charge_request("b", now=NOW)
    # Three processes (each mapping the file itself, as the API servers do) racing for one key's 300
    # requests: exactly 300 get through.
    context = multiprocessing.get_context("spawn")
    accepted = context.Value("i", 0)
    others = [context.Process(target=_charge_requests, args=(path, "a", 200, accepted)) for _ in range(2)]
    for process in others:
        process.start()
    _charge_requests(path, "a", 200, accepted)
    for process in others:
        process.join(60)
    assert [process.exitcode for process in others] == [0, 0]
    assert accepted.value == 300
    # A server whose keys differ from server 0's cannot attach to its buckets.
    with pytest.raises(ValueError):
        RateLimiter({"a": KeyPolicy(requests_per_minute=1)}, shared_path=path)
    server0.close()
    server1.close()


def test_limiter_limits_each_key_on_its_own_and_says_when_to_retry():
    limiter = RateLimiter({"a": KeyPolicy("alice", requests_per_minute=2, tokens_per_minute=100),
                           "b": KeyPolicy("bob")})
    limiter.charge_request("a", now=0.0)
    limiter.charge_request("a", now=0.0)
    with pytest.raises(RateLimitExceededError) as info:
        limiter.charge_request("a", now=0.0)
    assert info.value.retry_after_s == 30 and info.value.error_type == "rate_limit_exceeded"
    assert info.value.code == "rate_limit_exceeded" and info.value.http_status == 429
    for _ in range(10):
        limiter.charge_request("b", now=0.0)  # no limits
    limiter.charge_tokens("a", 80, now=0.0)
    with pytest.raises(RateLimitExceededError) as info:
        limiter.charge_tokens("a", 40, now=0.0)
    assert info.value.retry_after_s == 12  # 20 tokens short at 100/60 per second
    with pytest.raises(RateLimitExceededError):
        limiter.charge_tokens("a", 101, now=1000.0)  # larger than a whole minute's allowance
    assert limiter.tenant("a") == "alice" and limiter.tenant("b") == "bob" and limiter.tenant(None) is None


def test_keys_match_exactly():
    limiter = RateLimiter({"sk-one": KeyPolicy(), "sk-two": KeyPolicy()})
    assert limiter.match(b"sk-two") == "sk-two"
    assert limiter.match(b"sk-tw") is None and limiter.match(b"sk-two ") is None and limiter.match(b"") is None


def test_keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k1": {"tenant": "t", "requests_per_minute": 5, "tokens_per_minute": 1000},
                                "k2": {}, "k3": None}))
    keys = load_api_keys_file(str(path))
    assert keys == {"k1": KeyPolicy("t", 5, 1000), "k2": KeyPolicy(), "k3": KeyPolicy()}
    for bad in ("[1]", '{"k": {"rpm": 5}}', '{"k": {"requests_per_minute": 0}}', '{"k": {"tenant": 3}}', "{"):
        path.write_text(bad)
        with pytest.raises(ValueError):
            load_api_keys_file(str(path))
