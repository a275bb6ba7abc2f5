"""The scheduler's view of one sequence: token ids, how many are computed, and its status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    SWAPPED = 3  # preempted with its KV blocks copied to host memory
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass(eq=False)
class Request:
    """One sequence. `num_computed_tokens` catches up with `num_tokens` step by step (DESIGN.md)."""

    request_id: str
    prompt_token_ids: list[int]
    # The engine's SamplingParams; core/ only reads max_tokens/min_tokens/stop ids/ignore_eos from it.
    sampling_params: Any
    eos_token_id: Optional[int] = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    user: Optional[str] = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prompt tokens found in the prefix cache the first time the request was scheduled.
    num_cached_tokens: Optional[int] = None
    # Chained hashes of this request's full blocks (filled lazily by the KV cache manager).
    block_hashes: list[bytes] = field(default_factory=list)
    first_scheduled_time: Optional[float] = None
    # n > 1: the samples that fork from this request once its prompt (all but the last token) is
    # computed. Such a parent never samples; its children share its blocks (copy-on-write).
    # Beam search sets it after a beam sampled: [] parks the beam (holding its blocks, computing
    # nothing) until the search sets the children, which then fork from it the same way.
    fork_children: Optional[list["Request"]] = None
    # Structured outputs: the sequence's grammar state (a structured.backend.StructuredOutputGrammar;
    # opaque here). The runner masks and advances it; the scheduler stops the sequence once it terminates.
    structured_output: Optional[Any] = None
    # Speculative decoding: tokens guessed to follow (a proposer's drafts), verified by the next
    # decode step as a catch-up of 1 + len(spec_token_ids); never part of all_token_ids.
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_accepted_tokens: int = 0  # of this request's verified drafts, how many were kept
    spec_acceptance: Optional[float] = None  # adaptive draft length: recent share of drafts kept (None: none yet)
    # A draft model's proposals after this request's next step: how many (the scheduler allocates their slots).
    num_draft_lookahead: int = 0
    # The draft model rested for this request (the batch was too large): resuming means computing all its tokens.
    draft_behind: bool = False
    # Beam search: park after every sampled token (fork_children = []) until the search forks the
    # beams that continue from this one.
    park_after_sample: bool = False
    # Its LoRA adapter (a tokenmill.lora_request.LoRARequest; opaque here but for its cache_salt).
    lora: Optional[Any] = None

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def cache_salt(self) -> bytes:
        """Mixed into the first block's prefix-cache key: another adapter's blocks never match."""
        return self.lora.cache_salt if self.lora is not None else b""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """How far num_computed_tokens must catch up this round (a fork parent stops one short)."""
        return self.num_tokens - 1 if self.fork_children is not None else self.num_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.finished
