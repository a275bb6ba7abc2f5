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
    """A reasoning model's reply: free until `token_id` (its `</think>`) is sampled, with at most `budget`
    tokens before it (then only that token is allowed); from the token after it on, `grammar` constrains
    (None: nothing does)."""

    def __init__(self, grammar: Optional[StructuredOutputGrammar], token_id: int, budget: Optional[int] = None
                 ) -> None:
        self.grammar = grammar
        self.token_id = token_id
        self.budget = budget
        self.spent = 0  # tokens sampled before token_id
        self.started = False

    def _fill_free(self, bitmask: torch.Tensor, row: int, spent: int) -> None:
        if self.budget is not None and spent >= self.budget:
            bitmask[row] = 0
            bitmask[row, self.token_id // 32] = _bit(self.token_id)
        else:
            bitmask[row] = -1

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if not self.started:
            self._fill_free(bitmask, row, self.spent)
        elif self.grammar is not None:
            self.grammar.fill_bitmask(bitmask, row)
        else:
            bitmask[row] = -1

    def accept_token(self, token_id: int) -> bool:
        if self.started:
            return True if self.grammar is None else self.grammar.accept_token(token_id)
        if token_id == self.token_id:
            self.started = True
            return True
        self.spent += 1
        return self.budget is None or self.spent <= self.budget

    def _free_run(self, token_ids: Sequence[int]) -> tuple[int, bool]:
        """(how many of these tokens are taken before the grammar starts, whether it starts after them)."""
        if self.started:
            return 0, True
        spent = self.spent
        for i, token in enumerate(token_ids):
            if token == self.token_id:
                return i + 1, True
            if self.budget is not None and spent >= self.budget:
                return i, False  # over budget: only token_id was allowed here
            spent += 1
        return len(token_ids), False

    def valid_prefix(self, token_ids: Sequence[int], stop_before_forced: bool = False) -> int:
        free, starts = self._free_run(token_ids)
        if not starts:
            return free
        if self.grammar is None:  # after token_id nothing constrains
            return len(token_ids)
        if free and stop_before_forced:  # where the grammar starts it may force text: no draft past it
            return free
        return free + self.grammar.valid_prefix(token_ids[free:], stop_before_forced)

    def fill_bitmasks_along(self, bitmask: torch.Tensor, first_row: int, token_ids: Sequence[int]) -> None:
        spent, row = self.spent, first_row
        if not self.started:
            for token in token_ids:
                self._fill_free(bitmask, row, spent)
                row += 1
                if token == self.token_id:
                    break
                spent += 1
            else:
                self._fill_free(bitmask, row, spent)
                return
        rest = token_ids[row - first_row:]
        if self.grammar is not None:
            self.grammar.fill_bitmasks_along(bitmask, row, rest)
        else:
            bitmask[row:row + len(rest) + 1] = -1

    def forced_tokens(self) -> list[int]:
        return self.grammar.forced_tokens() if self.started and self.grammar is not None else []

    def is_terminated(self) -> bool:
        return self.started and self.grammar is not None and self.grammar.is_terminated()


def _bit(token_id: int) -> int:
    """Token id's bit in its int32 bitmask word, as a signed 32-bit value."""
    bit = 1 << (token_id % 32)
    return bit - (1 << 32) if bit >= 1 << 31 else bit
