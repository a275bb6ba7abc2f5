"""The interface between the engine and a grammar library.

A backend compiles a request's `StructuredOutputsParams` into a `StructuredOutputGrammar`, one per
sequence. Each step the sampler asks every constrained row's grammar for its allowed tokens (a
bitmask over the vocabulary) and the runner feeds the sampled token back. The scheduler ends a
sequence whose grammar has terminated. llguidance is the default backend (llguidance_backend.py).
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

from tokenmill.sampling_params import StructuredOutputsParams


class StructuredOutputGrammar(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 [rows, ceil(vocab / 32)] bitmask."""

    def accept_token(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar did not allow it."""

    def valid_prefix(self, token_ids: Sequence[int], stop_before_forced: bool = False) -> int:
        """How many of these tokens (speculative drafts) the grammar allows in a row from here, without
        advancing, stopping before one that completes the grammar (plain decoding stops right after it, where
        a verify would add the token after it). stop_before_forced: also before the first after which the
        grammar forces text (fast-forward appends it after a sampled token; a draft there, or the token
        sampled after it, would put the model's own tokenization where plain decoding puts the forced one)."""

    def fill_bitmasks_along(self, bitmask: torch.Tensor, first_row: int, token_ids: Sequence[int]) -> None:
        """Rows first_row .. first_row + len(token_ids): the tokens allowed next here, then after each of
        `token_ids` in turn (a speculative verify's positions); the grammar's state is left as it was."""

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows no alternative to from here (consumed as if sampled); may be empty."""

    def is_terminated(self) -> bool:
        """True once the grammar is complete (or broken): the sequence must stop."""


class StructuredOutputBackend(Protocol):
    name: str

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise InvalidRequestError when the grammar does not compile."""

    def compile(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A fresh grammar state for one sequence."""


def allocate_token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 [rows, ceil(vocab / 32)] bitmask with every token allowed (llguidance's and xgrammar's
    layout: bit j of word w allows token 32 w + j)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens' logits become -inf, in place. Plain torch, so it runs wherever the logits are."""
    rows, vocab = logits.shape
    shifts = _BIT_SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = (words.unsqueeze(-1) >> shifts).bitwise_and_(1).view(rows, -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


class AfterToken:
    """A grammar that starts once `token_id` is sampled (a reasoning model's `</think>`): until then every
    token is allowed and none reaches the grammar; from the token after it on, the grammar constrains."""

    def __init__(self, grammar: StructuredOutputGrammar, token_id: int) -> None:
        self.grammar = grammar
        self.token_id = token_id
        self.started = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.started:
            self.grammar.fill_bitmask(bitmask, row)
        else:
            bitmask[row] = -1

    def accept_token(self, token_id: int) -> bool:
        if self.started:
            return self.grammar.accept_token(token_id)
        self.started = token_id == self.token_id
        return True

    def _start_in(self, token_ids: Sequence[int]) -> Optional[int]:
        """How many of these tokens come before the grammar starts (None: it does not start in them)."""
        if self.started:
            return 0
        return token_ids.index(self.token_id) + 1 if self.token_id in token_ids else None

    def valid_prefix(self, token_ids: Sequence[int], stop_before_forced: bool = False) -> int:
        free = self._start_in(token_ids)
        if free is None:
            return len(token_ids)
        if free and stop_before_forced:
            return free  # where the grammar starts it may force text: no draft past it
        return free + self.grammar.valid_prefix(token_ids[free:], stop_before_forced)

    def fill_bitmasks_along(self, bitmask: torch.Tensor, first_row: int, token_ids: Sequence[int]) -> None:
        free = self._start_in(token_ids)
        rows = len(token_ids) + 1
        if free is None:
            bitmask[first_row:first_row + rows] = -1
            return
        bitmask[first_row:first_row + free] = -1
        self.grammar.fill_bitmasks_along(bitmask, first_row + free, token_ids[free:])

    def forced_tokens(self) -> list[int]:
        return self.grammar.forced_tokens() if self.started else []

    def is_terminated(self) -> bool:
        return self.started and self.grammar.is_terminated()
