"""Beam search for the server, on top of AsyncLLM.generate.

The engine loop keeps serving other requests while a beam search runs, so the offline runner
(which forks beams inside the core and needs the engine to itself) is not usable here. Instead,
every step asks the engine for one token of each live beam with 2 * beam_width logprobs; the
beams' shared prefixes come from the prefix cache, so only each beam's last partial block is
recomputed (vLLM's server takes the same approach).
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Sequence

from tokenmill.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, get_beam_search_score
from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.async_llm import AsyncLLM


async def _next_token_logprobs(engine: "AsyncLLM", tokens: list[int], params: SamplingParams,
                               request_id: str) -> dict:
    final = None
    async for output in engine.generate(ProcessedPrompt(None, tokens), params, request_id):
        final = output
    return final.outputs[0].logprobs[0]


async def beam_search(engine: "AsyncLLM", prompt: ProcessedPrompt, params: BeamSearchParams,
                      request_id: str, eos_token_ids: Sequence[int]) -> BeamSearchOutput:
    width = params.beam_width
    step_params = SamplingParams(max_tokens=1, logprobs=2 * width, temperature=params.temperature,
                                 ignore_eos=True, detokenize=False)
    engine.input_processor.validate_lengths(prompt.prompt_token_ids,
                                            SamplingParams(max_tokens=params.max_tokens))
    live = [BeamSearchSequence(list(prompt.prompt_token_ids))]
    finished: list[BeamSearchSequence] = []

    def score(seq: BeamSearchSequence) -> float:
        return get_beam_search_score(seq.tokens, seq.cum_logprob, eos_token_ids, params.length_penalty)

    for step in range(params.max_tokens):
        tops = await asyncio.gather(*(
            _next_token_logprobs(engine, beam.tokens, step_params, f"{request_id}-beam{step}-{i}")
            for i, beam in enumerate(live)))
        candidates = [beam.extended(token, top) for beam, top in zip(live, tops) for token in top]
        candidates.sort(key=score, reverse=True)
        live = []
        for candidate in candidates:
            if not params.ignore_eos and candidate.tokens[-1] in eos_token_ids:
                candidate.finish_reason, candidate.stop_reason = "stop", candidate.tokens[-1]
                finished.append(candidate)
            else:
                live.append(candidate)
            if len(live) == width:
                break
        if not live:
            break
    for beam in live:
        beam.finish_reason = "length"
    best = sorted(finished + live, key=score, reverse=True)[:width]
    num_prompt = len(prompt.prompt_token_ids)
    for seq in best:
        generated = [t for t in seq.tokens[num_prompt:] if not (seq.finish_reason == "stop" and t == seq.stop_reason)]
        seq.text = engine.tokenizer.decode(generated, skip_special_tokens=True)
    return BeamSearchOutput(best)
