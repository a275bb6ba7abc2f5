"""Decode step time at tensor-parallel sizes 1..N on one model (offline engine, greedy).

    python -m benchmarks.tp_step_time --sizes 1 3 --batch 4 --tokens 32

Each size starts its own engine, runs one warm-up request, then `--batch` requests of a short prompt
for `--tokens` tokens each and times every engine step after the first (which holds the prefills):
the median of those decode-only steps is printed per size, as a JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "The history of the printing press begins"


def decode_step_times(llm: LLM, batch: int, tokens: int) -> list[float]:
    engine = llm.llm_engine
    prompt_ids = llm.get_tokenizer()(PROMPT)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(batch):
        engine.add_request(f"step-time-{i}", ProcessedPrompt(None, list(prompt_ids)), params)
    engine.step()  # the prefills
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[:-1]  # the last step only reports finished requests' ends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads of the engine (under tensor parallelism: split between the workers)")
    args = parser.parse_args()
    for size in args.sizes:
        llm = LLM(args.model, tensor_parallel_size=size, max_model_len=512, num_kv_blocks=64,
                  num_threads=args.num_threads)
        try:
            llm.generate(["warm-up"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            times = decode_step_times(llm, args.batch, args.tokens)
        finally:
            llm.shutdown()
        print(json.dumps({"tensor_parallel_size": size, "num_threads": args.num_threads, "batch": args.batch,
                          "steps": len(times),
                          "decode_step_ms_median": round(statistics.median(times) * 1000, 2),
                          "decode_step_ms_p90": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1000, 2),
                          "linear_layers": llm.llm_engine.core.ready.linear_layers}), flush=True)


if __name__ == "__main__":
    main()
