"""Speculative decoding with n-gram drafts, greedy and sampled, one stream copying code (docs/benchmarks.md:
"Speculative sampling"): output tokens per second with and without drafts, offline, embedded SmolLM2."""
import time

from tokenmill import LLM, SamplingParams

text = ("def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n"
        "def diagonal(w, h):\n    return (w * w + h * h) ** 0.5\n")
messages = [{"role": "user", "content": "Copy this code exactly:\n" + text}]
for quant in ("none",):
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}):
        llm = LLM(kv_cache_memory_bytes="256MiB", max_model_len=1024, quantization=quant, speculative_config=spec)
        for temp in (0.0, 0.5):
            params = SamplingParams(temperature=temp, top_p=0.95, seed=1, max_tokens=64, ignore_eos=True)
            llm.chat(messages, params, use_tqdm=False)  # warm-up
            runs = []
            for _ in range(3):
                t = time.perf_counter()
                out = llm.chat(messages, params, use_tqdm=False)
                runs.append(time.perf_counter() - t)
            stats = llm.llm_engine.core.core.get_stats()
            print(f"quant={quant} spec={'ngram k=2' if spec else 'off'} temperature={temp}: "
                  f"{64 / sorted(runs)[1]:.1f} tok/s (median of 3), accepted so far {stats.spec_num_accepted_tokens} "
                  f"of {stats.spec_num_draft_tokens}", flush=True)
