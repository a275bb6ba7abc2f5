"""The llguidance backend: grammars compiled against the model's tokenizer, token masks computed
on the CPU in well under a millisecond per row for typical JSON schemas.

The API process imports this module too (it compiles constraints to refuse bad ones before they reach
the core), so torch is imported only where bitmasks are filled, which happens in the engine core."""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Optional, Sequence

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("tokenmill")


def grammar_definition(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for the one constraint that `params` sets."""
    try:
        return _grammar_definition(params)
    except ValueError as exc:  # llguidance's converters (e.g. GBNF -> Lark) refuse bad text this way
        raise InvalidRequestError(f"invalid {params.kind} for structured output: {_one_line(str(exc))}",
                                  params.param) from None


def _grammar_definition(params: StructuredOutputsParams) -> str:
    import llguidance

    if params.json is not None or params.json_object:
        schema: Any = {"type": "object"} if params.json_object else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", params.param) from None
        if not isinstance(schema, dict):
            raise InvalidRequestError("the JSON schema must be a JSON object", params.param)
        if params.disable_any_whitespace:
            # llguidance's options ride in the schema: fixed separators, no free whitespace.
            schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ",",
                                               "key_separator": ":"}}
        return llguidance.grammar_from("json_schema", json.dumps(schema))
    if params.regex is not None:
        return llguidance.grammar_from("regex", params.regex)
    if params.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    if params.grammar is not None:
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF as llama.cpp writes it
    raise InvalidRequestError("structured outputs need one of json, json_object, regex, choice or grammar",
                              params.param)


def fill_next_token_bitmask(matcher: Any, bitmask: torch.Tensor, row: int) -> None:
    """The matcher's allowed tokens into row `row` of the int32 bitmask, as llguidance.torch's function of this
    name fills it; that module is not imported because its module-level torch.compile imports torch._dynamo,
    which stalled the engine's first structured-output step for seconds."""
    import torch

    view = bitmask[row]
    if bitmask.dtype != torch.int32 or not bitmask.is_cpu or not view.is_contiguous():
        raise ValueError("the token bitmask must be a contiguous int32 CPU tensor")
    matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())


class LLGuidanceGrammar:
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if self.matcher.is_stopped():
            return True  # the sequence ends with this step anyway
        if self.matcher.consume_token(token_id):
            return True
        logger.warning("structured output: token %d was not allowed (%s)", token_id, self.matcher.get_error())
        return False

    def valid_prefix(self, token_ids: Sequence[int], stop_before_forced: bool = False) -> int:
        if not token_ids or self.matcher.is_stopped() or self.matcher.is_error():
            return 0
        count = int(self.matcher.validate_tokens(list(token_ids)))
        consumed = 0
        for i in range(count):
            if not self.matcher.consume_token(token_ids[i]):
                count = i
                break
            consumed += 1
            if self.matcher.is_stopped() or (stop_before_forced and self.matcher.compute_ff_tokens()):
                count = i  # the grammar ends, or forced text follows, after this draft
                break
        if consumed:
            self.matcher.rollback(consumed)
        return count

    def fill_bitmasks_along(self, bitmask: torch.Tensor, first_row: int, token_ids: Sequence[int]) -> None:
        consumed = 0
        for i, token in enumerate([*token_ids, None]):
            fill_next_token_bitmask(self.matcher, bitmask, first_row + i)
            if token is None:
                break
            if self.matcher.is_stopped() or not self.matcher.consume_token(token):
                # Drafts are cut to the valid prefix before they are proposed; should one still be refused
                # here, its own row gives it probability 0, so the verify stops at it and the later rows
                # (copies of this one) are never drawn from.
                for row in range(first_row + i + 1, first_row + len(token_ids) + 1):
                    bitmask[row] = bitmask[first_row + i]
                break
            consumed += 1
        if consumed:
            self.matcher.rollback(consumed)

    def forced_tokens(self) -> list[int]:
        if self.matcher.is_stopped() or self.matcher.is_error():
            return []
        tokens = list(self.matcher.compute_ff_tokens())
        if tokens and self.matcher.consume_tokens(tokens) is False:
            logger.warning("structured output: forced tokens refused (%s)", self.matcher.get_error())
            return []
        return tokens

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_error()


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer: Optional[Any] = None

    def _tokenizer(self) -> Any:
        """Built on first use (~0.6 s for a 49k vocabulary), so unconstrained servers never pay it."""
        if self._ll_tokenizer is None:
            try:
                import llguidance.hf
            except ImportError as exc:  # pragma: no cover - a declared dependency
                raise InvalidRequestError(f"structured outputs need the llguidance package ({exc})") from None
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None)
            except Exception as exc:
                raise InvalidRequestError(f"structured outputs are not available for this tokenizer: {exc}") from None
        return self._ll_tokenizer

    def validate(self, params: StructuredOutputsParams) -> None:
        self.compile(params)  # the grammar is compiled once more per sequence when the request runs

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer(), grammar_definition(params))
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {params.kind} for structured output: "
                                      f"{_one_line(matcher.get_error())}", params.param)
        return LLGuidanceGrammar(matcher)


def _one_line(error: str, limit: int = 400) -> str:
    """llguidance's messages span lines (with a caret under the culprit); an error body wants one."""
    text = " ".join(error.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
