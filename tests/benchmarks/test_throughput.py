"""The workload file format and the offline-throughput checks shared by `tokenmill bench throughput`."""
from __future__ import annotations

import pytest

from tokenmill.bench.throughput import BenchmarkError, check_output_lengths, percentile
from tokenmill.bench.workloads import WorkloadRequest, load_workload


def test_load_workload(workload_file):
    loaded = load_workload(workload_file)
    assert [(r.id, r.prompt_len, r.max_tokens) for r in loaded] == [(0, 9, 5), (1, 5, 3)]
    assert len(load_workload(workload_file, limit=1)) == 1


def test_wrong_output_length_fails_loudly():
    request = WorkloadRequest(id=7, prompt_token_ids=[1, 2], max_tokens=4)
    check_output_lengths("x", [request], [4])
    with pytest.raises(BenchmarkError, match="id 7: asked 4, got 3"):
        check_output_lengths("x", [request], [3])
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0 and percentile([], 50) is None
