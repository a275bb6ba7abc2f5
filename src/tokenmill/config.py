"""Engine configuration: one dataclass shared by the offline LLM, the CLI and the server."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from tokenmill.errors import InvalidRequestError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4,
}


def parse_memory_size(value: str | int | float) -> int:
    """'4GiB' -> 4294967296, '512MB' -> 512000000, 1000 -> 1000."""
    if isinstance(value, (int, float)):
        if value <= 0:
            raise InvalidRequestError(f"memory size must be positive, got {value}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidRequestError(f"cannot read memory size {value!r} (examples: 4GiB, 512MB, 1073741824)")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise InvalidRequestError(f"memory size must be positive, got {value!r}")
    return size


DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def default_max_num_batched_tokens(device_type: str) -> int:
    """The step token budget when none is given: 2048 (vLLM's) on accelerators, 1024 on CPU.

    On CPU a 1024-token step is as efficient per token as a 2048-token one (oneDNN holds ~140 GFLOP/s
    from ~600 rows up), and a step takes seconds there, so halving it lets prompts that arrive together
    finish prefill one after another instead of all at the end of a long step. Serving workload-64 at
    16 streams (docs/benchmarks.md): P95 TTFT 8.7-9.0 -> 6.6-7.6 s with Q8_0 weights, 8.0-9.1 -> 7.8 s in
    float32, at equal or better throughput.
    """
    return 1024 if device_type == "cpu" else 2048


@dataclass
class EngineConfig:
    model: Optional[str] = None  # None: the embedded SmolLM2-135M-Instruct
    served_model_name: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: str = "float32"
    device: Optional[str] = None  # None: cuda when available, else cpu
    max_model_len: Optional[int] = None  # None: from the model config
    block_size: int = 16
    max_num_seqs: int = 64
    # Tokens per step (prefill chunks + decodes). None: default_max_num_batched_tokens(device).
    max_num_batched_tokens: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: Optional[int] = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority | fair | lpm
    # lpm: a request waiting longer than this goes first regardless of its cached prefix.
    lpm_max_wait: float = 5.0
    # A request preempted this many times is spared while other victims remain (no thrash).
    max_preemptions: Optional[int] = 4
    # Admission control: refuse (429) beyond this many waiting requests; expire long waits.
    max_num_queued_requests: Optional[int] = None
    max_queue_time: Optional[float] = None
    # Length limits and long-prompt isolation.
    max_prompt_tokens: Optional[int] = None
    long_prefill_token_threshold: Optional[int] = None
    max_long_partial_prefills: int = 1
    # GiB of host memory for swapped-out KV blocks. Preemption swaps where the device is not the CPU
    # (on the CPU a copy to "host" memory saves nothing, so it recomputes); preemption_mode forces it.
    swap_space: float = 0.0
    preemption_mode: Optional[str] = None  # None: swap when swap_space > 0 on an accelerator, else recompute
    seed: int = 0
    max_logprobs: int = 20
    num_threads: Optional[int] = None
    # auto: tokenmill's C++ paged kernels on CPU when they build, else torch; torch; cpu.
    attention_backend: str = "auto"
    # CPU: projections with weights pre-packed for oneDNN (faster at serving batch sizes).
    packed_linear: bool = True
    # Weights: None keeps a GGUF's block-quantized matrices as stored where tokenmill's int8 kernels run
    # (CPU, float32) and dequantizes the rest; "gguf" insists on that; "q8_0" rounds any model's weights
    # to Q8_0 at load; "none" dequantizes everything to dtype (docs/performance.md).
    quantization: Optional[str] = None
    # KV cache storage: auto (the model's dtype), float32, float16 or bfloat16. A 16-bit cache under a
    # float32 model halves the cache's memory and the bytes each decode step reads (vLLM: --kv-cache-dtype).
    kv_cache_dtype: str = "auto"
    # Structured outputs: append tokens a grammar forces (JSON keys, punctuation) without sampling each.
    structured_outputs_fast_forward: bool = True
    # Speculative decoding (vLLM's dict: {"method": "ngram", "num_speculative_tokens": 4, ...}); None: off.
    speculative_config: Optional[Any] = None

    def __post_init__(self) -> None:
        from tokenmill.spec_decode.ngram import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.kv_cache_memory_bytes is not None:
            self.kv_cache_memory_bytes = parse_memory_size(self.kv_cache_memory_bytes)
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise InvalidRequestError(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}", "dtype")
        if self.dtype == "auto" and self.quantization in ("gguf", "q8_0"):
            self.dtype = "float32"  # the block-int8 path computes in float32
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}", name)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidRequestError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}", "num_kv_blocks")
        from tokenmill.core.policy import POLICIES

        if self.scheduling_policy not in POLICIES:
            raise InvalidRequestError(f"scheduling_policy must be one of {', '.join(POLICIES)}", "scheduling_policy")
        for name in ("max_num_queued_requests", "max_prompt_tokens", "long_prefill_token_threshold"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequestError(f"{name} must be positive, got {value}", name)
        if self.quantization not in (None, "gguf", "q8_0", "none"):
            raise InvalidRequestError("quantization must be gguf, q8_0 or none (or unset)", "quantization")
        self.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                                      f"{self.kv_cache_dtype!r}", "kv_cache_dtype")
        if self.attention_backend not in ("auto", "torch", "cpu"):
            raise InvalidRequestError("attention_backend must be auto, torch or cpu", "attention_backend")
        if self.preemption_mode not in (None, "swap", "recompute"):
            raise InvalidRequestError("preemption_mode must be 'swap' or 'recompute'", "preemption_mode")
        if self.swap_space < 0:
            raise InvalidRequestError("swap_space must be non-negative", "swap_space")
        if not self.lpm_max_wait > 0:
            raise InvalidRequestError("lpm_max_wait must be positive", "lpm_max_wait")
        if self.max_queue_time is not None and self.max_queue_time <= 0:
            raise InvalidRequestError("max_queue_time must be positive", "max_queue_time")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError("gpu_memory_utilization must be in (0, 1]", "gpu_memory_utilization")
