"""The periodic one-line engine log (throughput, queue, KV usage, prefix hit rate)."""
from __future__ import annotations

import logging
import time

from tokenmill.metrics.stats import IterationStats, SchedulerSnapshot

logger = logging.getLogger("tokenmill.stats")


class LoggingStatLogger:
    def __init__(self, interval_s: float = 10.0, model_name: str | None = None) -> None:
        """model_name: prefixes each line (a server of several models logs one line per model)."""
        self.interval_s = interval_s
        self._prefix = f"{model_name}: " if model_name else ""
        self._last_log = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_queries = 0
        self._last_hits = 0

    def record(self, scheduler: SchedulerSnapshot, iteration: IterationStats) -> None:
        self._prompt_tokens += iteration.num_prompt_tokens
        self._generation_tokens += iteration.num_generation_tokens
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.interval_s:
            return
        queries = scheduler.prefix_cache_queries - self._last_queries
        hits = scheduler.prefix_cache_hits - self._last_hits
        logger.info(
            "%sthroughput: prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d | "
            "KV cache %.1f%% | prefix cache hit rate %.1f%% | preemptions %d", self._prefix,
            self._prompt_tokens / elapsed, self._generation_tokens / elapsed, scheduler.num_running,
            scheduler.num_waiting, 100 * scheduler.kv_cache_usage, 100 * hits / queries if queries else 0.0,
            scheduler.num_preemptions)
        self._last_log = now
        self._prompt_tokens = self._generation_tokens = 0
        self._last_queries, self._last_hits = scheduler.prefix_cache_queries, scheduler.prefix_cache_hits
