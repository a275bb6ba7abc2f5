"""A start-up check of a compiled attention backend against the portable torch one, on the model's own
attention shapes: `--attention-backend auto` falls back to torch (with a warning) when the kernels do not
compile or disagree here, instead of failing every request; an explicit choice is left alone."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from tokenmill.core.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from tokenmill.model.layers.attention import AttentionBackend, TorchAttentionBackend
from tokenmill.runner.input_batch import InputBatch
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")

CHECK_BLOCK_SIZE = 16
CHECK_NUM_BLOCKS = 8


def attention_mismatch(backend: AttentionBackend, attention: torch.nn.Module, dtype: torch.dtype,
                       device: torch.device) -> Optional[str]:
    """None when `backend` matches the torch backend on a decode (context 41) and a 21-token chunk after 16
    cached tokens with this layer's heads, head size, scale, window and soft-capping; else what went wrong."""
    batch = InputBatch(max_model_len=CHECK_NUM_BLOCKS * CHECK_BLOCK_SIZE, block_size=CHECK_BLOCK_SIZE)
    prompt = list(range(48))
    steps = [ScheduledRequest("decode", 40, 1, [40], [5, 0, 7]), ScheduledRequest("chunk", 16, 21, prompt[16:37],
                                                                                 [3, 6, 1])]
    params = SamplingParams(max_tokens=1)
    states = batch.update(SchedulerOutput(new_requests=[NewRequestData("decode", prompt[:41], params),
                                                        NewRequestData("chunk", prompt[:37], params)],
                                          scheduled=steps))
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
    cache = torch.randn(2, CHECK_NUM_BLOCKS, CHECK_BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(device, dtype)
    q, k, v = (torch.randn(22, n, head_dim, generator=gen).to(device, dtype) for n in (heads, kv_heads, kv_heads))
    outputs = []
    for candidate in (TorchAttentionBackend(), backend):
        meta = candidate.prepare_metadata(batch.prepare(steps, states, device, candidate.paged_decode).attention[0])
        try:
            outputs.append(candidate.forward(q, k, v, cache.clone(), meta, attention.scale, window=attention.window,
                                             softcap=attention.softcap).float())
        except Exception as exc:  # a compiler error names what failed; anything else is reported the same
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    error = (outputs[0] - outputs[1]).abs().max().item()
    if not error <= tolerance:
        return f"largest difference from the torch backend {error:.3g} (tolerance {tolerance:g})"
    return None
