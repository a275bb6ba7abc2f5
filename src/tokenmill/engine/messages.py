"""What crosses between the frontend (API process or offline LLM) and the engine core: plain data.

frontend -> core: `EngineCoreRequest` (a request as the core receives it: token ids, sampling
parameters, arrival time, priority, tenant), `EngineCoreFork` (beam search picks the next beams:
children fork from a parked beam), `EngineCoreAbort` (client gone, or a stop string the frontend's
detokenizer found), `EngineCoreShutdown`.
core -> frontend: `EngineCoreOutputs` once per step (per-request deltas: new token ids, finish
reason, logprobs; plus the scheduler's stats), `EngineCoreReady` once the model is loaded (with
`FrontendModelInfo`: what the frontend needs of the model, so the API process never loads it),
`EngineCoreFailure` when the core cannot go on.

Every type is a msgspec Struct tagged with its name, so one decoder reads any of them from a zmq
frame (`encode` / `decode_input` / `decode_output`). Nothing here refers to a live object.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from tokenmill.core.scheduler_stats import SchedulerStats
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import Logprob
from tokenmill.sampling_params import SamplingParams


class ForkChild(msgspec.Struct, omit_defaults=True):
    """A sequence that forks from a parent: n > 1 samples, or a beam search's next beam."""

    request_id: str
    # n > 1: each sample gets its own seed (None: the parent's).
    seed: Optional[int] = None
    # Beam search: the child replaces the parent's last sampled token with this one.
    last_token_id: Optional[int] = None


class EngineCoreRequest(msgspec.Struct, tag=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int] = None
    arrival_time: float = 0.0
    priority: int = 0
    user: Optional[str] = None
    # n > 1: the request computes the prompt once and never samples; these samples fork from it.
    fork_children: Optional[list[ForkChild]] = None
    # Beam search: after each sampled token the request parks (keeps its blocks, computes nothing)
    # until an EngineCoreFork names the beams that continue from it.
    park_after_sample: bool = False
    # --api-server-count N: the API server that sent it (0..N-1), which gets its outputs (and its forks').
    frontend: int = 0
    lora: Optional[LoRARequest] = None  # its LoRA adapter (--enable-lora)


class EngineCoreFork(msgspec.Struct, tag=True):
    parent_id: str
    children: list[ForkChild]


class EngineCoreAbort(msgspec.Struct, tag=True, omit_defaults=True):
    request_ids: list[str]
    # True: the frontend found a stop string (the request finishes as "stop", not "abort").
    stopped: bool = False


class EngineCoreShutdown(msgspec.Struct, tag=True):
    pass


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: Optional[list[dict[int, Logprob]]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: Union[int, str, None] = None
    # (first scored position, entries) for prompt tokens scored this step
    prompt_logprobs: Optional[tuple[int, list[dict[int, Logprob]]]] = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_spec_accepted_tokens: int = 0  # drafts of this request kept so far
    first_scheduled_time: Optional[float] = None
    # The core refused or could not serve this request (the message says why); it has ended.
    error: Optional[str] = None


class EngineCoreOutputs(msgspec.Struct, tag=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: Optional[SchedulerStats] = None
    timestamp: float = 0.0


class FrontendModelInfo(msgspec.Struct, omit_defaults=True):
    """What a frontend needs of the model, read by the core from the model source it loaded: the API
    process builds its tokenizer and request checks from this instead of loading the model itself
    (which costs seconds, a torch import and hundreds of MiB there)."""

    # The name the model source suggests (a directory's or file's name; the default model's name);
    # --served-model-name still overrides it in the frontend.
    served_model_name: str
    vocab_size: int
    # Every id that ends generation like EOS (input_processor.eos_token_ids), the primary one first.
    eos_token_ids: list[int]
    # The tokenizer as the files `save_pretrained` writes (tokenizer.json, tokenizer_config.json, chat
    # template ...), name -> content; see tokenizer_handover. Empty when the frontend shares the core's
    # process and takes the tokenizer object itself.
    tokenizer_files: dict[str, bytes] = {}
    num_hidden_layers: int = 0  # the layers a LoRA adapter may target
    lora_shapes: dict[str, list[int]] = {}  # HF projection name -> [in, out]: what a LoRA adapter must fit


class EngineCoreReady(msgspec.Struct, tag=True, omit_defaults=True):
    """Sent once the core has loaded the model and sized its KV cache."""

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    device: str
    device_reason: str = ""  # why that device (runner/devices.py): "--device", or the default's reason
    # How the weights run (for logs and benchmark reports).
    linear_layers: str = ""
    # The numerics chosen at start-up (runner.numerics.Numerics.as_dict): option -> {"value", "reason"}.
    numerics: dict[str, dict[str, str]] = {}
    # Memory the core holds once ready (runner.host_memory.MemoryReport), in bytes.
    weights_bytes: int = 0
    buffers_bytes: int = 0  # rotary tables
    kv_cache_bytes: int = 0
    activations_bytes: int = 0
    rss_bytes: Optional[int] = None
    model_info: Optional[FrontendModelInfo] = None
    # The engine's options as the core runs them (every default resolved; EngineConfig's field names), for
    # /stats and benchmark records.
    config: dict[str, Any] = {}
    # --kv-offload-dir: the tier's directory for this engine's fingerprint, and the size of a block file
    # there (the data-parallel router looks up prompts' blocks in it).
    kv_offload_root: Optional[str] = None
    kv_offload_file_bytes: int = 0


class EngineCoreFailure(msgspec.Struct, tag=True):
    """The core could not start, or its loop died; it exits after sending this."""

    message: str
    # The TokenmillError subclass name when the failure is a user-facing one (bad model path ...).
    error_type: Optional[str] = None


EngineCoreInput = Union[EngineCoreRequest, EngineCoreFork, EngineCoreAbort, EngineCoreShutdown]
EngineCoreMessage = Union[EngineCoreOutputs, EngineCoreReady, EngineCoreFailure]

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(EngineCoreInput)
_output_decoder = msgspec.msgpack.Decoder(EngineCoreMessage)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_input(frame: bytes) -> EngineCoreInput:
    return _input_decoder.decode(frame)


def decode_output(frame: bytes) -> EngineCoreMessage:
    return _output_decoder.decode(frame)


def roundtrip(message, message_type):
    """Encode and decode a message (what a process boundary does): tests run the whole engine this
    way to prove no live object crosses."""
    return msgspec.msgpack.decode(_encoder.encode(message), type=message_type)
