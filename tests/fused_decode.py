"""The fused C++ decoder stack against the per-layer modules on one captured step, a decode step or a mixed
one (shared by the Llama/Q8_0 and the other families' bit-identity tests)."""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import torch

from tokenmill import LLM, SamplingParams


@dataclass
class DecodeStepBothWays:
    fused_calls: int  # steps the fused stack ran while generating
    metas: list  # the captured step's attention metadata, one per KV cache group (or the one)
    fused_hidden: torch.Tensor
    layered_hidden: torch.Tensor
    fused_caches: list[torch.Tensor]  # the KV caches after each path ran the step from the same state
    layered_caches: list[torch.Tensor]
    args: tuple = ()  # the captured step's forward arguments (to run it once more)
    kwargs: dict = None
    fused_ran: bool = False  # whether the captured step, run again, took the fused stack


def decode_step_both_ways(llm: LLM, prompt_ids: list[list[int]], max_tokens: int,
                          lora_request=None, mixed: bool = False) -> DecodeStepBothWays:
    """Generates greedily (counting the fused stack's calls), takes the last step whose batch holds one row per
    prompt (mixed: the last step with both decode rows and prefill chunks), and runs it again from the same caches
    through the fused stack and through the layers. lora_request: as LLM.generate takes it (the step's adapters
    stay set in the model's LoRA state)."""
    model = llm.llm_engine.core.core.runner.model
    captured = []
    original = model.forward

    def capture(*args, **kwargs):
        state = model.lora_state
        captured.append((args, kwargs, None if state is None or state.token_slots is None else state.token_slots))
        return original(*args, **kwargs)

    with mock.patch.object(model, "forward", capture), \
            mock.patch.object(model, "_forward_int8_decode", wraps=model._forward_int8_decode) as fused:
        llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                     SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False,
                     lora_request=lora_request)
    def wanted(args) -> bool:
        meta = args[3][0] if isinstance(args[3], list) else args[3]
        return 0 < meta.num_decodes < args[0].numel() if mixed else args[0].numel() == len(prompt_ids)

    args, kwargs, lora_slots = next(c for c in reversed(captured) if wanted(c[0]))
    if lora_slots is not None:  # that step's adapters, as the runner had set them
        model.lora_state.token_slots = lora_slots
    caches = args[2]
    before = [cache.clone() for cache in caches]
    with torch.inference_mode(), \
            mock.patch.object(model, "_forward_int8_decode", wraps=model._forward_int8_decode) as rerun:
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
                              [cache.clone() for cache in caches], args, kwargs, rerun.call_count == 1)
