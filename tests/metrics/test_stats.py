"""metrics/stats.py: percentiles, the sliding window, the dashboard's window logger, and the log line."""
from __future__ import annotations

import logging

import pytest

from tokenmill.metrics.loggers import LoggingStatLogger
from tokenmill.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    SchedulerSnapshot,
    SlidingWindow,
    WindowStatLogger,
    percentile,
)


def finished(reason: str = "length", e2e: float = 1.0, queue: float = 0.1) -> FinishedRequestStats:
    return FinishedRequestStats(finish_reason=reason, num_prompt_tokens=10, num_generation_tokens=5,
                                e2e_latency=e2e, queue_time=queue, prefill_time=0.2, decode_time=0.7, ttft=0.3,
                                tpot=0.175)


# ---- percentile ----------------------------------------------------------------------------------
def test_percentile_of_nothing_is_none():
    assert percentile([], 50) is None


def test_percentile_of_one_value_is_that_value():
    assert percentile([3.0], 0) == percentile([3.0], 50) == percentile([3.0], 99) == 3.0


def test_percentile_interpolates_linearly_between_ranks():
    values = [1.0, 2.0, 3.0, 4.0]  # positions 0..3; q maps to (n - 1) * q / 100
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile(values, 99) == pytest.approx(3.97)


def test_percentile_matches_the_textbook_on_1_to_101():
    values = [float(v) for v in range(1, 102)]
    assert percentile(values, 50) == 51.0
    assert percentile(values, 95) == 96.0
    assert percentile(values, 99) == 100.0


# ---- sliding window ------------------------------------------------------------------------------
def test_window_summary_of_empty_window():
    assert SlidingWindow(10).summary(now=100.0) == {"count": 0, "mean": None, "p50": None, "p95": None,
                                                    "p99": None}


def test_window_forgets_observations_older_than_the_window():
    window = SlidingWindow(10.0)
    window.add(100.0, now=0.0)
    window.add(1.0, now=5.0)
    window.add(2.0, now=9.0)
    window.add(3.0, now=10.0)
    assert window.summary(now=10.0)["count"] == 4  # t=0 is exactly 10 s old: still in
    summary = window.summary(now=10.5)
    assert summary["count"] == 3
    assert summary["mean"] == pytest.approx(2.0)
    assert summary["p50"] == 2.0
    assert window.total(now=16.0) == 5.0  # t=5 dropped
    assert window.total(now=30.0) == 0.0


def test_window_trims_on_add_so_memory_stays_bounded_without_readers():
    window = SlidingWindow(1.0)
    for step in range(10_000):
        window.add(1.0, now=step * 0.01)  # 100 per second, nobody reads
    assert len(window) <= 101


def test_window_total_since():
    window = SlidingWindow(60.0)
    for t, v in [(1.0, 1.0), (2.0, 2.0), (3.0, 4.0)]:
        window.add(v, now=t)
    assert window.total_since(2.0) == 6.0
    assert window.total_since(3.5) == 0.0
    assert window.total_since(0.0) == 7.0


# ---- window stat logger ----------------------------------------------------------------------------
def test_window_logger_snapshot_counts_and_percentiles():
    logger = WindowStatLogger(window_s=60.0)
    t0 = logger.started
    sched = SchedulerSnapshot(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_preemptions=3,
                              prefix_cache_queries=200, prefix_cache_hits=50, spec_num_drafts=4,
                              spec_num_draft_tokens=8, spec_num_accepted_tokens=6, spec_accepted_per_position=[4, 2])
    logger.record(sched, IterationStats(timestamp=t0 + 1, num_prompt_tokens=100, num_generation_tokens=2,
                                        ttfts=[0.1, 0.3]))
    logger.record(sched, IterationStats(timestamp=t0 + 2, num_generation_tokens=2,
                                        inter_token_latencies=[0.02, 0.04],
                                        finished=[finished("length"), finished("stop", e2e=3.0)]))
    snap = logger.snapshot(now=t0 + 10)
    assert snap["num_requests_running"] == 2 and snap["num_requests_waiting"] == 1
    assert snap["kv_cache_usage"] == 0.25 and snap["num_preemptions"] == 3
    assert snap["prefix_cache_hit_rate"] == 0.25
    assert snap["spec_decode"] == {"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 6,
                                   "acceptance_rate": 0.75, "accepted_per_position": [4, 2],
                                   "step_draft_limit": 0}
    assert snap["num_finished_requests"] == 2
    assert snap["finish_reasons"] == {"length": 1, "stop": 1}
    assert snap["ttft_s"]["count"] == 2 and snap["ttft_s"]["p50"] == pytest.approx(0.2)
    assert snap["itl_s"]["p50"] == pytest.approx(0.03)
    assert snap["e2e_s"]["p99"] == pytest.approx(1.0 + 2.0 * 0.99)
    # 4 tokens generated over the 10 s the logger has existed
    assert snap["output_tokens_per_s"] == pytest.approx(0.4)
    assert snap["prompt_tokens_per_s"] == pytest.approx(10.0)
    # Past the window the percentiles empty out, the cumulative counts stay.
    later = logger.snapshot(now=t0 + 100)
    assert later["ttft_s"]["count"] == 0 and later["output_tokens_per_s"] == 0.0
    assert later["num_finished_requests"] == 2


def test_window_logger_history_is_one_point_per_second_with_interval_means():
    logger = WindowStatLogger(window_s=60.0, rate_span_s=5.0)
    t0 = logger.started
    sched = SchedulerSnapshot(num_running=1, kv_cache_usage=0.5)
    logger.record(sched, IterationStats(timestamp=t0 + 1.0, num_generation_tokens=5, ttfts=[0.2]))
    logger.record(sched, IterationStats(timestamp=t0 + 1.5, num_generation_tokens=5,
                                        inter_token_latencies=[0.01]))  # same second: no new point
    logger.record(sched, IterationStats(timestamp=t0 + 2.0, num_generation_tokens=5,
                                        inter_token_latencies=[0.03]))
    history = logger.snapshot(now=t0 + 2.5)["history"]
    assert [p["time"] - t0 for p in history] == [1.0, 2.0]
    first, second = history
    assert first["ttft_mean_s"] == 0.2 and first["itl_mean_s"] is None
    assert second["ttft_mean_s"] is None and second["itl_mean_s"] == pytest.approx(0.02)
    assert first["num_running"] == 1 and first["kv_cache_usage"] == 0.5
    # Rates use the last min(rate_span, age) seconds, never less than one second.
    assert first["output_tokens_per_s"] == pytest.approx(5.0)
    assert second["output_tokens_per_s"] == pytest.approx(15.0 / 2.0)


def test_window_logger_history_keeps_ticking_while_idle():
    logger = WindowStatLogger(window_s=60.0, history_points=3)
    t0 = logger.started
    logger.record(SchedulerSnapshot(), IterationStats(timestamp=t0 + 1, num_generation_tokens=1))
    for second in range(2, 8):
        logger.snapshot(now=t0 + second)
    history = logger.snapshot(now=t0 + 8)["history"]
    assert [p["time"] - t0 for p in history] == [6, 7, 8]  # bounded by history_points
    assert history[-1]["output_tokens_per_s"] == 0.0


# ---- log line --------------------------------------------------------------------------------------
def test_logging_stat_logger_writes_one_line_per_interval(caplog):
    stat_logger = LoggingStatLogger(interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="tokenmill.stats"):
        stat_logger.record(SchedulerSnapshot(num_running=3, num_waiting=2, kv_cache_usage=0.5, num_preemptions=1,
                                             prefix_cache_queries=100, prefix_cache_hits=25),
                           IterationStats(num_prompt_tokens=10, num_generation_tokens=4))
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenmill.stats"]
    assert len(lines) == 1
    line = lines[0]
    assert "running 3, waiting 2" in line and "KV cache 50.0%" in line
    assert "prefix cache hit rate 25.0%" in line and "preemptions 1" in line


def test_logging_stat_logger_stays_quiet_within_the_interval(caplog):
    stat_logger = LoggingStatLogger(interval_s=3600.0)
    with caplog.at_level(logging.INFO, logger="tokenmill.stats"):
        for _ in range(5):
            stat_logger.record(SchedulerSnapshot(), IterationStats(num_generation_tokens=1))
    assert not [r for r in caplog.records if r.name == "tokenmill.stats"]


def test_window_logger_fills_an_idle_gap_with_the_state_that_held():
    logger = WindowStatLogger(window_s=60.0, rate_span_s=5.0)
    t0 = logger.started
    logger.record(SchedulerSnapshot(num_running=2, kv_cache_usage=0.5),
                  IterationStats(timestamp=t0 + 1, num_generation_tokens=10))
    logger.record(SchedulerSnapshot(num_running=0), IterationStats(timestamp=t0 + 10, num_generation_tokens=4))
    history = logger.snapshot(now=t0 + 10.5)["history"]
    assert [p["time"] - t0 for p in history] == [1, 2, 9, 10]
    assert [p["num_running"] for p in history] == [2, 2, 2, 0]
    # each point's rate counts only tokens up to its own time: 10 tokens at t=1, 4 at t=10
    assert [p["output_tokens_per_s"] for p in history] == [10.0, 5.0, 0.0, 0.8]
