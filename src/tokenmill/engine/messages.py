"""What the engine core reports after each step (the only engine type that crosses processes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tokenmill.outputs import Logprob


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: Optional[list[dict[int, Logprob]]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # (first scored position, entries) for prompt tokens scored this step
    prompt_logprobs: Optional[tuple[int, list[dict[int, Logprob]]]] = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: Optional[float] = None
