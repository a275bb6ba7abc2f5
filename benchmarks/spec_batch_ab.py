"""Speculative decoding at its defaults (n-gram k = 4, adaptive length, no drafts above 8 running requests)
against none, alternated run by run in one process, at 1, 16 and 64 streams (docs/benchmarks.md,
"Adaptive draft length")."""
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
from spec_adaptive import workload

from tokenmill import LLM, SamplingParams

params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llms = {"off": LLM(kv_cache_memory_bytes="1GiB", max_model_len=1024, max_num_seqs=64),
        "adaptive": LLM(kv_cache_memory_bytes="1GiB", max_model_len=1024, max_num_seqs=64,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 4})}
for kind in ("stories", "copy"):
    for n in (1, 16, 64):
        conv = workload(kind, n)
        times = {k: [] for k in llms}
        for llm in llms.values():
            llm.chat(conv, params, use_tqdm=False)
        for _ in range(3):
            for name, llm in llms.items():  # alternated
                t = time.perf_counter()
                llm.chat(conv, params, use_tqdm=False)
                times[name].append(time.perf_counter() - t)
        off, ad = (n * 64 / statistics.median(times[k]) for k in ("off", "adaptive"))
        print(f"{kind:7s} streams={n}: off {off:6.1f} tok/s, adaptive {ad:6.1f} tok/s ({ad / off:.2f}x)", flush=True)
