"""`tokenmill bench serve`: an async load client for any OpenAI-compatible server.

Every request streams (`stream_options.include_usage`, `ignore_eos`, its own `max_tokens`); the client records
the time to the first content chunk (TTFT), the gaps between later chunks (ITL) and the end-to-end latency, and
takes token counts from the server's usage block (counting content chunks only when a server sends none).
Requests go out on a schedule (all at once, or Poisson/gamma arrivals at --request-rate) with at most
--max-concurrency in flight. Metric names and JSON keys follow `vllm bench serve`.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from tokenmill.bench.datasets import BenchRequest
from tokenmill.errors import InvalidRequestError

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)
_TEST_PROMPT_TOKENS = 8  # shorter than a KV block, so the test request leaves nothing in a prefix cache


@dataclass(slots=True)
class ServeConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: Optional[str] = None  # None: the first id of GET /v1/models
    api_key: Optional[str] = None
    max_concurrency: Optional[int] = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0
    slo_ttft_ms: Optional[float] = None
    slo_tpot_ms: Optional[float] = None
    slo_e2el_ms: Optional[float] = None
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    server_pid: Optional[int] = None
    sample_server: bool = True
    sample_interval_s: float = 0.25
    disable_tqdm: bool = False
    label: Optional[str] = None
    # Extra JSON fields merged into every request body (engine-specific knobs such as
    # llama.cpp's {"cache_prompt": false}).
    extra_body: dict[str, Any] = field(default_factory=dict)
    # A time-boxed run (--duration): requests (the dataset's, cycled) are sent for warmup_s + duration_s; the
    # figures are those of the stable segment after the warm-up, the requests still running at its end
    # finish (the drain) and count only for what they did inside it.
    duration_s: Optional[float] = None
    warmup_s: float = 0.0
    # What the server costs an hour (any currency): the result then says what a million tokens cost at the
    # measured throughput.
    price_per_hour: Optional[float] = None

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if self.base_url.endswith("/v1"):  # accept an OpenAI-style base URL too
            self.base_url = self.base_url[:-3]
        if self.endpoint not in ("/v1/completions", "/v1/chat/completions"):
            raise InvalidRequestError("--endpoint must be /v1/completions or /v1/chat/completions")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidRequestError("--max-concurrency must be at least 1")
        if not self.request_rate > 0:
            raise InvalidRequestError("--request-rate must be positive (inf sends all requests at once)")
        if not self.burstiness > 0:
            raise InvalidRequestError("--burstiness must be positive")
        if self.price_per_hour is not None and not self.price_per_hour > 0:
            raise InvalidRequestError("--price-per-hour must be positive")
        if self.duration_s is not None:
            if not self.duration_s > 0 or self.warmup_s < 0:
                raise InvalidRequestError("--duration must be positive and --warmup non-negative")
            if math.isinf(self.request_rate) and self.max_concurrency is None:
                raise InvalidRequestError("--duration needs a fixed load: --max-concurrency N or --request-rate R")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(slots=True)
class RequestResult:
    prompt_len: int
    success: bool = False
    output_len: int = 0
    ttft: Optional[float] = None  # seconds from send to the first content chunk
    itl: list[float] = field(default_factory=list)  # seconds between later content chunks
    latency: float = 0.0
    start_time: float = 0.0  # seconds after the benchmark started
    usage_reported: bool = False
    error: str = ""


def arrival_intervals(num_requests: int, request_rate: float, burstiness: float = 1.0,
                      seed: int = 0) -> list[float]:
    """Gaps between sends: gamma(shape=burstiness, mean=1/rate); burstiness 1 is a Poisson process.

    Gap i is waited after request i is sent, so the first request goes at t=0 (as in vLLM).
    """
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    scale = 1.0 / (request_rate * burstiness)
    return [float(x) for x in rng.gamma(shape=burstiness, scale=scale, size=num_requests)]


def build_payload(request: BenchRequest, cfg: ServeConfig, model: str,
                  max_tokens: Optional[int] = None) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                               "temperature": cfg.temperature}
    tokens = max_tokens or request.max_tokens
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    if cfg.endpoint == "/v1/chat/completions":
        payload["messages"] = request.messages or [{"role": "user", "content": request.prompt or ""}]
        payload["max_completion_tokens"] = tokens
    else:
        ids = request.prompt_token_ids
        payload["prompt"] = list(ids) if ids is not None else request.prompt
        payload["max_tokens"] = tokens
    payload.update(cfg.extra_body)
    return payload


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        text += piece or ""
    return text


def _error_message(status: int, body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = body[:200].decode(errors="replace")
    return f"HTTP {status}: {message}"


async def send_request(client: Any, cfg: ServeConfig, model: str, request: BenchRequest,
                       max_tokens: Optional[int] = None, t0: float = 0.0) -> RequestResult:
    """Stream one request; never raises (a failure is a RequestResult with success False and an error)."""
    result = RequestResult(prompt_len=request.prompt_len)
    chunks = 0
    start = time.perf_counter()
    result.start_time = start - t0
    last = start
    try:
        async with client.stream("POST", cfg.base_url + cfg.endpoint, headers=cfg.headers,
                                 json=build_payload(request, cfg, model, max_tokens)) as response:
            if response.status_code != 200:
                result.error = _error_message(response.status_code, await response.aread())
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error']}"
                    return result
                now = time.perf_counter()
                if _chunk_text(chunk):
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
                usage = chunk.get("usage")
                if usage:
                    result.usage_reported = True
                    result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
                    result.output_len = int(usage.get("completion_tokens") or 0)
    except Exception as exc:  # network errors, timeouts, bad JSON: one failed request, not a failed run
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    if not result.usage_reported:
        result.output_len = chunks
    result.success = result.ttft is not None or result.output_len > 0
    if not result.success:
        result.error = "the stream ended without output"
    return result


async def first_model_id(client: Any, cfg: ServeConfig) -> str:
    try:
        response = await client.get(cfg.base_url + "/v1/models", headers=cfg.headers)
    except Exception as exc:
        raise InvalidRequestError(f"cannot reach {cfg.base_url}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise InvalidRequestError(f"GET /v1/models failed: {_error_message(response.status_code, response.content)}")
    models = response.json().get("data") or []
    if not models:
        raise InvalidRequestError(f"{cfg.base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


def _test_request(request: BenchRequest) -> BenchRequest:
    ids = request.prompt_token_ids
    return replace(request, prompt_token_ids=None if ids is None else ids[:_TEST_PROMPT_TOKENS],
                   prompt=None if request.prompt is None else " ".join(request.prompt.split()[:_TEST_PROMPT_TOKENS]),
                   messages=None)


async def run_benchmark(requests: Sequence[BenchRequest], cfg: ServeConfig,
                        extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Send every request on schedule and return the JSON-ready result (see `summarize`)."""
    import httpx
    from tqdm.asyncio import tqdm

    if not requests:
        raise InvalidRequestError("no requests to send")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0), limits=limits) as client:
        model = cfg.model or await first_model_id(client, cfg)
        test = await send_request(client, cfg, model, _test_request(requests[0]), max_tokens=4)
        if not test.success:
            raise InvalidRequestError(f"the test request to {cfg.base_url}{cfg.endpoint} failed: {test.error}")
        sampler = ServerSampler(client, cfg.base_url, cfg.headers, cfg.server_pid, cfg.sample_interval_s,
                                poll_http=cfg.sample_server)
        await sampler.start()
        semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        progress = tqdm(total=len(requests), disable=cfg.disable_tqdm, desc="requests")
        t0 = time.perf_counter()

        async def one(request: BenchRequest) -> RequestResult:
            if semaphore is None:
                result = await send_request(client, cfg, model, request, t0=t0)
            else:
                async with semaphore:
                    result = await send_request(client, cfg, model, request, t0=t0)
            progress.update(1)
            return result

        if cfg.duration_s is not None:
            progress.close()
            results = await _send_for_duration(client, cfg, model, requests, t0)
        else:
            tasks = []
            gaps = arrival_intervals(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
            send_at = t0
            for request, gap in zip(requests, gaps):
                # Sleep to absolute send times, so oversleeping one gap does not delay all later requests.
                if send_at > time.perf_counter():
                    await asyncio.sleep(send_at - time.perf_counter())
                tasks.append(asyncio.create_task(one(request)))
                send_at += gap
            results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        progress.close()
        server = await sampler.stop()
        engine = await server_configuration(client, cfg)
    if cfg.duration_s is not None:
        result = summarize_stable_segment(results, duration, cfg)
    else:
        result = summarize(results, duration, cfg)
    result.update(model=model, server=server, engine=engine, **(extra or {}))
    if cfg.price_per_hour is not None:
        result["cost"] = token_cost(result, cfg.price_per_hour)
    return result


def token_cost(result: dict[str, Any], price_per_hour: float) -> dict[str, Any]:
    """What a million tokens cost at the run's throughput on a server billed price_per_hour: per million output
    tokens (the whole machine's time charged to what it generated, as per-token price lists quote output), and
    per million tokens read and generated together."""
    def per_million(tokens_per_s: float) -> Optional[float]:
        return price_per_hour / (tokens_per_s * 3600) * 1e6 if tokens_per_s > 0 else None

    return {"price_per_hour": price_per_hour,
            "per_million_output_tokens": per_million(result["output_throughput"]),
            "per_million_tokens": per_million(result["total_token_throughput"])}


async def _send_for_duration(client: Any, cfg: ServeConfig, model: str, requests: Sequence[BenchRequest],
                             t0: float) -> list[RequestResult]:
    """Sends the requests, cycled, until warmup + duration has passed: at a fixed concurrency (each slot sends
    its next request as its last one ends) or at a fixed rate (gamma gaps, capped by --max-concurrency if
    given); then waits for those still running."""
    assert cfg.duration_s is not None, "a time-boxed run has a duration"
    end = t0 + cfg.warmup_s + cfg.duration_s
    source = itertools.cycle(requests)
    if math.isinf(cfg.request_rate):
        # A fixed concurrency (ServeConfig refuses --duration with neither a rate nor a concurrency).
        slots = cfg.max_concurrency or 1
        async def slot() -> list[RequestResult]:
            done = []
            while time.perf_counter() < end:
                done.append(await send_request(client, cfg, model, next(source), t0=t0))
            return done

        return [r for results in await asyncio.gather(*(slot() for _ in range(slots))) for r in results]
    semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

    async def one(request: BenchRequest) -> RequestResult:
        if semaphore is None:
            return await send_request(client, cfg, model, request, t0=t0)
        async with semaphore:
            return await send_request(client, cfg, model, request, t0=t0)

    rng = np.random.default_rng(cfg.seed)
    scale = 1.0 / (cfg.request_rate * cfg.burstiness)
    tasks, send_at = [], t0
    while send_at < end:
        if send_at > time.perf_counter():
            await asyncio.sleep(send_at - time.perf_counter())
        tasks.append(asyncio.create_task(one(next(source))))
        send_at += float(rng.gamma(shape=cfg.burstiness, scale=scale))
    return list(await asyncio.gather(*tasks))


async def server_configuration(client: Any, cfg: ServeConfig) -> dict[str, Any]:
    """What the server says about itself: /version, the models (with max_model_len), and tokenmill's /stats
    engine settings and numerics (None for what a server does not answer)."""
    out: dict[str, Any] = {}
    for key, path in (("version", "/version"), ("models", "/v1/models"), ("stats", "/stats")):
        try:
            response = await client.get(cfg.base_url + path, headers=cfg.headers, timeout=10.0)
            out[key] = response.json() if response.status_code == 200 else None
        except Exception:  # any server, any answer: this is a record, not a check
            out[key] = None
    stats = out.pop("stats") or {}
    out["models"] = (out["models"] or {}).get("data") if isinstance(out["models"], dict) else None
    out["config"] = stats.get("config")
    out["numerics"] = stats.get("numerics")
    return out


def _tokens_inside(r: RequestResult, start: float, end: float) -> float:
    """The request's output tokens generated inside [start, end): its first at TTFT, the rest spread over the
    time to its last, each counted where it fell."""
    if not r.success or r.ttft is None or r.output_len < 1:
        return 0.0
    first = r.start_time + r.ttft
    last = r.start_time + r.latency
    inside = 1.0 if start <= first < end else 0.0
    if r.output_len > 1:
        span = max(last - first, 1e-9)
        overlap = max(0.0, min(last, end) - max(first, start))
        inside += (r.output_len - 1) * overlap / span
    return inside


def summarize_stable_segment(results: Sequence[RequestResult], duration: float, cfg: ServeConfig) -> dict[str, Any]:
    """A time-boxed run's figures over its stable segment [warmup, warmup + duration): latency percentiles of
    the requests that started in it, throughput from the tokens generated in it and the requests that ended in
    it; the warm-up and the drain reported apart, with the whole run's throughput beside for comparison."""
    stable_s = cfg.duration_s
    assert stable_s is not None, "only a time-boxed run has a stable segment"
    start, end = cfg.warmup_s, cfg.warmup_s + stable_s
    stable = [r for r in results if start <= r.start_time < end]
    result = summarize(stable, stable_s, cfg)
    output_tokens = sum(_tokens_inside(r, start, end) for r in results)
    ended = [r for r in results if r.success and start <= r.start_time + r.latency < end]
    input_tokens = sum(r.prompt_len for r in stable if r.success)
    result.update(
        output_throughput=output_tokens / stable_s,
        total_token_throughput=(output_tokens + input_tokens) / stable_s,
        request_throughput=len(ended) / stable_s,
        duration=stable_s,
        segments={"warmup_s": cfg.warmup_s, "stable_s": stable_s, "drain_s": max(0.0, duration - end),
                  "wall_s": duration, "requests_sent": len(results), "requests_in_warmup":
                      sum(r.start_time < start for r in results), "requests_in_stable_segment": len(stable)},
        whole_run={"output_throughput": sum(r.output_len for r in results if r.success) / max(duration, 1e-9),
                   **{f"{k}_ttft_ms": v
                      for k, v in _stats([r.ttft for r in results if r.success and r.ttft is not None],
                                         (50.0, 95.0)).items() if k in ("median", "p95")}},
    )
    if result["good_requests"] is not None:
        result["request_goodput"] = sum(_is_good(r, cfg) for r in ended) / stable_s
    result["verdict"] = slo_verdict(result, cfg)
    return result


def slo_verdict(result: dict[str, Any], cfg: ServeConfig) -> Optional[dict[str, Any]]:
    """Whether the stable segment's P95 TTFT and P95 TPOT are within --slo-ttft-ms / --slo-tpot-ms (None without
    SLO numbers), with the share of requests that met every given SLO (goodput)."""
    checks = {name: (slo, result.get(f"p95_{name}_ms")) for name, slo in (("ttft", cfg.slo_ttft_ms),
                                                                         ("tpot", cfg.slo_tpot_ms)) if slo is not None}
    if not checks:
        return None
    met = {name: value is not None and value <= slo for name, (slo, value) in checks.items()}
    completed = result["completed"]
    return {"meets_slo": all(met.values()), **{f"p95_{name}_within_slo": ok for name, ok in met.items()},
            "good_share": None if not completed else result["good_requests"] / completed}


def _stats(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, Optional[float]]:
    """mean/median/std/max and the percentiles of a list of seconds, in milliseconds (None when empty)."""
    keys = ["mean", "median", "std", "max"] + [f"p{_pct_name(q)}" for q in percentiles]
    if not values_s:
        return {key: None for key in keys}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    out: dict[str, Optional[float]] = {"mean": float(ms.mean()), "median": float(np.median(ms)),
                                       "std": float(ms.std()), "max": float(ms.max())}
    out.update({f"p{_pct_name(q)}": float(np.percentile(ms, q)) for q in percentiles})
    return out


def _pct_name(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)


def max_concurrent(results: Sequence[RequestResult]) -> int:
    """The most requests in flight at once, from their start and end times."""
    events = sorted([(r.start_time, 1) for r in results] + [(r.start_time + r.latency, -1) for r in results],
                    key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def _tpot(r: RequestResult) -> Optional[float]:
    """Time per output token after the first; None for one-token outputs (nothing to average)."""
    if r.ttft is None or r.output_len < 2:
        return None
    return (r.latency - r.ttft) / (r.output_len - 1)


def _is_good(r: RequestResult, cfg: ServeConfig) -> bool:
    """Meets every given SLO (goodput); a one-token output has no TPOT and passes that check."""
    checks = ((cfg.slo_ttft_ms, r.ttft), (cfg.slo_tpot_ms, _tpot(r)), (cfg.slo_e2el_ms, r.latency))
    return all(slo is None or value is None or value * 1000.0 <= slo for slo, value in checks)


def summarize(results: Sequence[RequestResult], duration: float, cfg: ServeConfig) -> dict[str, Any]:
    """The `vllm bench serve`-shaped result: totals, throughputs, per-metric stats, per-request lists."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for t in map(_tpot, ok) if t is not None]
    itls = [gap for r in ok for gap in r.itl]
    e2els = [r.latency for r in ok]
    total_in, total_out = sum(r.prompt_len for r in ok), sum(r.output_len for r in ok)
    slo = {"ttft_ms": cfg.slo_ttft_ms, "tpot_ms": cfg.slo_tpot_ms, "e2el_ms": cfg.slo_e2el_ms}
    has_slo = any(v is not None for v in slo.values())
    good = sum(_is_good(r, cfg) for r in ok) if has_slo else None
    span = max(duration, 1e-9)
    result: dict[str, Any] = {
        "kind": "serve",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "label": cfg.label,
        "base_url": cfg.base_url,
        "endpoint": cfg.endpoint,
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "num_prompts": len(results),
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / span,
        "request_goodput": None if good is None else good / span,
        "good_requests": good,
        "slo": slo,
        "output_throughput": total_out / span,
        "total_token_throughput": (total_in + total_out) / span,
        "max_concurrent_requests": max_concurrent(results),
        "usage_reported": all(r.usage_reported for r in ok),
    }
    for name, values in zip(METRICS, (ttfts, tpots, itls, e2els)):
        result.update({f"{key}_{name}_ms": value for key, value in _stats(values, cfg.percentiles).items()})
    result.update({
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "e2els": [r.latency if r.success else None for r in results],
        "start_times": [r.start_time for r in results],
        "errors": [r.error for r in results],
    })
    return result


async def run_sweep(requests: Sequence[BenchRequest], cfg: ServeConfig, concurrencies: Sequence[int],
                    extra: Optional[dict[str, Any]] = None, on_point: Any = None) -> dict[str, Any]:
    """The same benchmark once per concurrency (all requests queued at once unless --request-rate)."""
    if not concurrencies or any(c < 1 for c in concurrencies):
        raise InvalidRequestError("--concurrencies needs positive integers, e.g. 1,4,16,64")
    points = []
    for concurrency in concurrencies:
        point = await run_benchmark(requests, replace(cfg, max_concurrency=concurrency), extra)
        points.append(point)
        if on_point is not None:
            on_point(point)
    return {"kind": "sweep", "label": cfg.label, "base_url": cfg.base_url, "model": points[0].get("model"),
            "concurrencies": list(concurrencies), **(extra or {}), "points": points}


# ---- server-side sampling ------------------------------------------------------------------------
def process_tree_rss_bytes(pid: int) -> Optional[int]:
    """VmRSS of a process and all its descendants (an engine may run in child processes); None if gone.

    Shared pages count once per process, so this can overstate a forked tree a little.
    """
    total, seen, stack = 0, set(), [pid]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        seen.add(current)
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                stack.extend(int(child) for child in children.read_text().split())
            except OSError:
                pass
    return total if seen else None


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format → {metric name: value summed over its label sets}."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[-1])
        except ValueError:
            continue
    return values


def _gauge(metrics: dict[str, float], suffixes: tuple[str, ...]) -> Optional[float]:
    found = [v for name, v in metrics.items() if name.endswith(suffixes)]
    return sum(found) if found else None


class ServerSampler:
    """Samples the server during a run: resident memory (from /proc for a local --server-pid, else the
    /metrics gauge process_resident_memory_bytes) and queue depth (tokenmill's /stats, or the
    `*:num_requests_waiting` gauges vLLM and tokenmill export on /metrics). Missing endpoints are skipped.
    """

    def __init__(self, client: Any, base_url: str, headers: dict[str, str], pid: Optional[int],
                 interval_s: float = 0.25, poll_http: bool = True) -> None:
        self.client, self.base_url, self.headers = client, base_url, headers
        self.pid, self.interval_s, self.poll_http = pid, interval_s, poll_http
        self.use_stats = self.use_metrics = False
        self.rss: list[int] = []
        self.waiting: list[float] = []
        self.running: list[float] = []
        self.kv_usage: list[float] = []
        self._stop = asyncio.Event()
        self._task: Optional[asyncio.Task] = None

    async def start(self) -> None:
        if self.pid is not None and process_tree_rss_bytes(self.pid) is None:
            raise InvalidRequestError(f"--server-pid {self.pid}: no such process on this machine")
        if self.poll_http:
            self.use_stats = "num_requests_waiting" in (await self._get("/stats") or "")
            text = await self._get("/metrics") or ""
            wanted = ("process_resident_memory_bytes" in text and self.pid is None) or \
                ("num_requests_waiting" in text and not self.use_stats)
            self.use_metrics = wanted
        self._task = asyncio.create_task(self._loop())

    async def _get(self, path: str) -> Optional[str]:
        try:
            response = await self.client.get(self.base_url + path, headers=self.headers, timeout=5.0)
        except Exception:
            return None
        return response.text if response.status_code == 200 else None

    async def _loop(self) -> None:
        while not self._stop.is_set():
            await self.sample()
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass

    async def sample(self) -> None:
        if self.pid is not None:
            rss = process_tree_rss_bytes(self.pid)
            if rss is not None:
                self.rss.append(rss)
        if self.use_stats:
            text = await self._get("/stats")
            stats = json.loads(text) if text else {}
            self._record(stats.get("num_requests_waiting"), stats.get("num_requests_running"),
                         stats.get("kv_cache_usage"), None)
        if self.use_metrics:
            metrics = parse_prometheus(await self._get("/metrics") or "")
            self._record(_gauge(metrics, ("num_requests_waiting", "num_queue_reqs")),
                         _gauge(metrics, ("num_requests_running", "num_running_reqs")),
                         _gauge(metrics, ("kv_cache_usage_perc", "gpu_cache_usage_perc")),
                         metrics.get("process_resident_memory_bytes") if self.pid is None else None)

    def _record(self, waiting: Any, running: Any, kv_usage: Any, rss: Any) -> None:
        for store, value in ((self.waiting, waiting), (self.running, running), (self.kv_usage, kv_usage)):
            if value is not None:
                store.append(float(value))
        if rss is not None:
            self.rss.append(int(rss))

    async def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._task is not None:
            await self._task
        source = f"proc:{self.pid}" if self.pid is not None else ("metrics" if self.rss else None)
        waiting = np.asarray(self.waiting) if self.waiting else None
        return {
            "peak_rss_bytes": max(self.rss) if self.rss else None,
            "rss_source": source,
            "queue_depth_p50": None if waiting is None else float(np.percentile(waiting, 50)),
            "queue_depth_p95": None if waiting is None else float(np.percentile(waiting, 95)),
            "queue_depth_max": None if waiting is None else float(waiting.max()),
            "max_running": max(self.running) if self.running else None,
            "max_kv_cache_usage": max(self.kv_usage) if self.kv_usage else None,
            "num_samples": max(len(self.rss), len(self.waiting)),
        }
