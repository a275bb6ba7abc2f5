"""Speculative decoding's verify: which drafts a step keeps, and the token it adds after them.

The step computed the target's logits at every draft position and at the one after the last. A plain
greedy request (no logit processors, no grammar) keeps its drafts up to the first that is not the argmax, and the
argmax there (or after the last draft) is its token: exactly the tokens the sampler would have picked one
step at a time. Every other request goes through the sampler's speculative sampling
(`Sampler.verify_drafts`), which keeps the target's distribution: temperature, top-k, top-p, min-p,
penalties, logit bias, min_tokens and seeds all apply at each position as they would without drafts, and
a structured output's grammar masks each position with the mask after the drafts before it (the engine
core computes those rows; drafts are proposed only as far as the grammar allows them).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from tokenmill.core.sched_output import ModelRunnerOutput
from tokenmill.runner.input_batch import InputBatch
from tokenmill.sample.sampler import Sampler, SamplingRequestState, has_logit_processors


def verify_drafts(sampler: Sampler, batch: InputBatch, logits: torch.Tensor, verifying: Sequence[tuple[Any, Any]],
                  result: ModelRunnerOutput, grammar_rows: Optional[Mapping[str, int]] = None,
                  grammar_bitmask: Optional[torch.Tensor] = None,
                  draft_probs: Optional[Callable[[str, int, int], Optional[torch.Tensor]]] = None) -> None:
    """logits: each verifying (item, state)'s len(drafts) + 1 positions in a run, in `verifying`'s order.
    grammar_rows: a constrained request's first row in grammar_bitmask (one row per position follows).
    draft_probs(request id, number of drafts, vocab size): the distribution q each draft was drawn from (a
    draft model's, for sampled requests), or None for drafts proposed as point masses.
    Writes each request's kept drafts and its token into `result`."""
    grammar_rows = grammar_rows or {}
    plain = [state.sampling_params.greedy and not has_logit_processors(state.sampling_params)
             and state.sampling_params.logprobs is None and item.request_id not in grammar_rows
             for item, state in verifying]
    targets = sampler.argmax(logits.float()).tolist() if any(plain) else []
    offset = 0
    rows: list[int] = []
    states: list[SamplingRequestState] = []
    sampled_items = []
    for (item, state), is_plain in zip(verifying, plain):
        drafts = item.spec_token_ids
        positions = range(offset, offset + len(drafts) + 1)
        offset += len(drafts) + 1
        if is_plain:
            chosen = [targets[row] for row in positions]
            kept = 0
            while kept < len(drafts) and drafts[kept] == chosen[kept]:
                kept += 1
            result.accepted[item.request_id] = drafts[:kept]
            result.sampled[item.request_id] = chosen[kept]
            continue
        # Position i's state counts drafts[:i] among the output: penalties and min_tokens see them.
        first_end = item.start_position + item.num_new_tokens - len(drafts)
        first_grammar_row = grammar_rows.get(item.request_id)
        for i, row in enumerate(positions):
            rows.append(row)
            states.append(batch.sampling_state(state, first_end + i,
                                               None if first_grammar_row is None else first_grammar_row + i))
        sampled_items.append(item)
    if not sampled_items:
        return
    step_logits = logits[rows]
    outcomes = sampler.verify_drafts(step_logits, states, [item.spec_token_ids for item in sampled_items],
                                     grammar_bitmask, _draft_distributions(sampled_items, draft_probs, logits.shape[1]))
    # Logprobs, where asked for, of each kept draft and of the token, from the raw logits at their positions.
    logprob_rows, logprob_tokens, logprob_owner = [], [], []
    start = 0
    for item, (kept_drafts, token) in zip(sampled_items, outcomes):
        result.accepted[item.request_id] = kept_drafts
        result.sampled[item.request_id] = token
        if states[start].params.logprobs is not None:
            chosen = [*kept_drafts, token]
            logprob_rows.extend(range(start, start + len(chosen)))
            logprob_tokens.extend(chosen)
            logprob_owner.extend([item.request_id] * len(chosen))
        start += len(item.spec_token_ids) + 1
    if logprob_rows:
        entries = sampler.token_logprobs(step_logits[logprob_rows], logprob_tokens,
                                         [states[row] for row in logprob_rows])
        for request_id, entry in zip(logprob_owner, entries):
            result.accepted_logprobs.setdefault(request_id, []).append(entry)
        for request_id in set(logprob_owner):  # the last entry is the sampled token's
            result.logprobs[request_id] = result.accepted_logprobs[request_id].pop()


def _draft_distributions(items, draft_probs, vocab_size: int) -> Optional[torch.Tensor]:
    """q's rows of every draft of `items`, in order, where any was drawn from a distribution (the others as
    one-hot rows: a point mass is the distribution of a guess); None where none was."""
    if draft_probs is None:
        return None
    found = [draft_probs(item.request_id, len(item.spec_token_ids), vocab_size) for item in items]
    if all(q is None for q in found):
        return None
    rows = []
    for item, q in zip(items, found):
        if q is None:
            q = torch.nn.functional.one_hot(torch.tensor(item.spec_token_ids), vocab_size).to(torch.float32)
        rows.append(q)
    return torch.cat(rows)
