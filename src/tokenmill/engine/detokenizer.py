"""Incremental detokenization: token deltas -> text deltas that are safe to stream.

Two things are held back from a stream:
  1. bytes of a character split across tokens (byte-level BPE): a window's decode ends in
     U+FFFD until the character completes, and then the whole character comes out at once;
  2. a suffix of the text that could still grow into a stop string, so no chunk ever contains a
     piece of a stop string the request then stops on.

Decoding works on a small window of token ids rather than the whole output, vLLM-style:

    token ids:  ... | prefix_offset ......... read_offset ......... end |
                      └─ prefix_text = decode(prefix..read) ┘
                      └─ new_text    = decode(prefix..end) ───────────────┘
    emitted text = new_text[len(prefix_text):]

The prefix tokens give the decoder context (SentencePiece drops a word's leading space at the
start of a decode), and since text is only emitted once it no longer ends in U+FFFD, each window
starts on a character boundary and the emitted pieces concatenate to the decode of the whole.
For byte-level BPE that equals tokenizer.decode(output ids); for SentencePiece the first word keeps
the leading space it has after the prompt (as in vLLM), which a bare decode of the output drops.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the first output token so its leading space survives decoding.
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, stop strings and stream deltas."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or ())
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # A prompt cut inside a character would glue its bytes to the output; start clean.
            context, context_text = [], ""
        self._token_ids: list[int] = context  # only the live window, not the whole sequence
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text

        # Text is released in pieces, and only the pieces' tail is ever searched or held back, so a
        # token costs the same at the 4,000th position as at the first.
        self._released: list[str] = []  # output text that is final (no stop string can cut it)
        self._unsent: list[str] = []  # released pieces not yet handed out by get_delta
        self._held = ""  # decoded text that could still be the start of a stop string
        self._finished = False  # a stop string matched or the caller said the sequence ended

    # -- public API ---------------------------------------------------------------------------

    def update(self, new_token_ids: Sequence[int], finished: bool) -> str | None:
        """Feed newly generated tokens; returns the stop string that matched, if any.

        finished=True: the sequence ends after these tokens for another reason (length, EOS), so
        text held back for incomplete characters or possible stop strings is released.
        """
        if self._finished:
            return None
        self._token_ids.extend(new_token_ids)
        new_text = self._decode_new_text(flush=finished)
        if not new_text and not finished:
            return None
        # A stop string must end in the new text; it can start in the held text at the earliest,
        # since every suffix of released text that could begin one was held back.
        text = self._held + new_text
        stop = self._find_stop(text, len(self._held))
        if stop is not None:
            index, stop = stop
            text = text[: index + len(stop) if self.include_stop_str_in_output else index]
        hold = 0 if stop is not None or finished else self._partial_stop_len(text)
        self._release(text[: len(text) - hold])
        self._held = text[len(text) - hold:]
        if stop is not None or finished:
            self._finished = True
        return stop

    @property
    def output_text(self) -> str:
        """The text so far, without the stop string (unless included) or held-back characters."""
        if len(self._released) > 1:
            self._released[:] = ["".join(self._released)]
        return self._released[0] if self._released else ""

    @property
    def finished(self) -> bool:
        return self._finished

    def get_delta(self) -> str:
        """Text not returned by a previous call; all deltas concatenate to output_text."""
        delta = "".join(self._unsent)
        self._unsent.clear()
        return delta

    # -- internals ----------------------------------------------------------------------------

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new_text(self, flush: bool) -> str:
        """Text of the tokens past read_offset, or "" while it still ends mid-character."""
        new_text = self._decode(self._token_ids[self._prefix_offset:])
        if len(new_text) <= len(self._prefix_text):
            return ""  # e.g. a skipped special token: nothing new, keep the window as it is
        if new_text.endswith(REPLACEMENT_CHAR) and not flush:
            return ""  # an incomplete character; wait for its remaining bytes
        delta = new_text[len(self._prefix_text):]
        # Slide the window: the tokens just emitted become the next decode's context.
        del self._token_ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids)
        return delta

    def _release(self, text: str) -> None:
        if text:
            self._released.append(text)
            self._unsent.append(text)

    def _find_stop(self, text: str, new_start: int) -> tuple[int, str] | None:
        """The earliest stop string ending in text[new_start:]: (its index, the string)."""
        if not self.stop or new_start == len(text):
            return None
        search_from = max(0, new_start - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
