#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run, each step under its own time limit:
#   1. the GPU-marked tests (tests/engine/test_cuda.py, swap to host memory, make bench on CUDA), and the
#      triton attention and block-quantized linear tests with their kernels compiled for the GPU (on CPU
#      they run interpreted);
#   2. `make bench` on the GPU (tokenmill vs transformers naive / static batches, bfloat16);
#   3. offline throughput at GPU-sized concurrency (`tokenmill bench throughput`, random prompts);
#   4. the engine, structured-output, sampler and server tests with CUDA as the default device.
# Usage: scripts/gpu_check.sh [OUTDIR]   (PYTHON=... to pick the interpreter, default .venv/bin/python;
# WORKLOAD=... for make bench's workload, default ../shared/bench/workload-64.jsonl)
# Writes env.txt, gpu-tests.log, triton-tests.log, bench.log, benchmarks.md, engine-core-cuda.json, throughput.json and
# suite.log under OUTDIR (default gpu-results/). Exit status: that of the GPU-marked tests, else the triton tests'.
set -u
out=${1:-gpu-results}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
export PYTHONUNBUFFERED=1

{ nvidia-smi; "$py" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  torch.cuda.get_device_name(), 'transformers', transformers.__version__)"; nproc; } >"$out/env.txt" 2>&1

timeout "${GPU_TESTS_TIMEOUT:-170}" "$py" -m pytest -q -p no:cacheprovider --timeout 150 -m gpu tests \
  >"$out/gpu-tests.log" 2>&1
status=$?
timeout "${GPU_TRITON_TIMEOUT:-150}" "$py" -m pytest -q -p no:cacheprovider --timeout 140 \
  tests/model/test_triton_attention.py tests/model/test_triton_quant_linear.py >"$out/triton-tests.log" 2>&1
triton_status=$?
[ $status -eq 0 ] && status=$triton_status

timeout "${GPU_BENCH_TIMEOUT:-160}" "$py" -m benchmarks.make_bench --device cuda --naive-limit 16 \
  ${WORKLOAD:+--workload "$WORKLOAD"} --no-tqdm --output "$out/benchmarks.md" --results-json "$out/engine-core-cuda.json" >"$out/bench.log" 2>&1

timeout "${GPU_THROUGHPUT_TIMEOUT:-60}" "$py" -m tokenmill.entrypoints.cli bench throughput --device cuda --dtype auto \
  --dataset random --num-prompts 512 --random-input-len 256 --random-output-len 128 --max-num-seqs 256 \
  --max-num-batched-tokens 8192 --disable-tqdm --result-json "$out/throughput.json" >>"$out/bench.log" 2>&1

timeout "${GPU_SUITE_TIMEOUT:-200}" "$py" -m pytest -q -p no:cacheprovider --timeout 90 -m "not gpu" \
  tests/engine tests/structured tests/sample tests/entrypoints/openai tests/metrics >"$out/suite.log" 2>&1

exit $status
