"""tokenmill's Ray Serve application on a two-node Ray cluster started on this host with Ray's own CLI, as an
operator starts one on two machines (docs/deployment.md): `ray start --head` with the resource `node_a`,
`ray start --address ...` with `node_b`. `replicas=2 max_replicas_per_node=1` places an engine replica
(and a front replica) on each node; both answer; when the second node is stopped, the first node's
replicas go on answering.

Each `ray start` runs with `--block`, so that one node can be stopped alone: SIGTERM to its `ray start`
process stops that node's Ray processes (its raylet, and with it the replicas' workers, whose engine cores
follow their parent), while `ray stop` would stop every Ray process on the host. Needs the optional `ray`
extra; without it this module is skipped.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

import tokenmill  # noqa: E402
from proc_util import descendants, free_ports, still_alive, stop_process  # noqa: E402
from tokenmill.serve.ray_app import ENGINE_DEPLOYMENT, FRONT_DEPLOYMENT, REPLICA_HEADER, build_app  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPLICA = REPLICA_HEADER.decode()
APP = "tokenmill"
FAILOVER_S = 120.0  # how long requests may fail after a node is lost, before the test gives up


class RayNode:
    """`ray start ... --block` in its own session: one Ray node, stopped alone by SIGTERM."""

    def __init__(self, name: str, log_dir: Path, role: list[str], free: Iterator[int]) -> None:
        self.name = name
        ray_cli = Path(sys.executable).with_name("ray")
        # Two nodes on one host: every port a node opens is its own (workers take random ports), and
        # distinct from the others it opens (Ray refuses to start on a port named twice).
        flags = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                 "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")
        ports = {flag: str(next(free)) for flag in flags}
        cmd = [str(ray_cli), "start", *role, "--num-cpus", "2", "--resources", json.dumps({name: 1}),
               *(item for pair in ports.items() for item in pair), "--disable-usage-stats", "--block"]
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.pids: set[int] = set()

    def note_processes(self) -> None:
        self.pids |= descendants(self.proc.pid)

    def stop(self, timeout_s: float = 60.0) -> list[int]:
        """Stops the node; the pids of its processes still running 30 s later (killed then)."""
        self.note_processes()
        stop_process(self.proc, timeout_s)
        self._log.close()
        leaked = still_alive(self.pids, 30)
        for pid in leaked:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return leaked


def _alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node["Alive"]]


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class Cluster:
    def __init__(self, url: str, head: RayNode, second: RayNode) -> None:
        self.url, self.head, self.second = url, head, second

    def node_of(self) -> dict[str, str]:
        """Node resource name (node_a, node_b) by Ray node id, for the nodes alive now."""
        return {node["NodeID"]: name for node in _alive_nodes() for name in ("node_a", "node_b")
                if name in node["Resources"]}

    def replicas(self, deployment: str) -> dict[str, str]:
        """The deployment's live replicas: replica id -> the node (node_a, node_b) it runs on."""
        nodes = self.node_of()
        placed = {}
        for actor in ray._private.state.actors().values():
            name = actor.get("Name") or ""
            if actor["State"] == "ALIVE" and name.startswith(f"SERVE_REPLICA::{APP}#{deployment}#"):
                placed[name.rsplit("#", 1)[1]] = nodes.get(actor["Address"]["NodeID"], "unknown")
        return placed


@pytest.fixture(scope="module")
def cluster(smollm2_path) -> Iterator[Cluster]:
    log_dir = Path(tempfile.mkdtemp(prefix="tm-ray-"))  # short: Ray's socket paths live under it
    before = descendants(os.getpid())
    # Every port the cluster opens, chosen at once so that no two coincide: six per node, the GCS, the
    # Ray client server and Serve's HTTP proxy.
    free = iter(free_ports(2 * 6 + 3))
    gcs = f"127.0.0.1:{next(free)}"
    head = RayNode("node_a", log_dir, ["--head", "--port", gcs.rsplit(":", 1)[1], "--temp-dir", str(log_dir),
                                       "--include-dashboard=false", "--ray-client-server-port", str(next(free))],
                   free)
    second: Optional[RayNode] = None
    driver_pids: set[int] = set()
    try:
        # The second node joins once the head's GCS answers.
        _wait_for(lambda: head.proc.poll() is not None or b"Ray runtime started" in head.log_path.read_bytes(),
                  120, "the head node")
        assert head.proc.poll() is None, head.log_path.read_text()
        second = RayNode("node_b", log_dir, ["--address", gcs], free)
        # Ray's workers import tokenmill from wherever this process did (a checkout or the installed package).
        src = str(Path(tokenmill.__file__).resolve().parents[1])
        pythonpath = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
        ray.init(address=gcs, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
        _wait_for(lambda: len(_alive_nodes()) == 2, 120, "two Ray nodes")
        port = next(free)
        # One HTTP proxy, on the head (every node's proxy would take the same port on this one host).
        serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
        app = build_app({"model": str(smollm2_path), "replicas": "2", "front_replicas": "2",
                         "max_replicas_per_node": "1", "kv_cache_memory_bytes": "24M", "max_model_len": "512",
                         "max_num_seqs": "4", "disable_log_stats": "true", "disable_log_requests": "true",
                         "log_level": "WARNING"})
        serve.run(app, name=APP, route_prefix="/", blocking=False)
        head.note_processes()
        second.note_processes()
        yield Cluster(f"http://127.0.0.1:{port}", head, second)
    finally:
        driver_pids |= descendants(os.getpid()) - before
        try:
            serve.shutdown()
        except Exception:
            pass  # the cluster may be gone already; the nodes are stopped below regardless
        ray.shutdown()
        leaked = [] if second is None else second.stop()
        leaked += head.stop()
        leaked += still_alive(driver_pids, 30)
        shutil.rmtree(log_dir, ignore_errors=True)
        assert not leaked, f"processes left after stopping both nodes: {leaked}"


def _complete(client: httpx.Client, url: str, prompt: str) -> tuple[int, Optional[str]]:
    response = client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
    if response.status_code == 200:
        assert response.json()["choices"][0]["text"] is not None
    return response.status_code, response.headers.get(REPLICA)


# Prompts that share no prefix, each a few KV blocks long: a front sends each new one to the replica it
# remembers the fewest blocks on, so they alternate between the replicas.
PROMPTS = [f"Tell me what {word} is made of, and how it is made. " * 4 for word in
           ["bread", "glass", "paper", "steel", "cheese", "rope", "ink", "brick", "soap", "wax", "silk", "tea"]]


def test_a_replica_on_each_node_and_both_answer(cluster):
    engines = cluster.replicas(ENGINE_DEPLOYMENT)
    assert sorted(engines.values()) == ["node_a", "node_b"], engines
    assert sorted(cluster.replicas(FRONT_DEPLOYMENT).values()) == ["node_a", "node_b"]
    served = set()
    with httpx.Client(timeout=120) as client:
        for prompt in PROMPTS:
            status, replica = _complete(client, cluster.url, prompt)
            assert status == 200
            served.add(replica)
            if len(served) == 2:
                break
    assert served == set(engines), (served, engines)


def test_the_first_node_serves_on_when_the_second_is_stopped(cluster):
    engines = cluster.replicas(ENGINE_DEPLOYMENT)
    survivor = next(replica for replica, node in engines.items() if node == "node_a")
    leaked = cluster.second.stop()
    assert not leaked, f"the stopped node's processes still ran: {leaked}"
    _wait_for(lambda: len(_alive_nodes()) == 1, 60, "Ray to see the second node gone")

    # Requests in the failover window (the proxy still routing to the lost node's front or engine) may
    # fail; within FAILOVER_S they must succeed again.
    failures = []
    with httpx.Client(timeout=120) as client:
        def answered() -> bool:
            try:
                status, replica = _complete(client, cluster.url, "After the failover: what is rain?")
            except httpx.HTTPError as exc:
                failures.append(repr(exc))
                return False
            if status != 200:
                failures.append(status)
            return status == 200

        _wait_for(answered, FAILOVER_S, f"an answer after the node's loss (failures: {failures[-3:]})")
        # Then every request is answered, by the replica on the surviving node.
        results = [_complete(client, cluster.url, prompt) for prompt in PROMPTS[:6]]
    assert results == [(200, survivor)] * len(results), results
    assert cluster.replicas(ENGINE_DEPLOYMENT) == {survivor: "node_a"}
