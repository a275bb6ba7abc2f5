"""Plain softmax attention of a run of consecutive query positions, for checking attention kernels."""
from __future__ import annotations

import torch


def windowed_causal_reference(q, keys, values, scale, first_pos, window=None, softcap=None, dtype=torch.float32):
    """q [n, Hq, D] at positions first_pos.., keys/values [ctx, Hkv, D]: softmax attention in `dtype` where
    the query at p sees keys (p - window, p] (all keys up to p without a window); scores capped as
    softcap * tanh(score / softcap) when softcap is given."""
    group = q.shape[1] // keys.shape[1]
    k = keys.to(dtype).repeat_interleave(group, dim=1)
    v = values.to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->nht", q.to(dtype), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    t = torch.arange(keys.shape[0], device=q.device)[None, :]
    p = (first_pos + torch.arange(q.shape[0], device=q.device))[:, None]
    allowed = (t <= p) if window is None else (t <= p) & (t > p - window)
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("nht,thd->nhd", scores.softmax(-1), v)
