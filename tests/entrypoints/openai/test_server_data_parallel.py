"""`tokenmill serve --data-parallel-size 2`: two engine cores behind one server, visible per core in
/stats and /metrics, and none left behind after SIGTERM."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from proc_util import child_pids, is_alive


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the engine core processes")
def test_two_engine_cores_behind_one_server(start_server, tiny_llama_dir):
    server = start_server(["--model", str(tiny_llama_dir), "--max-model-len", "256", "--num-kv-blocks", "32",
                           "--data-parallel-size", "2"])
    cores = child_pids(server.proc.pid)
    assert len(cores) == 2
    prompt = list(range(1000, 1064))
    for suffix in range(3):  # the same 64-token prefix three times: one core computes it, then hits it
        body = {"prompt": prompt + [5, suffix], "max_tokens": 4, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    replicas = server.stats()["data_parallel"]
    assert sorted(r["routed"] for r in replicas) == [0, 3]
    assert sum(r["routed_by_prefix"] for r in replicas) == 2
    assert max(r["prefix_cache_hits"] for r in replicas) >= 2 * 64
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'tokenmill:router_requests_routed{engine="0"' in metrics
    assert 'tokenmill:engine_prefix_cache_hits{engine="1"' in metrics
    assert server.stop() == 0
    assert not [pid for pid in cores if is_alive(pid)]
