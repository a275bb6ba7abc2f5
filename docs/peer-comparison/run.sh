#!/bin/bash
# tokenmill vs transformers serve (continuous batching), same weights (SmolLM2-135M fp32), same prompts.
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/peer}; mkdir -p $OUT
# The HF copy of the embedded model for transformers serve:
.venv/bin/python -m benchmarks.export_hf /tmp/smollm2-hf
COMMON="--dataset random --random-input-len 256 --random-output-len 64 --random-range-ratio 0.5 --num-prompts 24 --concurrencies 1,4,16 --prompt-format text --seed 0 --no-ignore-eos"
.venv/bin/tokenmill serve --port 8101 --max-model-len 2048 --disable-log-stats > $OUT/tm-server.log 2>&1 &
TM=$!
for i in $(seq 1 90); do sleep 2; curl -sf localhost:8101/health >/dev/null && break; done
.venv/bin/tokenmill bench sweep --base-url http://127.0.0.1:8101 $COMMON --server-pid $TM --label tokenmill --result-json $OUT/tokenmill-sweep.json > $OUT/tm-bench.log 2>&1
echo "tm rc=$?" >> $OUT/status
kill -TERM $TM; wait $TM
.venv/bin/transformers serve /tmp/smollm2-hf --continuous-batching --device cpu --dtype float32 --port 8102 > $OUT/hf-server.log 2>&1 &
HF=$!
for i in $(seq 1 90); do sleep 2; curl -sf localhost:8102/health >/dev/null && break; done
.venv/bin/tokenmill bench sweep --base-url http://127.0.0.1:8102 --model /tmp/smollm2-hf $COMMON --server-pid $HF --label transformers-serve --result-json $OUT/hf-sweep.json > $OUT/hf-bench.log 2>&1
echo "hf rc=$?" >> $OUT/status
kill -TERM $HF; wait $HF
.venv/bin/tokenmill bench compare $OUT/tokenmill-sweep.json $OUT/hf-sweep.json --labels tokenmill,transformers-serve --output-dir docs/peer-comparison > $OUT/compare.log 2>&1
echo "compare rc=$?" >> $OUT/status
