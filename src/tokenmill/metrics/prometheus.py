"""Prometheus exporter with vLLM's metric names under the `tokenmill:` prefix.

`record` runs in the engine thread after every step; `render` runs in the HTTP server (prometheus_client's
metrics are thread-safe). Every labelled series is created up front, so a scrape before the first request
already shows zeros instead of missing series (rate() and absent() behave), as vLLM does.
"""
from __future__ import annotations

from typing import Optional

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Metric,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from tokenmill.metrics.stats import IterationStats, SchedulerSnapshot

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
# Series that exist from the start (others appear when first seen).
FINISHED_REASONS = ("stop", "length", "abort")
REJECTION_REASONS = ("queue_full", "queue_timeout")


# Tenants with series of their own in the per-tenant token counters; the rest count under "other".
MAX_TENANT_SERIES = 100
NO_TENANT = "none"  # requests with no user and no tenant key


def http_response_key(handler: str, method: str, status: int) -> str:
    """The key an HTTP answer is counted under: 'handler method Nxx' (the status class, as vLLM labels it)."""
    return f"{handler} {method} {status // 100}xx"
# Data parallelism, per engine core: (key of AsyncLLM.replica_stats(), metric name, description).
REPLICA_GAUGES = (
    ("num_requests_running", "engine_num_requests_running", "Running requests per engine core"),
    ("num_requests_waiting", "engine_num_requests_waiting", "Waiting requests per engine core"),
    ("kv_cache_usage", "engine_kv_cache_usage_perc", "KV cache usage per engine core (0-1)"),
    ("prefix_cache_queries", "engine_prefix_cache_queries", "Prompt tokens looked up per engine core (cumulative)"),
    ("prefix_cache_hits", "engine_prefix_cache_hits", "Prompt tokens found cached per engine core (cumulative)"),
    ("in_flight", "router_requests_in_flight", "Requests the router has in flight per engine core"),
    ("routed", "router_requests_routed", "Requests routed to each engine core (cumulative)"),
    ("routed_by_prefix", "router_requests_routed_by_prefix",
     "Requests routed to an engine core for its cached prefix (cumulative)"),
    ("routed_with_tier_prefix", "router_requests_with_tier_prefix",
     "Requests whose prompt prefix the shared KV offload tier held when routed (cumulative)"),
)


# The prefix cache's second tier (--kv-offload-dir): (key of SchedulerSnapshot.kv_offload, metric name, description).
# The first two are vLLM's names for prefix hits served from outside the device's cache (its KV connectors).
KV_OFFLOAD_COUNTERS = (
    ("queries", "external_prefix_cache_queries",
     "Prompt tokens looked up in the KV offload tier (those the memory prefix cache lacked)"),
    ("hits", "external_prefix_cache_hits", "Prompt tokens read back from the KV offload tier"),
    ("blocks_written", "kv_offload_blocks_written", "KV blocks written to the offload tier"),
    ("bytes_written", "kv_offload_bytes_written", "Bytes of KV blocks written to the offload tier"),
    ("blocks_read", "kv_offload_blocks_read", "KV blocks read back from the offload tier"),
    ("bytes_read", "kv_offload_bytes_read", "Bytes of KV blocks read back from the offload tier"),
    ("restore_seconds", "kv_offload_restore_seconds", "Seconds spent reading KV blocks back"),
    ("evictions", "kv_offload_evictions", "KV blocks removed from the offload tier for its budget"),
    ("corrupt", "kv_offload_corrupt_blocks",
     "Offload tier files refused by their header, length or checksum (recomputed instead)"),
    ("write_errors", "kv_offload_write_errors", "Failed writes to the offload tier (writing pauses)"),
    ("read_errors", "kv_offload_read_errors", "Failed reads from the offload tier (recomputed instead)"),
    ("dropped_writes", "kv_offload_dropped_writes", "KV blocks not written: the writer was behind"),
    ("skipped_restores", "kv_offload_skipped_restores",
     "Tier hits recomputed because computing was estimated faster than reading"),
    ("host_blocks_read", "kv_offload_host_blocks_read",
     "KV blocks read back from the offload tier's level in process memory (of kv_offload_blocks_read)"),
    ("host_evictions", "kv_offload_host_evictions",
     "KV blocks dropped from the offload tier's level in process memory for its budget"),
)
KV_OFFLOAD_GAUGES = (
    ("stored_blocks", "kv_offload_stored_blocks", "KV blocks the offload tier holds"),
    ("stored_bytes", "kv_offload_usage_bytes", "Bytes of KV blocks the offload tier holds"),
    ("host_stored_bytes", "kv_offload_host_usage_bytes", "Bytes of KV blocks the offload tier holds in process memory"),
)


class ServerMetrics:
    """What belongs to the server rather than to one of its models: the process's own metrics and the HTTP
    answers (rendered with every model's registry by render_together)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        # vLLM's name and labels (prometheus-fastapi-instrumentator's): every HTTP answer, by route, method and
        # status class, for error-rate alerts (a 5xx rate, a 429 rate).
        self.http_responses = Counter("http_requests", "HTTP responses by route, method and status class",
                                      ["handler", "method", "status"], registry=self.registry)
        self._responses_seen: dict[str, int] = {}

    def record_responses(self, totals: dict[str, int]) -> None:
        """HTTP responses (cumulative per http_response_key), passed before each scrape."""
        _count_new(totals, self._responses_seen, lambda key: self.http_responses.labels(*key.split(" ", 2)))


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None,
                 device_memory: bool = False, kv_offload: bool = False, max_loras: Optional[int] = None) -> None:
        """One model's metrics (the server's own are ServerMetrics'; render_together shows both)."""
        # A registry per engine keeps several engines in one process (tests) from colliding.
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        p = "tokenmill:"
        self.running = Gauge(p + "num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.swapped = Gauge(p + "num_requests_swapped", "Requests swapped out to host memory", labels, registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", labels, registry=r)
        self.pinned_blocks = Gauge(p + "prefix_cache_pinned_blocks", "KV blocks pinned by requests' cache_ttl_s",
                                   labels, registry=r)
        self.cached_blocks = Gauge(p + "prefix_cache_blocks", "KV blocks holding a reusable prefix", labels,
                                   registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of requests that started generating",
                                     labels, registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", labels, registry=r)
        self.success = Counter(p + "request_success", "Finished requests", labels + ["finished_reason"], registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Preemptions", labels, registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens found in the prefix cache", labels,
                                   registry=r)
        self.evictions = Counter(p + "prefix_cache_evictions", "Cached blocks evicted", labels, registry=r)
        self.spec_drafts = Counter(p + "spec_decode_num_draft_tokens", "Speculative draft tokens verified", labels,
                                   registry=r)
        self.spec_verifies = Counter(p + "spec_decode_num_drafts", "Speculative verifies (decodes that carried drafts)",
                                     labels, registry=r)
        # vLLM's name and label: how often the draft at each position was kept (acceptance per position is
        # this over spec_decode_num_drafts).
        self.spec_accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                             "Speculative drafts kept, per draft position", labels + ["position"],
                                             registry=r)
        self.spec_accepted = Counter(p + "spec_decode_num_accepted_tokens", "Speculative draft tokens kept", labels,
                                     registry=r)
        self.rejected = Counter(p + "request_rejected", "Requests refused by admission control",
                                labels + ["reason"], registry=r)
        # Tokens per tenant (the request's user, or its API key's tenant), so a machine's cost can be split by
        # customer; the first MAX_TENANT_SERIES tenants get series of their own, later ones count as "other".
        self.tenant_prompt_tokens = Counter(p + "tenant_prompt_tokens",
                                            "Prompt tokens of finished requests, per tenant",
                                            labels + ["tenant"], registry=r)
        self.tenant_generation_tokens = Counter(p + "tenant_generation_tokens",
                                                "Generated tokens of finished requests, per tenant",
                                                labels + ["tenant"], registry=r)
        self._tenants: set[str] = set()
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between consecutive tokens",
                                   LATENCY_BUCKETS)
        self.tpot = self._histogram("time_per_output_token_seconds", "Mean time per output token of a request",
                                    LATENCY_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS)
        self.queue = self._histogram("request_queue_time_seconds", "Time waiting before first scheduled",
                                     LATENCY_BUCKETS)
        self.prefill = self._histogram("request_prefill_time_seconds", "First scheduled to first token",
                                       LATENCY_BUCKETS)
        self.decode = self._histogram("request_decode_time_seconds", "First token to last token", LATENCY_BUCKETS)
        self.req_prompt = self._histogram("request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.req_generation = self._histogram("request_generation_tokens", "Generated tokens per request",
                                              TOKEN_BUCKETS)
        self.iteration_tokens = self._histogram("iteration_tokens_total", "Tokens per engine step", TOKEN_BUCKETS)
        self.model_name = model_name
        self._replica_gauges: Optional[dict[str, Gauge]] = None
        self.device_memory: Optional[Gauge] = None
        if device_memory:
            # Reported by the engine core with its stats (this process holds no CUDA context).
            self.device_memory = Gauge(p + "device_memory_used_bytes", "CUDA memory allocated by the engine",
                                       labels, registry=r)
        # Only with --kv-offload-dir: field -> counter or gauge.
        self.kv_offload_counters: dict[str, Counter] = {}
        self.kv_offload_gauges: dict[str, Gauge] = {}
        if kv_offload:
            self.kv_offload_counters = {field: Counter(p + name, doc, labels, registry=r)
                                        for field, name, doc in KV_OFFLOAD_COUNTERS}
            self.kv_offload_gauges = {field: Gauge(p + name, doc, labels, registry=r)
                                      for field, name, doc in KV_OFFLOAD_GAUGES}
        # --enable-lora: vLLM's lora_requests_info, one series whose labels name the adapters in use.
        self.max_loras = max_loras
        self.lora_info: Optional[Gauge] = None
        if max_loras is not None:
            self.lora_info = Gauge(p + "lora_requests_info", "Running stats on LoRA requests (the labels name the "
                                   "adapters of running and waiting requests; the value is the time)",
                                   ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self._last = SchedulerSnapshot()
        self._rejected_seen: dict[str, int] = {}
        self._create_series()

    def _create_series(self) -> None:
        m = self.model_name
        for metric in (self.running, self.waiting, self.swapped, self.kv_usage, self.cached_blocks, self.pinned_blocks,
                       self.prompt_tokens, self.generation_tokens, self.preemptions, self.prefix_queries,
                       self.prefix_hits, self.evictions, self.spec_drafts, self.spec_accepted, self.spec_verifies,
                       self.ttft, self.itl,
                       self.tpot, self.e2e, self.queue,
                       self.prefill, self.decode, self.req_prompt, self.req_generation, self.iteration_tokens):
            metric.labels(m)
        for offload_metric in (*self.kv_offload_counters.values(), *self.kv_offload_gauges.values()):
            offload_metric.labels(m)
        for reason in FINISHED_REASONS:
            self.success.labels(m, reason)
        for reason in REJECTION_REASONS:
            self.rejected.labels(m, reason)

    def _record_loras(self, scheduler: SchedulerSnapshot) -> None:
        """One series (the previous one cleared): the adapters of waiting and running requests, comma-joined."""
        waiting, running = (",".join(sorted(name for name, count in (counts or {}).items() if count))
                            for counts in (scheduler.lora_waiting, scheduler.lora_running))
        if self.lora_info is None:  # --enable-lora off: no series
            return
        self.lora_info.clear()
        self.lora_info.labels(str(self.max_loras), waiting, running).set_to_current_time()

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram("tokenmill:" + name, doc, ["model_name"], buckets=buckets, registry=self.registry)

    def record(self, scheduler: SchedulerSnapshot, iteration: IterationStats) -> None:
        m = self.model_name
        self.running.labels(m).set(scheduler.num_running)
        self.waiting.labels(m).set(scheduler.num_waiting)
        self.swapped.labels(m).set(scheduler.num_swapped)
        self.kv_usage.labels(m).set(scheduler.kv_cache_usage)
        self.cached_blocks.labels(m).set(scheduler.num_cached_blocks)
        self.pinned_blocks.labels(m).set(scheduler.num_pinned_blocks)
        if self.device_memory is not None:
            self.device_memory.labels(m).set(scheduler.device_memory_bytes)
        last = self._last
        self.preemptions.labels(m).inc(max(0, scheduler.num_preemptions - last.num_preemptions))
        self.prefix_queries.labels(m).inc(max(0, scheduler.prefix_cache_queries - last.prefix_cache_queries))
        self.prefix_hits.labels(m).inc(max(0, scheduler.prefix_cache_hits - last.prefix_cache_hits))
        self.evictions.labels(m).inc(max(0, scheduler.num_evictions - last.num_evictions))
        self.spec_drafts.labels(m).inc(max(0, scheduler.spec_num_draft_tokens - last.spec_num_draft_tokens))
        self.spec_accepted.labels(m).inc(max(0, scheduler.spec_num_accepted_tokens - last.spec_num_accepted_tokens))
        self.spec_verifies.labels(m).inc(max(0, scheduler.spec_num_drafts - last.spec_num_drafts))
        before = last.spec_accepted_per_position
        for position, total in enumerate(scheduler.spec_accepted_per_position):
            added = total - (before[position] if position < len(before) else 0)
            if added > 0 or position >= len(before):
                self.spec_accepted_per_pos.labels(m, str(position)).inc(max(0, added))
        offload_now, offload_before = scheduler.kv_offload or {}, last.kv_offload or {}
        for key, counter in self.kv_offload_counters.items():
            counter.labels(m).inc(max(0, offload_now.get(key, 0) - offload_before.get(key, 0)))
        for key, gauge in self.kv_offload_gauges.items():
            gauge.labels(m).set(offload_now.get(key, 0))
        if self.lora_info is not None:
            self._record_loras(scheduler)
        self._last = scheduler
        if iteration.num_tokens:
            self.prompt_tokens.labels(m).inc(iteration.num_prompt_tokens)
            self.generation_tokens.labels(m).inc(iteration.num_generation_tokens)
            self.iteration_tokens.labels(m).observe(iteration.num_tokens)
        for value in iteration.ttfts:
            self.ttft.labels(m).observe(value)
        for value in iteration.inter_token_latencies:
            self.itl.labels(m).observe(value)
        for request in iteration.finished:
            self.success.labels(m, request.finish_reason).inc()
            self.e2e.labels(m).observe(request.e2e_latency)
            self.queue.labels(m).observe(request.queue_time)
            self.prefill.labels(m).observe(request.prefill_time)
            self.decode.labels(m).observe(request.decode_time)
            self.req_prompt.labels(m).observe(request.num_prompt_tokens)
            self.req_generation.labels(m).observe(request.num_generation_tokens)
            if request.tpot is not None:
                self.tpot.labels(m).observe(request.tpot)
            tenant = self._tenant_label(request.tenant)
            self.tenant_prompt_tokens.labels(m, tenant).inc(request.num_prompt_tokens)
            self.tenant_generation_tokens.labels(m, tenant).inc(request.num_generation_tokens)

    def _tenant_label(self, tenant: Optional[str]) -> str:
        """The tenant's own label while fewer than MAX_TENANT_SERIES have one, else "other" (bounded cardinality)."""
        name = tenant or NO_TENANT
        if name in self._tenants:
            return name
        if len(self._tenants) < MAX_TENANT_SERIES and name != "other":
            self._tenants.add(name)
            return name
        return "other"

    def record_replicas(self, replicas: list[dict]) -> None:
        """Data parallelism: each engine core's load and prefix hits, and the router's choices, labelled
        `engine` (the core's index), read at scrape time."""
        if self._replica_gauges is None:
            self._replica_gauges = {key: Gauge("tokenmill:" + metric, description, ["model_name", "engine"],
                                               registry=self.registry)
                                    for key, metric, description in REPLICA_GAUGES}
        for replica in replicas:
            for name, gauge in self._replica_gauges.items():
                gauge.labels(self.model_name, str(replica["engine"])).set(replica[name])

    def record_rejections(self, totals: dict[str, int]) -> None:
        """Admission-control refusals (cumulative per reason) happen outside engine steps, so the server
        passes the engine's running totals before each scrape."""
        _count_new(totals, self._rejected_seen, lambda reason: self.rejected.labels(self.model_name, reason))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Together:
    """Several registries as one: families of the same name (one per model) merged into one family, since an
    exposition may name each family once."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self):
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                merged.samples.extend(family.samples)
        return list(families.values())


def render_together(registries: list[CollectorRegistry]) -> bytes:
    """One exposition of several registries: the server's, and each model's (its series labelled model_name)."""
    return generate_latest(_Together(registries))


def _count_new(totals: dict[str, int], seen: dict[str, int], counter) -> None:
    """Adds to counter(key) what each running total gained since the last call (seen: the totals then)."""
    for key, total in dict(totals).items():  # a copy: the engine thread may add a key meanwhile
        if total > seen.get(key, 0):
            counter(key).inc(total - seen.get(key, 0))
            seen[key] = total
