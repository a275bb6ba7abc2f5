"""metrics/prometheus.py: exact values of the exported series after known engine steps."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.metrics.prometheus import PrometheusStatLogger, ServerMetrics, render_together
from tokenmill.metrics.stats import FinishedRequestStats, IterationStats, SchedulerSnapshot


def samples(exporter: PrometheusStatLogger, server: ServerMetrics | None = None) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without model_name): value} of the rendered text (with the server's own
    metrics, as /metrics renders them, when given)."""
    out = {}
    text = render_together([server.registry, exporter.registry]) if server is not None else exporter.render()
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def value(exporter, name: str, **labels) -> float:
    return samples(exporter)[(name, tuple(sorted(labels.items())))]


def finished(reason: str, prompt: int, generated: int) -> FinishedRequestStats:
    return FinishedRequestStats(finish_reason=reason, num_prompt_tokens=prompt, num_generation_tokens=generated,
                                e2e_latency=1.5, queue_time=0.05, prefill_time=0.2, decode_time=1.2, ttft=0.3,
                                tpot=0.1)


def test_series_exist_with_zeros_before_any_request():
    exporter = PrometheusStatLogger("m")
    data = samples(exporter, ServerMetrics())
    assert data[("tokenmill:num_requests_running", ())] == 0
    assert data[("tokenmill:kv_cache_usage_perc", ())] == 0
    assert data[("tokenmill:prompt_tokens_total", ())] == 0
    assert data[("tokenmill:request_success_total", (("finished_reason", "stop"),))] == 0
    assert data[("tokenmill:request_rejected_total", (("reason", "queue_full"),))] == 0
    assert data[("tokenmill:time_to_first_token_seconds_count", ())] == 0
    assert ("process_cpu_seconds_total", ()) in data
    assert ("process_resident_memory_bytes", ()) in data
    assert all(label == "m" for family in text_string_to_metric_families(exporter.render().decode())
               if family.name.startswith("tokenmill:") for s in family.samples
               for label in [s.labels.get("model_name")])


def test_steps_move_counters_gauges_and_histograms_exactly():
    exporter = PrometheusStatLogger("m")
    exporter.record(SchedulerSnapshot(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_preemptions=1,
                                      prefix_cache_queries=64, prefix_cache_hits=16, spec_num_draft_tokens=6,
                                      spec_num_accepted_tokens=2, spec_num_drafts=2, spec_accepted_per_position=[2]),
                    IterationStats(num_prompt_tokens=30, num_generation_tokens=2, ttfts=[0.2, 0.4]))
    exporter.record(SchedulerSnapshot(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_preemptions=3,
                                      prefix_cache_queries=64, prefix_cache_hits=16, spec_num_draft_tokens=9,
                                      spec_num_accepted_tokens=5, spec_num_drafts=3,
                                      spec_accepted_per_position=[3, 1, 1]),
                    IterationStats(num_generation_tokens=2, inter_token_latencies=[0.05, 0.07],
                                   finished=[finished("length", 10, 3), finished("stop", 20, 1)]))
    assert value(exporter, "tokenmill:num_requests_running") == 0
    assert value(exporter, "tokenmill:kv_cache_usage_perc") == 0
    assert value(exporter, "tokenmill:prompt_tokens_total") == 30
    assert value(exporter, "tokenmill:generation_tokens_total") == 4
    # cumulative scheduler counters become counter increments, not double counts
    assert value(exporter, "tokenmill:num_preemptions_total") == 3
    assert value(exporter, "tokenmill:prefix_cache_queries_total") == 64
    assert value(exporter, "tokenmill:prefix_cache_hits_total") == 16
    assert value(exporter, "tokenmill:spec_decode_num_draft_tokens_total") == 9
    assert value(exporter, "tokenmill:spec_decode_num_accepted_tokens_total") == 5
    assert value(exporter, "tokenmill:spec_decode_num_drafts_total") == 3
    assert [value(exporter, "tokenmill:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(3)] == [3, 1, 1]
    assert value(exporter, "tokenmill:request_success_total", finished_reason="length") == 1
    assert value(exporter, "tokenmill:request_success_total", finished_reason="stop") == 1
    assert value(exporter, "tokenmill:request_success_total", finished_reason="abort") == 0
    assert value(exporter, "tokenmill:time_to_first_token_seconds_count") == 2
    assert abs(value(exporter, "tokenmill:time_to_first_token_seconds_sum") - 0.6) < 1e-9
    assert value(exporter, "tokenmill:time_to_first_token_seconds_bucket", le="0.25") == 1
    assert value(exporter, "tokenmill:inter_token_latency_seconds_count") == 2
    assert value(exporter, "tokenmill:e2e_request_latency_seconds_count") == 2
    assert value(exporter, "tokenmill:request_prompt_tokens_sum") == 30
    assert value(exporter, "tokenmill:request_generation_tokens_sum") == 4
    assert value(exporter, "tokenmill:time_per_output_token_seconds_count") == 2
    assert value(exporter, "tokenmill:iteration_tokens_total_count") == 2
    assert value(exporter, "tokenmill:iteration_tokens_total_sum") == 34


def test_rejections_are_counted_from_running_totals():
    exporter = PrometheusStatLogger("m")
    totals = {"queue_full": 2}
    exporter.record_rejections(totals)
    exporter.record_rejections(totals)  # the same totals again: no double count
    totals["queue_full"] = 5
    totals["queue_timeout"] = 1
    exporter.record_rejections(totals)
    assert value(exporter, "tokenmill:request_rejected_total", reason="queue_full") == 5
    assert value(exporter, "tokenmill:request_rejected_total", reason="queue_timeout") == 1


def test_http_responses_are_counted_by_route_method_and_status_class():
    from tokenmill.metrics.prometheus import http_response_key

    server = ServerMetrics()
    totals = {http_response_key("/v1/completions", "POST", 200): 3,
              http_response_key("/v1/completions", "POST", 503): 1}
    server.record_responses(totals)
    totals[http_response_key("/v1/completions", "POST", 201)] = 4  # the same class: one series
    server.record_responses(totals)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(render_together([server.registry]).decode())
               for s in family.samples}
    labels = (("handler", "/v1/completions"), ("method", "POST"))
    assert samples[("http_requests_total", tuple(sorted(labels + (("status", "2xx"),))))] == 4
    assert samples[("http_requests_total", tuple(sorted(labels + (("status", "5xx"),))))] == 1


def test_tokens_are_counted_per_tenant_with_bounded_series(monkeypatch):
    from dataclasses import replace

    from tokenmill.metrics import prometheus

    monkeypatch.setattr(prometheus, "MAX_TENANT_SERIES", 3)
    exporter = PrometheusStatLogger("m")
    requests = [replace(finished("length", 10, 4), tenant=tenant)
                for tenant in ("alice", "bob", None, "carol", "alice")]
    requests.append(replace(finished("stop", 7, 2), tenant="dave"))
    exporter.record(SchedulerSnapshot(), IterationStats(finished=requests))
    generated = {labels[0][1]: v for (name, labels), v in samples(exporter).items()
                 if name == "tokenmill:tenant_generation_tokens_total"}
    # alice (twice), bob and the tenant-less "none" hold the three series; carol and dave count as "other".
    assert generated == {"alice": 8, "bob": 4, "none": 4, "other": 6}
    assert value(exporter, "tokenmill:tenant_prompt_tokens_total", tenant="other") == 17


def test_two_exporters_in_one_process_do_not_collide():
    first, second = PrometheusStatLogger("a"), PrometheusStatLogger("b")
    first.record(SchedulerSnapshot(), IterationStats(num_generation_tokens=7))
    assert value(first, "tokenmill:generation_tokens_total") == 7
    assert value(second, "tokenmill:generation_tokens_total") == 0


def test_grafana_example_queries_only_exported_metrics():
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "examples" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {name for expr in exprs for name in re.findall(r"tokenmill:[a-z0-9_]+", expr)}
    exporter = PrometheusStatLogger("m", device_memory=False)
    exported = {s.name for family in text_string_to_metric_families(exporter.render().decode())
                for s in family.samples}
    exported.add("tokenmill:device_memory_used_bytes")  # only on CUDA
    assert used and used <= exported, used - exported
    assert any("histogram_quantile" in e and "time_to_first_token_seconds_bucket" in e for e in exprs)
