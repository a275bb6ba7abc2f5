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
    spec_num_draft_tokens: int = 0  # cumulative: speculative drafts verified
    spec_num_accepted_tokens: int = 0  # cumulative: drafts kept
    spec_num_drafts: int = 0  # cumulative: verifies that carried drafts
    spec_accepted_per_position: list[int] = field(default_factory=list)  # cumulative, per draft position
    spec_step_draft_limit: int = 0  # gauge: the last step's drafts per request (0: speculation paused or off)
    device_memory_bytes: int = 0  # CUDA memory the engine core holds (0 on CPU)
    num_pinned_blocks: int = 0  # gauge: blocks requests' cache_ttl_s keep resident
    num_pins_refused: int = 0  # cumulative: blocks a pin could not hold (the pinned share was full)
    # The prefix cache's second tier (--kv-offload-dir), None without one: counters by name (queries, hits,
    # blocks/bytes written and read, restore_seconds, ...; stored_blocks and stored_bytes are gauges).
    kv_offload: Optional[dict[str, float]] = None
    # --enable-lora: adapter name -> its running / waiting requests (gauges; None without --enable-lora).
    lora_running: Optional[dict[str, float]] = None
    lora_waiting: Optional[dict[str, float]] = None


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
    tenant: Optional[str] = None  # the request's user (or its API key's tenant), for per-tenant token counts


@dataclass(slots=True)
class IterationStats:
    """What happened in one engine step."""

    timestamp: float = field(default_factory=time.time)  # the engine resets it when the step is recorded
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
    """Timestamped observations kept for `window_s` seconds; percentiles over what remains.

    Old observations are dropped on every add, so memory stays bounded by the window even when
    nobody reads the summaries (a server without a dashboard open)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, value: float, now: float) -> None:
        self._items.append((now, value))
        self._trim(now)

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

    def total_since(self, since: float, until: Optional[float] = None) -> float:
        """Sum of the observations made in [since, until] (newest last, so scan from the end)."""
        total = 0.0
        for t, v in reversed(self._items):
            if t < since:
                break
            if until is None or t <= until:
                total += v
        return total


class WindowStatLogger:
    """Server-side percentiles over a sliding window, for the dashboard's /stats endpoint.

    `record` runs in the engine thread after every step, `snapshot` in the HTTP server; a lock keeps
    them apart. `history` holds one point per second (while the engine steps or someone reads the
    snapshot) for the dashboard's charts.
    """

    def __init__(self, window_s: float = 60.0, history_points: int = 120, rate_span_s: float = 5.0) -> None:
        self.window_s = window_s
        self.rate_span_s = rate_span_s
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
        self.history: deque[dict] = deque(maxlen=history_points)
        self._last_history = 0.0
        # Latency sums since the last history point, so each point shows that second's means.
        self._interval = {"ttft_sum": 0.0, "ttft_count": 0, "itl_sum": 0.0, "itl_count": 0}

    def record(self, scheduler: SchedulerSnapshot, iteration: IterationStats) -> None:
        now = iteration.timestamp
        with self._lock:
            self._fill_idle_gap(now)  # before this step's state and observations join
            self.scheduler = scheduler
            interval = self._interval
            for value in iteration.ttfts:
                self.ttft.add(value, now)
                interval["ttft_sum"] += value
                interval["ttft_count"] += 1
            for value in iteration.inter_token_latencies:
                self.itl.add(value, now)
                interval["itl_sum"] += value
                interval["itl_count"] += 1
            for request in iteration.finished:
                self.e2e.add(request.e2e_latency, now)
                self.queue_time.add(request.queue_time, now)
                self.num_finished += 1
                self.finish_reasons[request.finish_reason] = self.finish_reasons.get(request.finish_reason, 0) + 1
            if iteration.num_prompt_tokens:
                self.prompt_tokens.add(iteration.num_prompt_tokens, now)
            if iteration.num_generation_tokens:
                self.generation_tokens.add(iteration.num_generation_tokens, now)
            self._maybe_add_history(now)

    def _fill_idle_gap(self, now: float) -> None:
        """An idle engine records nothing; when the gap since the last point is over 2 s, the state of the
        last step held all along, so two points (one second after the last, one second before now) say
        so instead of leaving a hole in the charts."""
        last = self._last_history
        if not last or now - last <= 2.0:
            return
        self._add_point(last + 1.0)
        if now - last > 3.0:
            self._add_point(now - 1.0)

    def _maybe_add_history(self, now: float) -> None:
        if now - self._last_history < 1.0:
            return
        self._fill_idle_gap(now)
        self._add_point(now)

    def _add_point(self, now: float) -> None:
        self._last_history = now
        interval = self._interval
        span = min(self.rate_span_s, max(1.0, now - self.started))
        sched = self.scheduler
        self.history.append({
            "time": now,
            "output_tokens_per_s": self.generation_tokens.total_since(now - span, now) / span,
            "prompt_tokens_per_s": self.prompt_tokens.total_since(now - span, now) / span,
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "kv_cache_usage": sched.kv_cache_usage,
            "num_preemptions": sched.num_preemptions,
            "num_finished": self.num_finished,
            "ttft_mean_s": interval["ttft_sum"] / interval["ttft_count"] if interval["ttft_count"] else None,
            "itl_mean_s": interval["itl_sum"] / interval["itl_count"] if interval["itl_count"] else None,
        })
        self._interval = {"ttft_sum": 0.0, "ttft_count": 0, "itl_sum": 0.0, "itl_count": 0}

    def snapshot(self, now: Optional[float] = None) -> dict:
        now = time.time() if now is None else now
        with self._lock:
            # An idle engine does not step; reading the snapshot keeps the charts' clock running.
            self._maybe_add_history(now)
            sched = self.scheduler
            hit_rate = (sched.prefix_cache_hits / sched.prefix_cache_queries) if sched.prefix_cache_queries else None
            span = min(self.window_s, max(1.0, now - self.started))
            return {
                "time": now,
                "uptime_s": now - self.started,
                "window_s": self.window_s,
                "num_requests_running": sched.num_running,
                "num_requests_waiting": sched.num_waiting,
                "kv_cache_usage": sched.kv_cache_usage,
                "num_preemptions": sched.num_preemptions,
                "prefix_cache_queries": sched.prefix_cache_queries,
                "prefix_cache_hits": sched.prefix_cache_hits,
                "prefix_cache_hit_rate": hit_rate,
                "prefix_cache_pinned_blocks": sched.num_pinned_blocks,
                "prefix_cache_pins_refused": sched.num_pins_refused,
                "spec_decode": {  # cumulative; acceptance per position = accepted there / verifies
                    "num_drafts": sched.spec_num_drafts,
                    "num_draft_tokens": sched.spec_num_draft_tokens,
                    "num_accepted_tokens": sched.spec_num_accepted_tokens,
                    "acceptance_rate": (sched.spec_num_accepted_tokens / sched.spec_num_draft_tokens
                                        if sched.spec_num_draft_tokens else None),
                    "accepted_per_position": list(sched.spec_accepted_per_position),
                    "step_draft_limit": sched.spec_step_draft_limit,
                },
                "kv_offload": _kv_offload_summary(sched),
                # --enable-lora: adapter name -> requests (None without it)
                "lora": None if sched.lora_running is None else {
                    "running": {name: int(n) for name, n in sched.lora_running.items() if n},
                    "waiting": {name: int(n) for name, n in (sched.lora_waiting or {}).items() if n}},
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


def _kv_offload_summary(sched: SchedulerSnapshot) -> Optional[dict]:
    """The second tier's counters for /stats, with its hit rate (None without --kv-offload-dir)."""
    if sched.kv_offload is None:
        return None
    queries = sched.kv_offload.get("queries", 0)
    return {**sched.kv_offload, "hit_rate": sched.kv_offload.get("hits", 0) / queries if queries else None}
