"""Throughput with LoRA adapters: the same requests on the base model alone, and spread over several adapters.

    python -m benchmarks.lora_bench --workload ../shared/bench/workload-64.jsonl --adapters 4 --rank 16

Builds `--adapters` random PEFT adapters of rank `--rank` on every projection of the model (the embedded
SmolLM2 by default; transformers' dequantized copy of the GGUF is the base PEFT sees), then runs the workload
offline (`LLM.generate`, `--max-num-seqs` requests at once, the engine's defaults otherwise) three ways,
alternating, `--rounds` times: the base model in an engine without --enable-lora; the base model's requests
in an engine with it (what enabling costs when no request uses an adapter); and request i on adapter i mod N
(--max-loras N), after one untimed pass of the workload on each engine. Prints output tokens per second of
each run and the ratios of the medians.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def build_adapters(model_path: str, count: int, rank: int, directory: Path) -> list[str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tokenmill.model.loader import load_model_source

    source = load_model_source(model_path)
    if source.is_gguf:  # transformers dequantizes the GGUF itself: the base PEFT sees
        base = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                    dtype=torch.float32)
    else:
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    paths = []
    for i in range(count):
        torch.manual_seed(100 + i)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"])
        model = get_peft_model(base, config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.01)  # small deltas: the outputs stay the model's kind of text
        path = directory / f"adapter-{i}"
        model.save_pretrained(path)
        base = model.unload()
        paths.append(str(path))
    return paths


def run(llm, requests, loras) -> float:
    from tokenmill import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--workload", required=True)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    from tokenmill import LLM, LoRARequest
    from tokenmill.bench.workloads import load_workload
    from tokenmill.model.default_model import default_model_path

    model = args.model or str(default_model_path())
    requests = load_workload(args.workload, args.num_prompts)
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_adapters(model, args.adapters, args.rank, Path(tmp))
        loras = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(paths)]
        spread = [loras[i % len(loras)] for i in range(len(requests))]
        settings = dict(max_num_seqs=args.max_num_seqs)
        engines = {"base": LLM(model, **settings),
                   "base, --enable-lora": LLM(model, enable_lora=True, max_loras=args.adapters,
                                              max_lora_rank=args.rank, **settings)}
        runs: dict[str, list[float]] = {"base": [], "base, --enable-lora": [], f"{args.adapters} adapters": []}
        # Warm-up: the whole workload once on each engine, so that what a first pass pays once stays out of the
        # timing (after a warm-up of four requests the first round ran markedly slower on every engine).
        run(engines["base"], requests, None)
        run(engines["base, --enable-lora"], requests, spread)
        for round_ in range(args.rounds):
            runs["base"].append(run(engines["base"], requests, None))
            runs["base, --enable-lora"].append(run(engines["base, --enable-lora"], requests, None))
            runs[f"{args.adapters} adapters"].append(run(engines["base, --enable-lora"], requests, spread))
            print(f"round {round_ + 1}: " + ", ".join(f"{name} {values[-1]:.1f}" for name, values in runs.items()),
                  flush=True)
    base = statistics.median(runs["base"])
    print("| run | output tok/s (each round) | median | vs base |")
    print("|---|---|---:|---:|")
    for name, values in runs.items():
        median = statistics.median(values)
        print(f"| {name} | {', '.join(f'{v:.1f}' for v in values)} | {median:.1f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
