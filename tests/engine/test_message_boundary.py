"""The whole engine with every message encoded and decoded (msgspec), as a process boundary would:
frontend -> core requests, forks and aborts; core -> runner SchedulerOutputs (new-request data once,
then deltas); runner -> core sampled ids; core -> frontend token deltas. Nothing but plain data
crosses, so the results must equal the in-process engine's and, greedy, HF transformers'."""
from __future__ import annotations

import pytest
import torch

from model_factory import GOLDEN_PROMPTS as PROMPTS
from model_factory import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.beam_search import BeamSearchParams
from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.engine import messages
from tokenmill.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}


def _mixed_workload(llm: LLM, tokenizer):
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS[:6]]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    requests = [{"prompt_token_ids": ids} for ids in prompt_ids]
    params = [greedy] * len(prompt_ids)
    requests += [{"prompt_token_ids": prompt_ids[0]}, {"prompt_token_ids": prompt_ids[1]},
                 {"prompt_token_ids": prompt_ids[2]}]
    params += [SamplingParams(temperature=0.9, n=3, seed=7, max_tokens=12, logprobs=2, ignore_eos=True),
               SamplingParams(temperature=0.0, max_tokens=30, prompt_logprobs=1, stop=[" the"]),
               SamplingParams(temperature=0.0, max_tokens=24,
                              structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))]
    outputs = llm.generate(requests, params, use_tqdm=False)
    beams = llm.beam_search([{"prompt_token_ids": prompt_ids[3]}], BeamSearchParams(beam_width=3, max_tokens=6))
    return prompt_ids, outputs, beams


def _summary(outputs, beams):
    rows = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              [sorted((t, round(lp.logprob, 4)) for t, lp in e.items()) for e in (c.logprobs or [])])
             for c in out.outputs] for out in outputs]
    prompt_lps = [None if out.prompt_logprobs is None else
                  [None if e is None else sorted((t, round(lp.logprob, 4)) for t, lp in e.items())
                   for e in out.prompt_logprobs] for out in outputs]
    return rows, prompt_lps, [[(s.tokens, s.text, s.finish_reason) for s in b.sequences] for b in beams]


@pytest.mark.slow
def test_engine_with_every_message_round_tripped_matches_in_process_and_hf(tiny_llama_dir, smollm2_tokenizer,
                                                                           monkeypatch):
    from transformers import AutoModelForCausalLM

    encoded = {"core": 0, "runner": 0}
    original = messages.roundtrip

    def counting(message, message_type):
        encoded["runner" if message_type is SchedulerOutput else "core"] += 1
        decoded = original(message, message_type)
        assert decoded is not message and type(decoded) is message_type
        return decoded

    monkeypatch.setattr("tokenmill.engine.engine_core.roundtrip", counting)
    monkeypatch.setattr("tokenmill.engine.core_client.roundtrip", counting)
    # A small budget and a tight cache: chunked prefills, forks, copy-on-write and preemptions happen.
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", max_num_batched_tokens=32, num_kv_blocks=10,
                          max_model_len=160, numerics="exact")
    across = LLM.from_config(config, message_roundtrip=True)
    prompt_ids, outputs, beams = _mixed_workload(across, smollm2_tokenizer)
    assert encoded["runner"] > 20 and encoded["core"] > 20
    assert across.llm_engine.core.core.scheduler.num_preemptions > 0

    inproc = LLM.from_config(config)
    _, ref_outputs, ref_beams = _mixed_workload(inproc, smollm2_tokenizer)
    assert _summary(outputs, beams) == _summary(ref_outputs, ref_beams)

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for ids, out in zip(prompt_ids, outputs[:6]):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 20)
    assert len(outputs[6].outputs) == 3 and len({tuple(c.token_ids) for c in outputs[6].outputs}) > 1
    assert outputs[8].outputs[0].text.startswith('{"id":')
