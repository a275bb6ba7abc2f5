"""Speculative decoding on a structured-output workload (JSON schema extraction: the reply copies values
from the prompt), drafts (n-gram by default, `--spec JSON` for another method) against none, alternated run
by run in one process, at 1 and 8 streams, the embedded SmolLM2 at its default numerics or `--target` as
benchmarks.spec_methods reads it (docs/benchmarks.md, "Speculative decoding with structured outputs").

    python -m benchmarks.spec_structured --target exact-dense --spec '{"method": "qspec"}'
"""
import argparse
import json
import statistics
import time

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                           "job": {"type": "string"}, "hobbies": {"type": "array",
                                                                                  "items": {"type": "string"}}},
          "required": ["name", "city", "job", "hobbies"], "additionalProperties": False}
PEOPLE = [("Alice Martin", "Paris", "structural engineer", ["rock climbing", "watercolour painting"]),
          ("Bruno Keller", "Zurich", "pastry chef", ["cycling", "chess"]),
          ("Chiara Rossi", "Bologna", "marine biologist", ["sailing", "photography"]),
          ("Daniel Okafor", "Lagos", "software architect", ["football", "jazz piano"])]


def conversations(n: int) -> list:
    out = []
    for i in range(n):
        name, city, job, hobbies = PEOPLE[i % len(PEOPLE)]
        text = (f"{name} lives in {city} and works as a {job}. In the evenings {name.split()[0]} enjoys "
                f"{hobbies[0]} and {hobbies[1]}.")
        out.append([{"role": "user", "content": f"Extract name, city, job and hobbies as JSON ({i}):\n{text}"}])
    return out


def main() -> None:
    from benchmarks.spec_methods import _target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4}')
    args = parser.parse_args()
    model, options = _target(args.target)
    params = SamplingParams(temperature=0, max_tokens=96, structured_outputs=StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True))
    llms = {"off": LLM(model, kv_cache_memory_bytes="512MiB", max_model_len=1024, **options),
            "spec": LLM(model, kv_cache_memory_bytes="512MiB", max_model_len=1024,
                        speculative_config=json.loads(args.spec), **options)}
    for n in (1, 8):
        conv = conversations(n)
        times = {k: [] for k in llms}
        tokens = {}
        for name, llm in llms.items():
            outs = llm.chat(conv, params, use_tqdm=False)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
            json.loads(outs[0].outputs[0].text)
        assert tokens["off"] == tokens["spec"]  # greedy: the same replies
        count = sum(len(t) for t in tokens["off"])
        before = llms["spec"].llm_engine.core.core.get_stats()
        for _ in range(3):
            for name, llm in llms.items():
                start = time.perf_counter()
                llm.chat(conv, params, use_tqdm=False)
                times[name].append(time.perf_counter() - start)
        after = llms["spec"].llm_engine.core.core.get_stats()
        off, spec = (count / statistics.median(times[k]) for k in ("off", "spec"))
        print(f"streams={n}: {count} tokens per run; off {off:.1f} tok/s, "
              f"{args.spec} {spec:.1f} tok/s ({spec / off:.2f}x); "
              f"drafts kept {after.spec_num_accepted_tokens - before.spec_num_accepted_tokens} of "
              f"{after.spec_num_draft_tokens - before.spec_num_draft_tokens}", flush=True)


if __name__ == "__main__":
    main()
