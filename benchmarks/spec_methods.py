"""Speculative decoding by method and concurrency (docs/benchmarks.md, "Drafts from a model"): output tokens per
second with and without drafts on workload-64's prompts, greedy, the two engines in one process and alternated
run by run (median of --rounds), outputs compared token for token.

    python -m benchmarks.spec_methods --target exact-dense --spec '{"method": "qspec"}'
    python -m benchmarks.spec_methods --target default --spec '{"method": "layer_skip"}'

--target: `exact-dense` (the embedded SmolLM2 exported to float32 safetensors by benchmarks.export_hf, at
--numerics exact), `exact` (the embedded GGUF at --numerics exact), `default` (the embedded GGUF at the
default numerics), a model path (default numerics) or `exact:PATH` (that model at --numerics exact).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams

WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "bench" / "workload-64.jsonl"
# Requests per concurrency: a few at one stream (each alone), enough to keep the batch full above.
REQUESTS = {1: 2, 4: 8, 16: 16, 64: 64}


def _target(name: str) -> tuple[str | None, dict]:
    if name == "exact-dense":
        from benchmarks.export_hf import export_hf

        directory = Path(tempfile.gettempdir()) / "tokenmill-smollm2-f32"
        if not (directory / "model.safetensors").exists():
            export_hf(directory)
        return str(directory), {"numerics": "exact"}
    if name == "exact":
        return None, {"numerics": "exact"}
    if name == "default":
        return None, {}
    if name.startswith("exact:"):  # a model path at --numerics exact
        return name.removeprefix("exact:"), {"numerics": "exact"}
    return name, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="exact-dense")
    parser.add_argument("--spec", required=True, help="the speculative config, JSON")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workload", default=str(WORKLOAD))
    args = parser.parse_args()
    model, options = _target(args.target)
    requests = [json.loads(line) for line in open(args.workload, encoding="utf-8")]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    spec = json.loads(args.spec)
    levels = [int(c) for c in args.concurrency.split(",")]
    engines = {}
    for name, speculative in (("off", None), ("spec", spec)):
        engines[name] = LLM(model, max_model_len=1024, max_num_seqs=max(levels),
                            speculative_config=speculative, **options)
    print(f"target {args.target}, spec {json.dumps(spec)}, {args.max_tokens} output tokens per request", flush=True)
    for concurrency in levels:
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]}
                   for r in requests[:REQUESTS.get(concurrency, concurrency)]]
        times: dict[str, list[float]] = {"off": [], "spec": []}
        tokens: dict[str, list] = {}
        accepted = drafted = 0
        for _ in range(args.rounds):
            for name, llm in engines.items():
                core = llm.llm_engine.core.core
                core.scheduler.config = _with_max_seqs(core.scheduler.config, concurrency)
                before = core.get_stats()
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False) if concurrency > 1 else \
                    [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
                times[name].append(time.perf_counter() - start)
                tokens[name] = [o.outputs[0].token_ids for o in outputs]
                if name == "spec":
                    after = core.get_stats()
                    drafted += after.spec_num_draft_tokens - before.spec_num_draft_tokens
                    accepted += after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        total = len(prompts) * args.max_tokens
        rates = {name: total / statistics.median(runs) for name, runs in times.items()}
        print(f"concurrency {concurrency:3d}: off {rates['off']:7.1f} tok/s, spec {rates['spec']:7.1f} tok/s, "
              f"{rates['spec'] / rates['off']:.2f}x; drafts kept {accepted} of {drafted}"
              f"{'' if tokens['spec'] == tokens['off'] else '; OUTPUTS DIFFER'}", flush=True)


def _with_max_seqs(config, max_num_seqs: int):
    import dataclasses

    return dataclasses.replace(config, max_num_seqs=max_num_seqs)


if __name__ == "__main__":
    main()
