"""Batched logits transforms used by the sampler: bias, token masks, penalties, top-k/top-p/min-p.

Every function works in place on a float32 `[num_rows, vocab]` tensor and touches only the rows it
is told about, so a batch where nobody asks for a feature pays (almost) nothing for it. Per-row
Python work is limited to flattening token lists; nothing loops over the vocabulary.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

NEG_INF = float("-inf")


def apply_logit_bias(logits: torch.Tensor, row_biases: Sequence[Mapping[int, float] | None]) -> None:
    """Add each row's {token id: bias}; ids outside the vocabulary are ignored."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for row, bias in enumerate(row_biases):
        if not bias:
            continue
        for token, value in bias.items():
            if 0 <= token < vocab:
                rows.append(row)
                cols.append(token)
                vals.append(value)
    if not rows:
        return
    device = logits.device
    logits.index_put_(
        (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
        torch.tensor(vals, dtype=logits.dtype, device=device),
        accumulate=True,
    )


def mask_tokens(logits: torch.Tensor, row_token_ids: Sequence[Sequence[int] | None]) -> None:
    """Set the listed tokens of each row to -inf (used by min_tokens to block EOS and stop ids)."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for row, tokens in enumerate(row_token_ids):
        for token in tokens or ():
            if 0 <= token < vocab:
                rows.append(row)
                cols.append(token)
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = NEG_INF


def _padded_token_ids(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), max_len] int64, padded (and out-of-range ids redirected) to column `vocab`.

    Callers scatter into a `vocab + 1` wide buffer and drop the last column, so padding never needs
    a separate mask.
    """
    max_len = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), max(max_len, 1)), vocab, dtype=torch.int64)
    for i, tokens in enumerate(token_lists):
        if len(tokens):
            padded[i, : len(tokens)] = torch.as_tensor(np.asarray(tokens), dtype=torch.int64)
    padded = torch.where((padded >= 0) & (padded < vocab), padded, vocab)
    return padded.to(device)


def token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float counts of each token id per list."""
    padded = _padded_token_ids(token_lists, vocab, device)
    counts = torch.zeros((len(token_lists), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def apply_repetition_penalty(
    logits: torch.Tensor,
    rows: Sequence[int],
    token_lists: Sequence[Sequence[int]],
    penalties: Sequence[float],
) -> None:
    """HF semantics: for tokens seen in prompt+output, divide positive logits and multiply negative ones."""
    if not rows:
        return
    vocab = logits.shape[1]
    device = logits.device
    index = torch.tensor(list(rows), device=device)
    seen = token_counts(token_lists, vocab, device) > 0
    penalty = torch.tensor(list(penalties), dtype=logits.dtype, device=device).unsqueeze(1)
    sub = logits.index_select(0, index)
    penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits.index_copy_(0, index, torch.where(seen, penalized, sub))


def apply_presence_frequency_penalties(
    logits: torch.Tensor,
    rows: Sequence[int],
    output_lists: Sequence[Sequence[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
) -> None:
    """OpenAI semantics over generated tokens: logit -= frequency * count + presence * (count > 0)."""
    if not rows:
        return
    vocab = logits.shape[1]
    device = logits.device
    index = torch.tensor(list(rows), device=device)
    counts = token_counts(output_lists, vocab, device)
    pres = torch.tensor(list(presence), dtype=logits.dtype, device=device).unsqueeze(1)
    freq = torch.tensor(list(frequency), dtype=logits.dtype, device=device).unsqueeze(1)
    delta = counts * freq + (counts > 0).to(logits.dtype) * pres
    logits.index_add_(0, index, -delta)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> None:
    """Keep each row's k largest logits (ties with the k-th value survive, as in HF); top_k: [rows] int64."""
    vocab = logits.shape[1]
    k = top_k.clamp(1, vocab)
    max_k = int(k.max().item())
    top_values = logits.topk(max_k, dim=1).values
    threshold = top_values.gather(1, (k - 1).unsqueeze(1))
    logits.masked_fill_(logits < threshold, NEG_INF)


# Tokens looked at before falling back to a full sort in top-p: peaked rows (the usual case for
# LLM outputs) reach top_p within them, and topk over a few hundred is far cheaper than a sort of
# the vocabulary on CPU.
TOP_P_CANDIDATES = 256


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keep the smallest high-probability set whose mass reaches top_p; top_p: [rows] float.

    In descending order a token stays while the mass *before* it is still below top_p, so the
    token that crosses the threshold is kept and the most likely token always is.
    """
    probs = logits.softmax(dim=1)
    k = min(TOP_P_CANDIDATES, probs.shape[1])
    top_probs, order = probs.topk(k, dim=1)
    top_p = top_p.to(device=logits.device, dtype=probs.dtype)
    remove = _top_p_remove(top_probs, order, top_p, probs.shape[1])
    # Rows whose candidates hold less than top_p of the mass need the whole sorted vocabulary.
    short = (top_probs.sum(dim=1) < top_p).nonzero().flatten()
    if short.numel():
        sorted_probs, full_order = probs.index_select(0, short).sort(dim=1, descending=True)
        remove.index_copy_(0, short, _top_p_remove(sorted_probs, full_order, top_p[short], probs.shape[1]))
    logits.masked_fill_(remove, NEG_INF)


def _top_p_remove(
    sorted_probs: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor, vocab: int
) -> torch.Tensor:
    """[rows, vocab] removal mask from descending probs; tokens missing from `order` are removed."""
    mass_before = sorted_probs.cumsum(dim=1) - sorted_probs
    remove_sorted = mass_before >= top_p.unsqueeze(1)
    remove_sorted[:, 0] = False
    remove = torch.ones((sorted_probs.shape[0], vocab), dtype=torch.bool, device=sorted_probs.device)
    return remove.scatter_(1, order, remove_sorted)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below min_p x the top probability; min_p: [rows] float.

    p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p), which skips a softmax.
    """
    log_min_p = min_p.to(device=logits.device, dtype=logits.dtype).log()  # log(0) = -inf keeps all
    max_logit = logits.amax(dim=1, keepdim=True)  # amax: max(dim) would track indices too
    logits.masked_fill_(logits - max_logit < log_min_p.unsqueeze(1), NEG_INF)
