"""`tokenmill check URL`: a smoke check of a running OpenAI-compatible server, usable as a deploy gate.

/health and /metrics answer; a short, a medium and a long prompt each complete with and without streaming
(the stream's time to first token and tokens per second measured, and held against the SLO numbers when
given); one structured output (a JSON schema) parses and has its field. Each check is one line,
`PASS name: detail` or `FAIL name: reason`; the exit status is non-zero when any check failed.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

# A word of plain English is about one token for the common tokenizers: prompt lengths in words.
SHORT_WORDS, MEDIUM_WORDS, LONG_WORDS = 8, 200, 2000
SENTENCE = "The quick brown fox jumps over the lazy dog while the farmer counts his sheep. "
MAX_TOKENS = 16


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


@dataclass
class CheckConfig:
    url: str
    api_key: Optional[str] = None
    model: Optional[str] = None
    slo_ttft_ms: Optional[float] = None
    slo_tpot_ms: Optional[float] = None
    timeout_s: float = 300.0
    results: list[CheckResult] = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def prompt_of(words: int) -> str:
    sentence_words = len(SENTENCE.split())
    text = SENTENCE * (words // sentence_words + 1)
    return " ".join(text.split()[:words]) + "\nSummarize the text above in one sentence:"


def run_checks(cfg: CheckConfig, report: Callable[[str], None] = print) -> bool:
    """Runs every check, reporting each line as it finishes; True when all passed."""
    import httpx

    def record(result: CheckResult) -> None:
        cfg.results.append(result)
        report(result.line())

    with httpx.Client(base_url=cfg.url.rstrip("/"), headers=cfg.headers, timeout=cfg.timeout_s) as client:
        record(_check_get(client, "/health", lambda r: "ok"))
        report(_engine_line(client))
        record(_check_get(client, "/metrics", lambda r: f"{len(r.text.splitlines())} lines"
                          if "# TYPE" in r.text else None))
        model, max_model_len = _model(client, cfg, record)
        if model is not None:
            long_words = min(LONG_WORDS, max(MEDIUM_WORDS * 2, (max_model_len or 4096) // 2 - 64))
            for size, words in (("short", SHORT_WORDS), ("medium", MEDIUM_WORDS), ("long", long_words)):
                body: dict[str, Any] = {"model": model, "prompt": prompt_of(words), "max_tokens": MAX_TOKENS,
                                        "temperature": 0}
                record(_check_completion(client, f"{size} prompt ({words} words)", body))
                # Another first word: the streamed prompt shares no cached prefix with the one before it, so its
                # time to first token includes the prefill.
                streamed = {**body, "prompt": "Streamed. " + body["prompt"]}
                record(_check_stream(client, cfg, f"{size} prompt ({words} words), streamed", streamed))
            record(_check_structured(client, model))
    return all(result.ok for result in cfg.results)


def _engine_line(client: Any) -> str:
    """What the server runs on, from tokenmill's /stats (not a check: other servers do not answer it): the
    device and why, then each numerics choice (weights, dtype, block matmul, KV cache dtype) and its reason."""
    import httpx

    try:
        response = client.get("/stats")
        stats = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        stats = None
    numerics = stats.get("numerics") if isinstance(stats, dict) else None
    if not isinstance(numerics, dict) or not numerics:
        return "INFO engine: /stats does not report its numerics"
    device = stats.get("device") if isinstance(stats, dict) else None
    choices = {**({"device": device} if isinstance(device, dict) else {}), **numerics}
    return "INFO engine: " + "; ".join(f"{name.replace('_', ' ')} {choice.get('value')} ({choice.get('reason')})"
                                       for name, choice in choices.items() if isinstance(choice, dict))


def _failure(response: Any) -> str:
    try:
        error = response.json().get("error", {})
        message = error.get("message") if isinstance(error, dict) else None
    except ValueError:
        message = None
    return f"HTTP {response.status_code}" + (f": {message}" if message else "")


def _guard(name: str, check: Callable[[], CheckResult]) -> CheckResult:
    import httpx

    try:
        return check()
    except httpx.HTTPError as exc:
        return CheckResult(name, False, f"{type(exc).__name__}: {exc}")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return CheckResult(name, False, f"unexpected answer ({type(exc).__name__}: {exc})")


def _check_get(client: Any, path: str, detail: Callable[[Any], Optional[str]]) -> CheckResult:
    def check() -> CheckResult:
        response = client.get(path)
        if response.status_code != 200:
            return CheckResult(path, False, _failure(response))
        text = detail(response)
        return CheckResult(path, text is not None, text or "unexpected body")

    return _guard(path, check)


def _model(client: Any, cfg: CheckConfig, record: Callable[[CheckResult], None]) -> tuple[Optional[str], Optional[int]]:
    found: dict[str, Any] = {}

    def check() -> CheckResult:
        response = client.get("/v1/models")
        if response.status_code != 200:
            return CheckResult("/v1/models", False, _failure(response))
        cards = response.json()["data"]
        card = next((c for c in cards if c["id"] == cfg.model), None) if cfg.model else (cards[0] if cards else None)
        if card is None:
            return CheckResult("/v1/models", False, f"no model {cfg.model!r}" if cfg.model else "no model served")
        found.update(card)
        return CheckResult("/v1/models", True, f"{card['id']} (max_model_len {card.get('max_model_len')})")

    record(_guard("/v1/models", check))
    return found.get("id"), found.get("max_model_len")


def _check_completion(client: Any, name: str, body: dict) -> CheckResult:
    def check() -> CheckResult:
        start = time.perf_counter()
        response = client.post("/v1/completions", json=body)
        elapsed = time.perf_counter() - start
        if response.status_code != 200:
            return CheckResult(name, False, _failure(response))
        payload = response.json()
        tokens = payload["usage"]["completion_tokens"]
        if tokens < 1 or not isinstance(payload["choices"][0]["text"], str):
            return CheckResult(name, False, "no tokens generated")
        return CheckResult(name, True, f"{payload['usage']['prompt_tokens']} prompt tokens, {tokens} generated "
                                       f"in {elapsed:.2f} s")

    return _guard(name, check)


def _check_stream(client: Any, cfg: CheckConfig, name: str, body: dict) -> CheckResult:
    def check() -> CheckResult:
        start = time.perf_counter()
        first = last = None
        chunks = 0
        done = False
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            if response.status_code != 200:
                response.read()
                return CheckResult(name, False, _failure(response))
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return CheckResult(name, False, f"error in the stream: {event['error'].get('message')}")
                if event["choices"] and event["choices"][0].get("text"):
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
        if not done or first is None or last is None:
            return CheckResult(name, False, "the stream ended without text and [DONE]" if not done else "no text")
        ttft_ms = (first - start) * 1000
        tpot_ms = (last - first) * 1000 / (chunks - 1) if chunks > 1 else None
        detail = f"TTFT {ttft_ms:.0f} ms" + (f", {1000 / tpot_ms:.1f} tokens/s" if tpot_ms else "")
        problems = []
        if cfg.slo_ttft_ms is not None and ttft_ms > cfg.slo_ttft_ms:
            problems.append(f"TTFT above the SLO of {cfg.slo_ttft_ms:g} ms")
        if cfg.slo_tpot_ms is not None and tpot_ms is not None and tpot_ms > cfg.slo_tpot_ms:
            problems.append(f"{tpot_ms:.0f} ms a token, above the SLO of {cfg.slo_tpot_ms:g} ms")
        return CheckResult(name, not problems, detail + "".join(f"; {p}" for p in problems))

    return _guard(name, check)


def _check_structured(client: Any, model: str) -> CheckResult:
    name = "structured output (JSON schema)"
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}

    def check() -> CheckResult:
        response = client.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a city in France, as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}})
        if response.status_code != 200:
            return CheckResult(name, False, _failure(response))
        content = response.json()["choices"][0]["message"]["content"]
        try:
            value = json.loads(content)
        except ValueError:
            return CheckResult(name, False, f"not JSON: {content[:80]!r}")
        if not isinstance(value, dict) or not isinstance(value.get("city"), str):
            return CheckResult(name, False, f"does not follow the schema: {content[:80]!r}")
        return CheckResult(name, True, json.dumps(value))

    return _guard(name, check)
