"""16-bit weights (--quantization none) against the default (Q8_0 rounded at load) on one dense checkpoint:
both engines loaded in one process, alternated rounds of one-stream decode and of 16 requests at a time.

    PYTHONPATH=. python benchmarks/results/2026-12-07-real-size/dense-vs-q8_0.py CHECKPOINT_DIR
"""
import json
import statistics
import sys
import time

from benchmarks.decode_floor import one_stream_decode
from tokenmill import LLM, SamplingParams

path = sys.argv[1]
engines = {"16-bit": LLM(path, quantization="none", max_model_len=1024, kv_cache_memory_bytes="1GiB"),
           "q8_0 (default)": LLM(path, max_model_len=1024, kv_cache_memory_bytes="1GiB")}
params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
results = {name: {"ms_per_token": [], "batch16_out_tok_s": []} for name in engines}
for r in range(3):
    order = list(engines) if r % 2 == 0 else list(reversed(engines))
    for name in order:
        llm = engines[name]
        results[name]["ms_per_token"] += [t * 1e3 for t in one_stream_decode(llm, 64, 1, warm_up=r == 0)]
        prompts = [{"prompt_token_ids": [100 + r * 16 + i] + list(range(2000, 2127))} for i in range(16)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        took = time.perf_counter() - start
        results[name]["batch16_out_tok_s"].append(sum(len(o.outputs[0].token_ids) for o in outputs) / took)
        print(name, r, results[name]["ms_per_token"][-1], results[name]["batch16_out_tok_s"][-1], flush=True)
summary = {name: {k: statistics.median(v) for k, v in rows.items()} for name, rows in results.items()}
print(json.dumps({"rounds": results, "median": summary}, indent=1))
