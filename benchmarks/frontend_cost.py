"""Frontend host time per generated token, early and late in a long generation.

    python -m benchmarks.frontend_cost [--tokens 4096] [--json out.json]

Feeds one request's engine-core outputs, one token per step, through the frontend's output path
(incremental detokenization, stop-string check, output assembly, and what the streaming server
takes out of each output) and times every step. A frontend whose work grows with the text so far
shows it as a later window slower than an early one; the report compares the first and the last
512 tokens. No model runs: the token ids are a tokenized English text, so detokenization sees real
words. Runs against whichever tokenmill is on the path (the before/after comparison in
docs/benchmarks.md ran it on both trees).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

WINDOW = 512
TEXT = ("The river runs past the old mill, where the wheel still turns each morning and the miller "
        "counts the sacks of grain that farmers bring from the hills. ")


def _token_ids(tokenizer, count: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < count:
        ids.extend(tokenizer.encode(TEXT * 8, add_special_tokens=False))
    return ids[:count]


def _run_delta_frontend(tokenizer, ids: list[int]) -> list[float]:
    """The frontend with delta outputs (tokenmill.engine.output_processor)."""
    from tokenmill.engine.messages import EngineCoreOutput
    from tokenmill.engine.output_processor import OutputProcessor
    from tokenmill.sampling_params import RequestOutputKind, SamplingParams

    processor = OutputProcessor(tokenizer, [tokenizer.eos_token_id])
    params = SamplingParams(max_tokens=len(ids), stop=["\n\n\n"], output_kind=RequestOutputKind.DELTA)
    processor.add_request("r", None, [1, 2, 3], params, ["r"], None, time.monotonic())
    times = []
    for i, token in enumerate(ids):
        out = EngineCoreOutput("r", [token], finish_reason="length" if i == len(ids) - 1 else None)
        start = time.perf_counter()
        delivered, _ = processor.process_outputs([out])
        for _, output in delivered:
            _ = output.outputs[0].text  # the stream's delta
        times.append(time.perf_counter() - start)
    return times


def _run_cumulative_frontend(tokenizer, ids: list[int]) -> list[float]:
    """The frontend of engines whose outputs are cumulative (tokenmill before the message boundary):
    the engine folds each token in and copies the whole output; the server slices the new text off."""
    from tokenmill.engine.detokenizer import IncrementalDetokenizer
    from tokenmill.engine.llm_engine import LLMEngine, RequestState, SequenceState
    from tokenmill.engine.messages import EngineCoreOutput
    from tokenmill.metrics.stats import IterationStats
    from tokenmill.outputs import RequestMetrics
    from tokenmill.sampling_params import SamplingParams

    engine = LLMEngine.__new__(LLMEngine)
    engine._iteration = IterationStats()
    engine.eos_token_ids = [tokenizer.eos_token_id]
    params = SamplingParams(max_tokens=len(ids), stop=["\n\n\n"])
    seq = SequenceState(0, "r", IncrementalDetokenizer(tokenizer, [1, 2, 3], params))
    state = RequestState("r", None, [1, 2, 3], params, [seq], RequestMetrics(time.monotonic()))
    sent = 0
    times = []
    for i, token in enumerate(ids):
        out = EngineCoreOutput("r", [token], finish_reason="length" if i == len(ids) - 1 else None)
        start = time.perf_counter()
        engine._apply(state, seq, out)
        text = engine._make_output(state).outputs[0].text
        _, sent = text[sent:], len(text)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from tokenmill.model.loader import load_model_source

    tokenizer = load_model_source(None).tokenizer
    ids = _token_ids(tokenizer, args.tokens)
    try:
        import tokenmill.engine.output_processor  # noqa: F401
        frontend, run = "delta outputs (output_processor)", _run_delta_frontend
    except ImportError:
        frontend, run = "cumulative outputs", _run_cumulative_frontend
    run(tokenizer, ids[:WINDOW])  # warm-up
    times = run(tokenizer, ids)
    first = statistics.mean(times[:WINDOW]) * 1e6
    last = statistics.mean(times[-WINDOW:]) * 1e6
    result = {"frontend": frontend, "tokens": len(ids), "first_512_us_per_token": round(first, 1),
              "last_512_us_per_token": round(last, 1), "last_over_first": round(last / first, 3),
              "total_ms": round(sum(times) * 1e3, 1)}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
