"""What crosses between the engine core and the model runner each step: plain data, no live objects.

core -> runner (`SchedulerOutput`): requests the runner has not seen yet are described once
(`NewRequestData`: prompt, tokens generated so far, sampling parameters); every scheduled request
then gets a per-step delta (`ScheduledRequest`: where its chunk starts, the chunk's token ids, the
block ids appended since the runner last heard of it, drafts to verify); preempted and finished ids
tell the runner which of its per-request states to drop. The grammar bitmask of constrained rows is
computed on the core side and sent as bytes.

runner -> core (`ModelRunnerOutput`): sampled token ids, logprobs, prompt logprobs and the drafts
each verify kept.

All of them are msgspec Structs, so the same values travel in-process or encoded (see
`tokenmill.engine.messages`).
"""
from __future__ import annotations

from typing import Optional, Union

import msgspec

from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import Logprob
from tokenmill.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, omit_defaults=True):
    """A request the runner has no state for: fresh, resumed after preemption, forked, or swapped in."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int] = None
    # Tokens generated before the runner heard of it (resumed or forked requests).
    output_token_ids: list[int] = []
    lora: Optional[LoRARequest] = None  # its LoRA adapter


class ScheduledRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    # Position of the first new token: the request's computed count before this step.
    start_position: int
    num_new_tokens: int
    # The known tokens this step computes (num_new_tokens - len(spec_token_ids) of them).
    token_ids: list[int]
    # Block ids appended to the request's block table since the runner last saw it.
    new_block_ids: list[int] = []
    # True when this step reaches the request's last known token, so a new token is sampled.
    samples: bool = False
    # Speculative decoding: drafts computed after the known tokens (the step's last
    # len(spec_token_ids) positions); each position's logits verify the next draft.
    spec_token_ids: list[int] = []
    # Models with several KV cache groups (core.kv_cache_groups): the same for groups 1, 2, ... (group 0's
    # are new_block_ids). Every group's table has one entry per block of tokens, so the lists are as long.
    more_group_block_ids: list[list[int]] = []
    # Speculative decoding with a draft model: how many drafts the runner's draft model proposes once this
    # step's token is sampled (the scheduler allocated slots for them past this step's tokens).
    draft_tokens: int = 0


class SchedulerOutput(msgspec.Struct, omit_defaults=True):
    # Decodes (one new token) come first, then prefill chunks: the attention backend relies on it.
    scheduled: list[ScheduledRequest] = []
    new_requests: list[NewRequestData] = []
    preempted_ids: list[str] = []
    finished_ids: list[str] = []
    # Copy-on-write block copies (src, dst) to do before the forward pass.
    block_copies: list[tuple[int, int]] = []
    # Swapping: (device, host) copies out, then (host, device) copies in, before the forward pass.
    swap_out: list[tuple[int, int]] = []
    swap_in: list[tuple[int, int]] = []
    # Structured outputs: request id -> row of `grammar_bitmask`, an int32 [rows, ceil(vocab / 32)]
    # array as raw bytes (bit j of word w allows token 32 w + j), filled by the engine core.
    grammar_rows: dict[str, int] = {}
    grammar_bitmask: Optional[bytes] = None
    # The prefix cache's second tier (core.kv_tier): (block id, payload) to copy into blocks before the
    # forward pass; (block id, key) of blocks this step fills, to copy out after it for the tier.
    kv_loads: list[tuple[int, bytes]] = []
    kv_stores: list[tuple[int, bytes]] = []

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class ModelRunnerOutput(msgspec.Struct, omit_defaults=True):
    sampled: dict[str, int] = {}
    logprobs: dict[str, dict[int, Logprob]] = {}
    # request id -> (position of the first scored prompt token, one entry per scored token)
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = {}
    # Speculative decoding: the drafts each verifying request keeps (they precede its sampled token), and
    # for a request asking for logprobs, their entries (the sampled token's stay in `logprobs`).
    accepted: dict[str, list[int]] = {}
    accepted_logprobs: dict[str, list[dict[int, Logprob]]] = {}
    # A draft model's proposals, for the requests whose item asked for draft_tokens (verified next step).
    drafts: dict[str, list[int]] = {}
    # (key, payload) of each block in SchedulerOutput.kv_stores, for the tier's writer.
    kv_stored: list[tuple[bytes, bytes]] = []


# ---- engine core <-> tensor-parallel workers (engine/executor.py, runner/worker.py) ----------------
# Every frame is one of these tagged structs, so one decoder reads any of them.
class WorkerReady(msgspec.Struct, tag=True):
    """A worker has loaded its shard: the KV blocks its budget holds and what a block costs it."""

    rank: int
    num_kv_blocks: int
    bytes_per_block: int
    linear_layers: str
    # The sliding window of each KV cache group (None: full attention), as core.kv_cache_groups plans them.
    kv_windows: list[Optional[int]] = []


class WorkerInitCache(msgspec.Struct, tag=True):
    """The block counts every worker can hold (the smallest of theirs) and the engine's max_model_len."""

    num_blocks: int
    num_host_blocks: int
    max_model_len: int


class WorkerStep(msgspec.Struct, tag=True):
    scheduler_output: SchedulerOutput


class WorkerStepDone(msgspec.Struct, tag=True):
    """The driver rank's answer to a WorkerStep (or to a WorkerInitCache: an empty output)."""

    output: ModelRunnerOutput


class WorkerShutdown(msgspec.Struct, tag=True):
    pass


class WorkerFailure(msgspec.Struct, tag=True):
    rank: int
    message: str
    # The TokenmillError subclass name when the failure is a user-facing one (a model that cannot load).
    error_type: Optional[str] = None


WorkerInput = Union[WorkerInitCache, WorkerStep, WorkerShutdown]
WorkerMessage = Union[WorkerReady, WorkerStepDone, WorkerFailure]
