"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a thinking model's reply split into its reasoning
(between `<think>` and `</think>`) and its answer, returned as `reasoning_content` (and `reasoning`, the
field's newer name in vLLM) beside `content`, whole or as stream deltas.

- `deepseek_r1`: DeepSeek-R1's template opens `<think>` in the prompt, so the reply is reasoning until
  `</think>` (a leading `<think>` the model writes itself is dropped); a reply that never closes it is all
  reasoning.
- `qwen3`: Qwen3 writes `<think>` itself when it thinks (with `enable_thinking: false` its template puts an
  empty think block in the prompt): a reply that starts with `<think>` is reasoning until `</think>`; any
  other reply is all answer.

Streaming never splits a tag across the two fields: text that could be the start of a tag waits in the
parser until the next delta shows whether it is one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class ReasoningSplit:
    reasoning: Optional[str]  # None: the reply has no reasoning part
    content: str


@dataclass
class ReasoningParser:
    """One reply's parser: `split` for a whole reply, `feed` for its stream of text deltas."""

    name: str
    reasons_first: bool  # deepseek_r1: the reply is reasoning until </think>, opened or not
    _buffer: str = ""  # text held back: it may be the start of a tag
    _state: str = "start"  # start -> reasoning -> content

    def split(self, text: str) -> ReasoningSplit:
        body = text
        opened = body.lstrip().startswith(THINK_START)
        if opened:
            body = body.lstrip()[len(THINK_START):]
        if not (opened or self.reasons_first):
            return ReasoningSplit(None, text)
        reasoning, closed, content = body.partition(THINK_END)
        if not closed:
            return ReasoningSplit(reasoning, "")
        return ReasoningSplit(reasoning, content)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) to send for the next delta of text; `final`: the reply ended (nothing is held
        back then)."""
        text = self._buffer + delta
        self._buffer = ""
        reasoning, content = [], []
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if THINK_START.startswith(stripped) and stripped != THINK_START and not final:
                    self._buffer = text  # "<thi": wait for the rest
                    break
                if stripped.startswith(THINK_START):
                    text = stripped[len(THINK_START):]
                    self._state = "reasoning"
                elif self.reasons_first:
                    self._state = "reasoning"
                else:
                    self._state = "content"
                continue
            if self._state == "reasoning":
                end = text.find(THINK_END)
                if end >= 0:
                    reasoning.append(text[:end])
                    text = text[end + len(THINK_END):]
                    self._state = "content"
                    continue
                keep = 0 if final else _partial_tag_suffix(text, THINK_END)
                reasoning.append(text[:len(text) - keep])
                self._buffer = text[len(text) - keep:]
                break
            content.append(text)
            break
        return "".join(reasoning), "".join(content)

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"


def _partial_tag_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (0 if none)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


REASONING_PARSERS: dict[str, bool] = {"deepseek_r1": True, "qwen3": False}  # name -> reasons_first


def make_reasoning_parser(name: str) -> ReasoningParser:
    return ReasoningParser(name, REASONING_PARSERS[name])


def reasoning_token_count(tokenizer, token_ids: list[int], reasoning: Optional[str]) -> int:
    """The reply's tokens that carry its reasoning: up to and including `</think>` where the tokenizer has
    it as one token (Qwen3, DeepSeek-R1), else the reasoning text's own tokens."""
    if reasoning is None:
        return 0
    end_id = _single_token_id(tokenizer, THINK_END)
    if end_id is not None and end_id in token_ids:
        return token_ids.index(end_id) + 1
    if end_id is not None and reasoning is not None:  # never closed: every token was reasoning
        return len(token_ids)
    return len(tokenizer.encode(reasoning or "", add_special_tokens=False))


def _single_token_id(tokenizer, text: str) -> Optional[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def think_tag_ids(tokenizer) -> Optional[tuple[int, int]]:
    """The ids of `<think>` and `</think>` where the tokenizer has each as one token, else None."""
    start, end = _single_token_id(tokenizer, THINK_START), _single_token_id(tokenizer, THINK_END)
    return None if start is None or end is None else (start, end)


def prompt_closed_reasoning(prompt_token_ids: list[int], tags: Optional[tuple[int, int]]) -> bool:
    """Whether the prompt itself ends the reasoning: a `</think>` after its last `<think>` (Qwen3's template
    with enable_thinking false writes an empty think block), so the reply is all answer."""
    if tags is None:
        return False
    start, end = tags
    last_end = max((i for i, token in enumerate(prompt_token_ids) if token == end), default=-1)
    last_start = max((i for i, token in enumerate(prompt_token_ids) if token == start), default=-1)
    return last_end > last_start
