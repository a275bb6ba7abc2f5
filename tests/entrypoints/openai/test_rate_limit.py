"""Unit tests of the API key registry: buckets, key matching, tenants, the keys file."""
from __future__ import annotations

import json

import pytest

from tokenmill.entrypoints.openai.rate_limit import KeyPolicy, RateLimiter, TokenBucket, load_api_keys_file
from tokenmill.errors import RateLimitExceededError


def test_bucket_bursts_to_its_limit_then_refills_per_second():
    bucket = TokenBucket(60)  # one per second
    now = bucket.updated
    assert all(bucket.take(1, now) is None for _ in range(60))
    assert bucket.take(1, now) == pytest.approx(1.0)
    assert bucket.take(1, now + 1.0) is None


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
