"""The fused C++ decode stack against the per-layer modules on one captured decode step (shared by the
Llama/Q8_0 and the other families' bit-identity tests)."""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import torch

from tokenmill import LLM, SamplingParams


@dataclass
class DecodeStepBothWays:
    fused_calls: int  # decode steps the fused stack ran while generating
    metas: list  # the captured step's attention metadata, one per KV cache group (or the one)
    fused_hidden: torch.Tensor
    layered_hidden: torch.Tensor
    fused_caches: list[torch.Tensor]  # the KV caches after each path ran the step from the same state
    layered_caches: list[torch.Tensor]


def decode_step_both_ways(llm: LLM, prompt_ids: list[list[int]], max_tokens: int) -> DecodeStepBothWays:
    """Generates greedily (counting the fused stack's calls), takes the last step whose batch holds one row per
    prompt, and runs it again from the same caches through the fused stack and through the layers."""
    model = llm.llm_engine.core.core.runner.model
    captured = []
    original = model.forward

    def capture(*args, **kwargs):
        captured.append((args, kwargs))
        return original(*args, **kwargs)

    with mock.patch.object(model, "forward", capture), \
            mock.patch.object(model, "_forward_int8_decode", wraps=model._forward_int8_decode) as fused:
        llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                     SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    args, kwargs = next((a, k) for a, k in reversed(captured) if a[0].numel() == len(prompt_ids))
    caches = args[2]
    before = [cache.clone() for cache in caches]
    with torch.inference_mode():
        fused_hidden = model(*args, **kwargs)
        fused_caches = [cache.clone() for cache in caches]
        for cache, saved in zip(caches, before):
            cache.copy_(saved)
        saved_path, model._int8_decode = model._int8_decode, None
        try:
            layered_hidden = model(*args, **kwargs)
        finally:
            model._int8_decode = saved_path
    metas = args[3] if isinstance(args[3], list) else [args[3]]
    return DecodeStepBothWays(fused.call_count, metas, fused_hidden, layered_hidden, fused_caches,
                              [cache.clone() for cache in caches])
