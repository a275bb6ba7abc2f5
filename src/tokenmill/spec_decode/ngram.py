"""Prompt-lookup (n-gram) proposals: if the last n tokens appeared earlier in the sequence, guess that
what followed them then follows them again. Free to compute, and right often where output copies
its input (code edits, summaries, extraction, multi-turn chats that quote earlier turns).

Configured as in vLLM: `speculative_config={"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": n_max, "prompt_lookup_min": n_min}`.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tokenmill.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_max = config.prompt_lookup_max
        self.n_min = config.prompt_lookup_min

    def propose(self, tokens: Sequence[int]) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching
        suffix (n_max down to n_min tokens); [] when the suffix never occurred before."""
        length = len(tokens)
        if length < self.n_min + 1:
            return []
        ids = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            suffix = ids[length - n:]
            # Windows starting at 0 .. length - n - 1: every earlier occurrence, not the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(ids[:length - 1], n)
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return ids[start:start + self.k].tolist()
        return []


def can_speculate(request: Any) -> bool:
    """Drafts are verified by the target's own distribution (greedy: its argmax; sampling: speculative
    sampling, which keeps the distribution exactly; with a grammar, under its mask at every position; with
    logprobs, each kept draft's from its own position), so any sequence may take part: each sample of an n > 1
    request once it has forked from the prompt (a parent waiting to fork samples nothing), but not beam search's
    beams (parked after every token) nor requests scoring their prompt."""
    return (request.fork_children is None and not request.park_after_sample
            and request.sampling_params.prompt_logprobs is None)
