"""Speculative decoding's draft length, fixed and adaptive, on text the drafts rarely match (stories) and
text they often do (copying code): output tokens per second at 1 and 8 streams, offline, the embedded
SmolLM2 at its default numerics (docs/benchmarks.md, "Adaptive draft length")."""
import time

from tokenmill import LLM, SamplingParams

FUNCS = ["def area(w, h):\n    return w * h\n", "def perimeter(w, h):\n    return 2 * (w + h)\n",
         "def diagonal(w, h):\n    return (w * w + h * h) ** 0.5\n", "def volume(w, h, d):\n    return w * h * d\n"]
TOPICS = ["a lighthouse keeper", "a lost cat", "a storm at sea", "an old clock", "a mountain village",
          "a robot gardener", "a night train", "a quiet library"]


def workload(kind: str, n: int) -> list:
    if kind == "copy":
        return [[{"role": "user", "content": f"Copy this code exactly (copy {i}):\n" + "".join(FUNCS[(i + j) % 4]
                                                                                          for j in range(3))}]
                for i in range(n)]
    return [[{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}] for i in range(n)]


def main() -> None:
    variants = {"off": None,
                "fixed k=4": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
                "adaptive k=4": {"method": "ngram", "num_speculative_tokens": 4}}
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for name, spec in variants.items():
        llm = LLM(kv_cache_memory_bytes="512MiB", max_model_len=1024, speculative_config=spec)
        for kind in ("stories", "copy"):
            for n in (1, 8):
                conversations = workload(kind, n)
                llm.chat(conversations, params, use_tqdm=False)  # warm-up; the prompts are then cached
                before = llm.llm_engine.core.core.get_stats()
                runs = []
                for _ in range(3):
                    start = time.perf_counter()
                    llm.chat(conversations, params, use_tqdm=False)
                    runs.append(time.perf_counter() - start)
                after = llm.llm_engine.core.core.get_stats()
                drafts = after.spec_num_draft_tokens - before.spec_num_draft_tokens
                kept = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
                print(f"{name:13s} {kind:7s} streams={n}: {n * 64 / sorted(runs)[1]:6.1f} tok/s, "
                      f"drafts kept {kept} of {drafts}", flush=True)


if __name__ == "__main__":
    main()
