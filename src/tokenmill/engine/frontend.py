"""What every frontend of an engine core shares (the offline LLMEngine and the server's AsyncLLM):
the request-side processors built from the model's tokenizer, turning a validated request into the
core's message, and reading the core's answers (refusals, stats).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

from tokenmill.config import EngineConfig
from tokenmill.core.scheduler import QUEUE_FULL, QUEUE_TIMEOUT
from tokenmill.engine.input_processor import InputProcessor, ProcessedPrompt
from tokenmill.engine.messages import EngineCoreOutputs, EngineCoreRequest, ForkChild, FrontendModelInfo
from tokenmill.engine.output_processor import OutputProcessor, RequestState
from tokenmill.errors import InvalidRequestError, RequestRejectedError
from tokenmill.lora_request import LoRARequest, check_adapter
from tokenmill.metrics.stats import SchedulerSnapshot
from tokenmill.model.default_model import DEFAULT_MODEL_NAME
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.llguidance_backend import LLGuidanceBackend


@dataclasses.dataclass
class Frontend:
    """The request-side half of an engine: validation before the core, output processing after it."""

    served_model_name: str
    eos_token_ids: list[int]
    input_processor: InputProcessor
    output_processor: OutputProcessor
    # --enable-lora: the adapters' checks (None: requests with an adapter are refused).
    lora_checks: Optional[LoRAChecks] = None

    @classmethod
    def build(cls, config: EngineConfig, info: FrontendModelInfo, tokenizer: Any, max_model_len: int) -> "Frontend":
        """info: what the core read of the model (its ready message's); tokenizer: the model's; max_model_len:
        the core's effective one."""
        eos_ids = list(info.eos_token_ids)
        name = config.served_model_name or (DEFAULT_MODEL_NAME if config.model is None else info.served_model_name)
        # The backend compiles structured-output constraints only to check them; the core compiles its own.
        backend = LLGuidanceBackend(tokenizer, info.vocab_size, eos_ids)
        return cls(name, eos_ids,
                   InputProcessor(tokenizer, max_model_len, info.vocab_size, config.max_prompt_tokens, backend,
                                  config.max_logprobs),
                   OutputProcessor(tokenizer, eos_ids),
                   LoRAChecks(info.num_hidden_layers, config.max_lora_rank, info.lora_shapes or None)
                   if config.enable_lora else None)

    def check_lora(self, lora: Optional[LoRARequest]) -> None:
        """InvalidRequestError for an adapter this engine cannot serve (no --enable-lora, unreadable, too big)."""
        if lora is None:
            return
        if self.lora_checks is None:
            raise InvalidRequestError(f"LoRA adapter {lora.lora_name!r} requested, but the engine was started "
                                      "without --enable-lora", "model")
        self.lora_checks.check(lora)

    def admit(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, *, priority: int = 0,
              user: Optional[str] = None, arrival_time: Optional[float] = None, queue: Any = None,
              validated: bool = False, lora: Optional[LoRARequest] = None) -> EngineCoreRequest:
        """Validate a request (unless the caller did), register it for output processing, and return the
        message that hands it to the core."""
        if not validated:
            params = self.input_processor.validate(prompt.prompt_token_ids, params)
        self.check_lora(lora)
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        message, params, core_ids = core_request(request_id, prompt, params, self.eos_token_ids,
                                                 priority=priority, user=user, arrival_time=arrival_time, lora=lora)
        parent = message.request_id if message.fork_children else None
        self.output_processor.add_request(request_id, prompt.prompt, prompt.prompt_token_ids, params, core_ids,
                                          parent, message.arrival_time, queue=queue, tenant=user)
        return message


def core_request(request_id: str, prompt: ProcessedPrompt, params: SamplingParams, eos_ids: list[int], *,
                 priority: int = 0, user: Optional[str] = None, arrival_time: Optional[float] = None,
                 lora: Optional[LoRARequest] = None) -> tuple[EngineCoreRequest, SamplingParams, list[str]]:
    """The core's message for a validated request, the parameters the frontend keeps for it, and the
    core ids of its samples."""
    # Extra EOS ids of the model (e.g. Llama 3's <|eot_id|>) stop generation like EOS does.
    if len(eos_ids) > 1 and not params.ignore_eos:
        extra = [t for t in eos_ids[1:] if t not in (params.stop_token_ids or [])]
        if extra:
            params = params.clone(stop_token_ids=list(params.stop_token_ids or []) + extra)
    children = None
    core_ids = [request_id]
    if params.n > 1:
        # Samples of one request get distinct seeds so they differ, yet stay reproducible.
        children = [ForkChild(f"{request_id}#{i}", None if params.seed is None or i == 0 else params.seed + i)
                    for i in range(params.n)]
        core_ids = [child.request_id for child in children]
    message = EngineCoreRequest(
        request_id=f"{request_id}#prompt" if children else request_id,
        prompt_token_ids=prompt.prompt_token_ids, sampling_params=params,
        eos_token_id=eos_ids[0] if eos_ids else None,
        arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        priority=priority, user=user, fork_children=children, lora=lora)
    return message, params, core_ids


class LoRAChecks:
    """Each adapter's files checked once (config and safetensors header, no tensors read) before its first
    request reaches the core, so a bad adapter is a clear 400 and never a failed engine step."""

    def __init__(self, num_layers: int, max_rank: int, shapes: Optional[dict[str, list[int]]] = None) -> None:
        self.num_layers = num_layers
        self.max_rank = max_rank
        self.shapes = shapes
        self.checked: set[LoRARequest] = set()

    def check(self, lora: LoRARequest) -> None:
        if lora not in self.checked:
            check_adapter(lora.lora_path, self.num_layers, self.max_rank, self.shapes)
            self.checked.add(lora)


def rejection(state: RequestState, max_queue_time: Optional[float]) -> Optional[RequestRejectedError]:
    """The 429 for a request the core refused for load (queue full, waited too long), if it was."""
    reasons = {seq.stop_reason for seq in state.sequences if seq.finish_reason == "abort"}
    if QUEUE_FULL in reasons:
        return RequestRejectedError("the server is busy: too many requests are already queued; retry later",
                                    retry_after_s=1.0, code=QUEUE_FULL)
    if QUEUE_TIMEOUT in reasons:
        return RequestRejectedError(f"the request waited longer than max_queue_time ({max_queue_time} s) without "
                                    "being scheduled; retry later", retry_after_s=1.0, code=QUEUE_TIMEOUT)
    return None


def scheduler_snapshot(outputs: EngineCoreOutputs) -> SchedulerSnapshot:
    """The stat loggers' view of the core's scheduler stats (the fields both share)."""
    return SchedulerSnapshot(**{name: getattr(outputs.stats, name) for name in _SNAPSHOT_FIELDS})


_SNAPSHOT_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerSnapshot))
