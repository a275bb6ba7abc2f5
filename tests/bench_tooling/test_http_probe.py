"""http_probe's floor: a bare uvicorn app in a child process that answers /health, and the summaries."""
from __future__ import annotations

import httpx

from benchmarks import http_probe


def test_the_floor_app_answers_health_and_stops():
    floor = http_probe.FloorApp()
    try:
        with httpx.Client() as client:
            assert client.get(floor.url + "/health").status_code == 200
            latencies = http_probe.probe_raw(client, floor.url, 5, 0.0)
        assert len(latencies) == 5 and all(0 < ms < 5000 for ms in latencies)
    finally:
        floor.stop()
    assert floor.process.poll() is not None


def test_summary_percentiles_are_order_statistics():
    latencies = [float(ms) for ms in range(100, 0, -1)]  # 1..100 ms, unsorted
    assert http_probe.percentile(latencies, 0.99) == 99.0
    assert http_probe.summarize(latencies) == {"n": 100, "p50_ms": 50.5, "p99_ms": 99.0, "max_ms": 100.0}
