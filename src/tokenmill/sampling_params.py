"""SamplingParams: vLLM's field names and defaults, validated on construction."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

from tokenmill.errors import InvalidRequestError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20  # the default of --max-logprobs (vLLM's)


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's name and fields); exactly one may be set.

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex; choice: one of the
    given strings; grammar: a Lark grammar, or GBNF as llama.cpp writes it.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: bool = False
    # JSON only: no optional whitespace between tokens (vLLM's flag). Small models otherwise tend to
    # spend their token budget on newlines and spaces the schema allows.
    disable_any_whitespace: bool = False
    # The request field that carried it, for error messages (response_format, structured_outputs, guided_json ...).
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        set_fields = self._constraints()
        if len(set_fields) != 1:
            raise InvalidRequestError("structured outputs need exactly one of json, json_object, regex, choice or "
                                      f"grammar, got {', '.join(set_fields) or 'none'}", self.param)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of strings", self.param)

    def _constraints(self) -> list[str]:
        names = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        return names + ["json_object"] if self.json_object else names

    @property
    def kind(self) -> str:
        return self._constraints()[0]


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request holds (vLLM's names): CUMULATIVE, everything so far;
    DELTA, only what is new since the last one (streaming: O(1) per token); FINAL_ONLY, one output
    when the request ends."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


MAX_CACHE_TTL_S = 86400.0  # a pinned prefix is held for a day at most


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    # None, 0 and -1 all mean "no top-k" (vLLM accepts 0 and -1); stored as None.
    top_k: Optional[int] = None
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    detokenize: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # tokenmill's extension: keep this prompt's prefix in the prefix cache (memory, and the offload tier's
    # copy) for this many seconds after the request ends, within --kv-cache-pin-fraction of the cache.
    cache_ttl_s: Optional[float] = None
    # Reasoning models (vLLM's thinking_token_budget): at most this many tokens before `</think>`, which is
    # forced once they are spent. reasoning_end_token_id (set by the server with --reasoning-parser): that
    # token; structured outputs start after it, so the reasoning is free and the answer follows the grammar.
    thinking_token_budget: Optional[int] = None
    reasoning_end_token_id: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            self.stop = [s for s in self.stop if s]
        if self.top_k is not None and self.top_k <= 0:
            if self.top_k not in (0, -1):
                raise InvalidRequestError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}", "top_k")
            self.top_k = None
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str, param: str) -> None:
            raise InvalidRequestError(msg, param)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be at least 1, got {self.n}", "n")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty")
        if not self.repetition_penalty > 0.0:
            bad(f"repetition_penalty must be positive, got {self.repetition_penalty}", "repetition_penalty")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            bad(f"seed must fit in a signed 64-bit integer, got {self.seed}", "seed")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):  # the upper bound is the engine's --max-logprobs
            value = getattr(self, name)
            if value is not None and value < 0:
                bad(f"{name} must be non-negative, got {value}", name)
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative token ids", "stop_token_ids")
        if self.logit_bias is not None and any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            bad("logit_bias values must be in [-100, 100]", "logit_bias")
        if self.thinking_token_budget is not None and self.thinking_token_budget < 0:
            bad(f"thinking_token_budget must be non-negative, got {self.thinking_token_budget}",
                "thinking_token_budget")
        if self.cache_ttl_s is not None and not 0.0 < self.cache_ttl_s <= MAX_CACHE_TTL_S:
            bad(f"cache_ttl_s must be in (0, {MAX_CACHE_TTL_S:.0f}] seconds, got {self.cache_ttl_s}", "cache_ttl_s")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids or ())

    def clone(self, **changes) -> "SamplingParams":
        from dataclasses import replace

        return replace(self, **changes)
