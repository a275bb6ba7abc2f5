"""Engine statistics as plain data (no dependencies), produced every step and consumed by loggers:
the Prometheus exporter, the periodic log line and the dashboard's sliding window."""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Protocol


@dataclass(slots=True)
class SchedulerSnapshot:
    """Gauges and cumulative counters read from the scheduler after a step."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # cumulative
    prefix_cache_queries: int = 0  # cumulative, tokens
    prefix_cache_hits: int = 0  # cumulative, tokens
    num_cached_blocks: int = 0
    num_evictions: int = 0  # cumulative


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    queue_time: float
    prefill_time: float
    decode_time: float
    ttft: Optional[float]
    tpot: Optional[float]  # mean time per output token after the first
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class IterationStats:
    """What happened in one engine step."""

    timestamp: float = field(default_factory=time.time)
    num_prompt_tokens: int = 0  # prompt tokens computed this step (prefill work)
    num_generation_tokens: int = 0  # tokens sampled this step
    ttfts: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_generation_tokens


class StatLogger(Protocol):
    def record(self, scheduler: SchedulerSnapshot, iteration: IterationStats) -> None: ...


def percentile(sorted_values: list[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (q in [0, 100]) of already sorted values."""
    if not sorted_values:
        return None
    position = (len(sorted_values) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


class SlidingWindow:
    """Timestamped observations kept for `window_s` seconds; percentiles over what remains."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque()

    def add(self, value: float, now: float) -> None:
        self._items.append((now, value))

    def _trim(self, now: float) -> None:
        while self._items and self._items[0][0] < now - self.window_s:
            self._items.popleft()

    def summary(self, now: float) -> dict[str, Optional[float]]:
        self._trim(now)
        values = sorted(v for _, v in self._items)
        return {
            "count": len(values),
            "mean": sum(values) / len(values) if values else None,
            "p50": percentile(values, 50),
            "p95": percentile(values, 95),
            "p99": percentile(values, 99),
        }

    def total(self, now: float) -> float:
        self._trim(now)
        return sum(v for _, v in self._items)


class WindowStatLogger:
    """Server-side percentiles over a sliding window, for the dashboard's /stats endpoint."""

    def __init__(self, window_s: float = 60.0, history_points: int = 120) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self.ttft = SlidingWindow(window_s)
        self.itl = SlidingWindow(window_s)
        self.e2e = SlidingWindow(window_s)
        self.queue_time = SlidingWindow(window_s)
        self.prompt_tokens = SlidingWindow(window_s)
        self.generation_tokens = SlidingWindow(window_s)
        self.scheduler = SchedulerSnapshot()
        self.num_finished = 0
        self.finish_reasons: dict[str, int] = {}
        self.started = time.time()
        # (time, output tok/s, prompt tok/s, running, waiting, kv usage) once per second, for charts
        self.history: deque[dict] = deque(maxlen=history_points)
        self._last_history = 0.0

    def record(self, scheduler: SchedulerSnapshot, iteration: IterationStats) -> None:
        now = iteration.timestamp
        with self._lock:
            self.scheduler = scheduler
            for value in iteration.ttfts:
                self.ttft.add(value, now)
            for value in iteration.inter_token_latencies:
                self.itl.add(value, now)
            for request in iteration.finished:
                self.e2e.add(request.e2e_latency, now)
                self.queue_time.add(request.queue_time, now)
                self.num_finished += 1
                self.finish_reasons[request.finish_reason] = self.finish_reasons.get(request.finish_reason, 0) + 1
            self.prompt_tokens.add(iteration.num_prompt_tokens, now)
            self.generation_tokens.add(iteration.num_generation_tokens, now)
            if now - self._last_history >= 1.0:
                self._last_history = now
                self.history.append(self._point(now))

    def _point(self, now: float) -> dict:
        span = min(10.0, max(1e-9, now - self.started))
        return {
            "time": now,
            "output_tokens_per_s": self._rate(self.generation_tokens, now, span),
            "prompt_tokens_per_s": self._rate(self.prompt_tokens, now, span),
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": self.scheduler.kv_cache_usage,
        }

    @staticmethod
    def _rate(window: SlidingWindow, now: float, span: float) -> float:
        recent = sum(v for t, v in window._items if t >= now - span)
        return recent / span

    def snapshot(self) -> dict:
        now = time.time()
        with self._lock:
            sched = self.scheduler
            hit_rate = (sched.prefix_cache_hits / sched.prefix_cache_queries) if sched.prefix_cache_queries else None
            span = min(self.window_s, max(1e-9, now - self.started))
            return {
                "time": now,
                "window_s": self.window_s,
                "num_requests_running": sched.num_running,
                "num_requests_waiting": sched.num_waiting,
                "kv_cache_usage": sched.kv_cache_usage,
                "num_preemptions": sched.num_preemptions,
                "prefix_cache_queries": sched.prefix_cache_queries,
                "prefix_cache_hits": sched.prefix_cache_hits,
                "prefix_cache_hit_rate": hit_rate,
                "num_finished_requests": self.num_finished,
                "finish_reasons": dict(self.finish_reasons),
                "output_tokens_per_s": self.generation_tokens.total(now) / span,
                "prompt_tokens_per_s": self.prompt_tokens.total(now) / span,
                "ttft_s": self.ttft.summary(now),
                "itl_s": self.itl.summary(now),
                "e2e_s": self.e2e.summary(now),
                "queue_time_s": self.queue_time.summary(now),
                "history": list(self.history),
            }
