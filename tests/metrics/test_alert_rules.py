"""examples/prometheus-alerts.yml: valid rules (`promtool check rules`), alerts that fire and stay silent
where they should on series shaped like tokenmill's /metrics (`promtool test rules`), and every series
they read one that tokenmill exports. promtool comes with Debian's `prometheus` package (`make test`
installs it)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.metrics.prometheus import PrometheusStatLogger, ServerMetrics, render_together

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RULES = EXAMPLES / "prometheus-alerts.yml"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed (Debian's prometheus package; `make test` installs it)")
    return path


def test_the_rules_are_valid():
    result = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 14 rules found" in result.stdout


def test_the_alerts_fire_and_stay_silent_where_they_should():
    result = subprocess.run([promtool(), "test", "rules", "prometheus-alerts.test.yml"], cwd=EXAMPLES,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_read_only_series_tokenmill_exports():
    text = RULES.read_text()
    exprs = "\n".join(re.findall(r"expr: \|?\n?((?:.*\n)+?)(?=\s+(?:for|labels|- record|- alert):|\Z)", text))
    used = set(re.findall(r"tokenmill:[a-z0-9_]+|http_requests_total", exprs)) - {
        name for name in re.findall(r"record: (tokenmill:[a-z0-9_:]+)", text)}
    used = {name for name in used if not name.startswith("tokenmill:slo")}
    exporter, server = PrometheusStatLogger("m", device_memory=False), ServerMetrics()
    server.record_responses({"/v1/completions POST 2xx": 1})  # the HTTP counter's series appear when first seen
    rendered = render_together([server.registry, exporter.registry]).decode()  # as the server's /metrics
    exported = {s.name for family in text_string_to_metric_families(rendered) for s in family.samples}
    assert used and used <= exported, used - exported
    # The test series use the exporter's names too.
    tests = (EXAMPLES / "prometheus-alerts.test.yml").read_text()
    series = set(re.findall(r"series: '([a-z_:0-9]+)\{", tests)) - {"up"}
    assert series <= exported, series - exported
