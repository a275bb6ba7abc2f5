#!/bin/bash
# Alternated rounds on the 1B shape's safetensors: tokenmill (defaults) vs vLLM's CPU backend (defaults, bf16).
cd /work/main
export SHAPE=llama-3.2-1b TOKENMILL_VARIANTS=tokenmill-safetensors
one() {  # engine round concurrency workload
  local out=bench-results/peers-1b/$2-c$3-$1
  PEERS=$1 CONCURRENCIES=$3 WORKLOAD=$4 OUT_DIR=$out scripts/bench_peers.sh > $out.log 2>&1 || echo "failed $out"
  echo "$(date +%H:%M:%S) done $out"
}
mkdir -p bench-results/peers-1b
W64=../shared/bench/workload-64.jsonl; W8=.bench/workload-64-first8.jsonl
one tokenmill r1 16 $W64; one vllm r1 16 $W64
one vllm r2 16 $W64; one tokenmill r2 16 $W64
one tokenmill r3 16 $W64; one vllm r3 16 $W64
one vllm r1 1 $W8; one tokenmill r1 1 $W8
one tokenmill r2 1 $W8; one vllm r2 1 $W8
echo ALLDONE
