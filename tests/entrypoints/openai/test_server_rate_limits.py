"""Per-key rate limits (--api-keys-file): 429 + Retry-After before any engine work, honoured Retry-After,
other keys unaffected, the key's tenant as the fair policy's tenant, refusals counted in /metrics."""
from __future__ import annotations

import json
import time

import httpx
import pytest

KEYS = {
    "sk-alice": {"tenant": "alice", "requests_per_minute": 30},
    "sk-bob": {"tenant": "bob", "tokens_per_minute": 600},
    "sk-free": {},
}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.slow
def test_per_key_rate_limits(start_server, tiny_llama_dir, tmp_path):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    server = start_server(["--model", str(tiny_llama_dir), "--max-model-len", "1024", "--num-kv-blocks", "128",
                           "--api-keys-file", str(keys_file), "--api-key", "sk-plain",
                           "--scheduling-policy", "fair"])
    url = server.url + "/v1/completions"
    ok_body = {"prompt": "Hi", "max_tokens": 2}
    with httpx.Client(timeout=60) as client:
        assert client.post(url, json=ok_body).status_code == 401
        assert client.post(url, json=ok_body, headers=auth("sk-plain")).status_code == 200

        # A burst over 30 requests per minute: counted on arrival, even when the body is invalid.
        statuses = []
        for _ in range(40):
            response = client.post(url, json={}, headers=auth("sk-alice"))
            statuses.append(response.status_code)
            if response.status_code == 429:
                break
        assert statuses[-1] == 429 and 29 <= len(statuses) <= 40 and set(statuses[:-1]) == {400}
        error = response.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and error["code"] == "rate_limit_exceeded"
        retry_after = int(response.headers["retry-after"])
        assert 1 <= retry_after <= 2
        # Another key is unaffected.
        assert client.post(url, json=ok_body, headers=auth("sk-free")).status_code == 200
        # Retry-After is honoured: waiting that long is enough.
        time.sleep(retry_after)
        response = client.post(url, json=ok_body, headers=auth("sk-alice"))
        assert response.status_code == 200, response.text

        # Tokens per minute: prompt + max_tokens, charged before the engine sees the request.
        big = {"prompt": "Hi", "max_tokens": 400}
        assert client.post(url, json=big, headers=auth("sk-bob")).status_code == 200
        refused = client.post(url, json=big, headers=auth("sk-bob"))
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_exceeded"
        assert int(refused.headers["retry-after"]) >= 1
        too_big = client.post(url, json={"prompt": "Hi", "max_tokens": 700}, headers=auth("sk-bob"))
        assert too_big.status_code == 429 and "per minute" in too_big.json()["error"]["message"]
        # Chat is limited the same way.
        chat = client.post(server.url + "/v1/chat/completions", headers=auth("sk-bob"),
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400})
        assert chat.status_code == 429 and "tokens per minute" in chat.json()["error"]["message"], chat.text

        metrics = client.get(server.url + "/metrics").text
    line = next(line for line in metrics.splitlines()
                if line.startswith("tokenmill:request_rejected_total") and 'reason="rate_limit"' in line)
    assert float(line.split()[-1]) >= 3

    # The key's tenant is the request's tenant (the fair policy's `user`); without one, the body's user.
    records = server.request_log()
    assert {r["tenant"] for r in records if r["status"] == "finished"} >= {"alice", "bob"}
    assert all(r["spec_accepted_tokens"] == 0 for r in records)  # no speculative decoding on this server
    with httpx.Client(timeout=60) as client:
        client.post(url, json={**ok_body, "user": "carol"}, headers=auth("sk-free"))
        response = client.post(url, json={**ok_body, "user": "mallory"}, headers=auth("sk-alice"))
        if response.status_code == 429:  # alice's burst may not have refilled a request yet: honour Retry-After
            time.sleep(int(response.headers["retry-after"]))
            response = client.post(url, json={**ok_body, "user": "mallory"}, headers=auth("sk-alice"))
        assert response.status_code == 200
    deadline = time.monotonic() + 10  # the server writes a request's log line as the request ends
    while len(server.request_log()) < len(records) + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    tenants = [r["tenant"] for r in server.request_log()[-2:]]
    assert tenants == ["carol", "alice"]
