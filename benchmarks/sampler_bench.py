"""The sampler's C++ kernels (each row's argmax, the exponential race's uniforms) against torch's reductions and
generators, in one engine: the same workload offline, alternating the two, `--rounds` times.

    python -m benchmarks.sampler_bench --workload ../shared/bench/workload-64.jsonl --max-num-seqs 64 --temperature 0.7

Runs the embedded model (or `--model`) at the engine's defaults (or the engine flags given) on CPU; every request
to exactly its workload `max_tokens` (ignore EOS), seeded per request when `--seeded`. Prints output tokens per second
of each run and the ratio of the medians. Greedy runs (`--temperature 0`) also check that both give the same tokens.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    from benchmarks.paths import default_workload_path
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.workloads import load_workload
    from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default=None, help="default: ../shared/bench/workload-64.jsonl")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seeded", action="store_true", help="a seed per request (each row its own stream)")
    parser.add_argument("--rounds", type=int, default=4)
    # Engine options, the engine's own flags and defaults (EngineConfig).
    add_engine_args(parser, ("model", "max_num_seqs", "max_num_batched_tokens", "numerics", "block_matmul",
                             "kv_cache_dtype"))
    args = parser.parse_args()

    requests = load_workload(args.workload or default_workload_path(), args.num_prompts)
    llm = LLM.from_config(engine_config_from_args(args))
    sampler = llm.llm_engine.core.core.runner.sampler  # offline: the engine core runs in this process
    kernels = sampler._kernels
    if kernels is None:
        raise SystemExit("this engine's sampler has no C++ kernels (not on CPU, or they did not build)")
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=args.temperature, seed=i if args.seeded else None, max_tokens=r.max_tokens,
                             ignore_eos=True) for i, r in enumerate(requests)]

    def run() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        return sum(map(len, tokens)) / elapsed, tokens

    run()  # warm-up: first-call costs and the KV cache's first touch out of the timing
    runs: dict[str, list[float]] = {"torch": [], "kernels": []}
    first_tokens: dict[str, list[list[int]]] = {}
    for round_ in range(args.rounds):
        for name in runs:
            sampler._kernels = kernels if name == "kernels" else None
            tps, tokens = run()
            runs[name].append(tps)
            first_tokens.setdefault(name, tokens)
        print(f"round {round_ + 1}: " + ", ".join(f"{name} {values[-1]:.1f}" for name, values in runs.items()),
              flush=True)
    sampler._kernels = kernels
    medians = {name: statistics.median(values) for name, values in runs.items()}
    print(f"output tok/s medians: torch {medians['torch']:.1f}, kernels {medians['kernels']:.1f} "
          f"({medians['kernels'] / medians['torch']:.2f}x)")
    if args.temperature == 0.0:
        print("same tokens:", first_tokens["torch"] == first_tokens["kernels"])


if __name__ == "__main__":
    main()
