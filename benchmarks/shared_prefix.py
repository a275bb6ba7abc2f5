"""The shared-prefix workload: a few long system prompts, each followed by several short questions.

Token ids are synthetic and deterministic (a seeded RNG over ordinary vocabulary ids, away from the
low ids where tokenizers keep their special tokens), so every engine and configuration sees exactly
the same requests without any tokenizer or data file. Requests come round-robin over the system
prompts (question 0 of prompt 0, question 0 of prompt 1, ...), as concurrent conversations would
arrive, so a first-come-first-served scheduler meets every prefix early and a cache-aware one has
something to reorder.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Optional

from tokenmill.bench.workloads import WorkloadRequest

# Lowest synthetic token id: tokenizers keep special and control tokens at the bottom of the vocabulary.
MIN_TOKEN_ID = 256


@dataclass(slots=True)
class SharedPrefixSpec:
    num_prefixes: int = 8
    questions_per_prefix: int = 8
    prefix_len: int = 1000
    min_question_len: int = 16
    max_question_len: int = 48
    max_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prefixes", "questions_per_prefix", "prefix_len", "min_question_len", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_question_len < self.min_question_len:
            raise ValueError("max_question_len must be >= min_question_len")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _token_ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(count)]


def build_shared_prefix_workload(spec: SharedPrefixSpec, vocab_size: int,
                                 limit: Optional[int] = None) -> list[WorkloadRequest]:
    """num_prefixes x questions_per_prefix requests in round-robin order (first `limit` only)."""
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocabulary of {vocab_size} tokens is too small for synthetic prompts")
    rng = random.Random(spec.seed)
    prefixes = [_token_ids(rng, spec.prefix_len, vocab_size) for _ in range(spec.num_prefixes)]
    questions = [[_token_ids(rng, rng.randint(spec.min_question_len, spec.max_question_len), vocab_size)
                  for _ in range(spec.questions_per_prefix)] for _ in range(spec.num_prefixes)]
    requests = [
        WorkloadRequest(id=f"p{p}-q{q}", prompt_token_ids=prefixes[p] + questions[p][q], max_tokens=spec.max_tokens)
        for q in range(spec.questions_per_prefix) for p in range(spec.num_prefixes)
    ]
    return requests[:limit] if limit is not None else requests


def ideal_cached_tokens(spec: SharedPrefixSpec, num_requests: int, block_size: int) -> int:
    """Prompt tokens a perfect prefix cache serves for the first num_requests requests: the full
    blocks of the system prompt, for every request but the first of each system prompt. The
    ceiling of the measured hit rate (questions are short, so they rarely fill a block of their own)."""
    num_first = min(num_requests, spec.num_prefixes)
    return (num_requests - num_first) * (spec.prefix_len // block_size * block_size)
