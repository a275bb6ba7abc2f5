"""What the scheduler hands the model runner for one step."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    # Position of the first new token: the request's computed count before this step.
    start_position: int
    num_new_tokens: int
    block_ids: list[int]
    # True when this step reaches the request's last known token, so a new token is sampled.
    samples: bool = False
    # Speculative decoding: drafts computed after the request's last token (the step's last
    # len(spec_token_ids) tokens); each position's logits verify the next draft.
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.samples = (self.start_position + self.num_new_tokens >= self.request.num_tokens
                        and self.request.fork_children is None)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        end = self.start_position + self.num_new_tokens - len(self.spec_token_ids)
        known = self.request.all_token_ids[self.start_position:end]
        return known + self.spec_token_ids if self.spec_token_ids else known


@dataclass(slots=True)
class SchedulerOutput:
    # Decodes (one new token) come first, then prefill chunks: the attention backend relies on it.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    # Copy-on-write block copies (src, dst) to do before the forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Swapping: (device, host) copies out, then (host, device) copies in, before the forward pass.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)
