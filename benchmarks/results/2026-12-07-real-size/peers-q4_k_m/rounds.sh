#!/bin/bash
# Alternated rounds on the 1B shape's Q4_K_M GGUF: tokenmill (defaults) vs llama.cpp's server (defaults).
cd /work/main
export SHAPE=llama-3.2-1b TOKENMILL_VARIANTS=tokenmill-gguf-q4_k_m
one() {  # engine round concurrency workload
  local out=bench-results/peers-1b-q4km/$2-c$3-$1
  PEERS=$1 CONCURRENCIES=$3 WORKLOAD=$4 OUT_DIR=$out scripts/bench_peers.sh > $out.log 2>&1 || echo "failed $out"
  echo "$(date +%H:%M:%S) done $out"
}
mkdir -p bench-results/peers-1b-q4km
W64=../shared/bench/workload-64.jsonl; W8=.bench/workload-64-first8.jsonl
one llama.cpp r1 16 $W64; one tokenmill r1 16 $W64
one tokenmill r2 16 $W64; one llama.cpp r2 16 $W64
one llama.cpp r3 16 $W64; one tokenmill r3 16 $W64
one tokenmill r1 1 $W8; one llama.cpp r1 1 $W8
one llama.cpp r2 1 $W8; one tokenmill r2 1 $W8
echo ALLDONE
