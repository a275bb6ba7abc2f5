"""Engine configuration: one dataclass shared by the offline LLM, the CLI and the server.

Each field is declared once with `option(...)`: its default, help text, choices, bound and the parser
of its command-line value live in the field's metadata, and `entrypoints/engine_args.py` generates the
CLI from them while `EngineConfig.__post_init__` validates with the same choices and bounds.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from tokenmill.errors import InvalidRequestError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
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


# ---- choices: each list is spelled here once, for argparse and for validation alike -------------------
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
# core/policy.py implements one SchedulingPolicy per name.
SCHEDULING_POLICIES = ("fcfs", "priority", "fair", "lpm")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
QUANTIZATIONS = ("gguf", "q8_0", "none")  # or None (unset)
BLOCK_MATMULS = ("auto", "float32", "int8", "bfloat16", "bfloat16-int8")
NUMERICS = ("auto", "exact")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
KV_CACHE_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
                          "q8_0": "int8"}
PREEMPTION_MODES = ("swap", "recompute")

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


def usable_cpu_count() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one (taskset, a container's
    cpuset), which os.cpu_count() ignores, so that the default torch threads match the cores actually lent."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_max_num_batched_tokens(device_type: str) -> int:
    """The step token budget when none is given: 2048 (vLLM's) on accelerators, 1024 on CPU.

    On CPU a 1024-token step is as efficient per token as a 2048-token one (the matmuls reach their rate
    well below 1024 rows), and a step takes seconds there, so halving it lets prompts that arrive together
    finish prefill one after another instead of all at the end of a long step: a lower P95 TTFT at equal
    or better throughput (docs/benchmarks.md).
    """
    return 1024 if device_type == "cpu" else 2048


LANE_LONG_PREFILL_TOKENS = 256


def default_max_mixed_prefill_tokens(device_type: str, max_num_batched_tokens: int) -> Optional[int]:
    """The prompt tokens a step that also decodes may compute, when none is given: on CPU half the step
    budget, elsewhere no cap beyond the budget (vLLM's behaviour).

    On CPU a step's time is its prefill work, and every running stream waits that long for its next
    token: at 64 streams, half-budget mixed steps cut the inter-token latency P99 at the same throughput
    (docs/benchmarks.md).
    Steps with no decodes (a burst of prompts arriving together) keep the whole budget.
    """
    return max(1, max_num_batched_tokens // 2) if device_type == "cpu" else None


def default_engine_core_nice(device_type: str) -> int:
    """The niceness the engine-core process adds to its own when none is given: 10 on CPU (what `nice`
    adds by default), 0 elsewhere.

    On CPU the model's compute threads hold every core for the whole of each step, and the API process
    (HTTP, detokenizing, streaming) waits for the kernel to give it a time slice, which was most of a
    /health answer's p99 at 64 streams on 2 cores. Niced, the core still gets every cycle nobody else
    wants (its throughput tied), and the frontend gets a core as soon as it wakes (docs/benchmarks.md). On an
    accelerator the core's thread mostly waits on the device, and its kernel launches are what must not wait,
    so it keeps the server's priority.
    """
    return 10 if device_type == "cpu" else 0


# ---- value converters: applied to every value, whether it comes from the CLI or from LLM(**kwargs) -----
def _kv_cache_dtype(value: str) -> str:
    return KV_CACHE_DTYPE_ALIASES.get(value, value)


SPECULATIVE_METHODS = ("ngram", "draft_model", "layer_skip", "qspec")
# Methods whose drafts come from a model (a second checkpoint, or the target's own weights) run by the runner.
DRAFT_MODEL_METHODS = ("draft_model", "layer_skip", "qspec")
DRAFT_NUMERICS = ("auto", "exact")


@dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative-config, in vLLM's spelling: {"method": ..., "num_speculative_tokens": k,
    "disable_by_batch_size": b}, plus tokenmill's "adaptive" (default true: each request proposes fewer drafts
    while its recent ones are refused, spec_decode/adaptive.py; false: always up to k). disable_by_batch_size:
    no drafts in a step while more requests than this are running (default with the adaptive length:
    spec_decode.adaptive.MAX_BATCH, 8, where a verify row stopped paying on CPU, and MAX_BATCH_DRAFT_MODEL, 4,
    for drafts from a model; without it: never).

    Methods (README, "Speculative decoding"):
      ngram        prompt lookup: "prompt_lookup_max" / "prompt_lookup_min" tokens matched earlier in the sequence
      draft_model  a smaller model sharing the target's vocabulary ("model": its path)
      layer_skip   self-speculation: the target's first "num_layers" layers and its LM head (default: half)
      qspec        self-speculation: the target's own weights through the fastest numerics (int8 dot products)
                   drafting for a target at `--numerics exact`
    A draft model runs at the fastest numerics of the machine ("numerics": "auto"), or "exact"; layer_skip at
    the target's (its layers are the target's, on the target's KV cache).
    The draft_* fields are resolved by the engine at start-up (runner.numerics), never given by a user."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    adaptive: bool = True
    disable_by_batch_size: Optional[int] = None
    model: Optional[str] = None
    num_layers: Optional[int] = None
    numerics: str = "auto"
    draft_dtype: Optional[str] = None
    draft_block_matmul: Optional[str] = None
    draft_kv_cache_dtype: Optional[str] = None
    draft_quantization: Optional[str] = None

    def __post_init__(self) -> None:
        param = "speculative_config"
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidRequestError(f"speculative method {self.method!r} is not supported (supported: "
                                      f"{', '.join(SPECULATIVE_METHODS)})", param)
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequestError("prompt_lookup_min must not exceed prompt_lookup_max", param)
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise InvalidRequestError(f"disable_by_batch_size must be a positive integer, got {limit!r}", param)
        if not isinstance(self.adaptive, bool):
            raise InvalidRequestError(f"adaptive must be true or false, got {self.adaptive!r}", param)
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise InvalidRequestError('the draft_model method needs "model": the draft checkpoint\'s path', param)
        if self.method != "draft_model" and self.model is not None:
            raise InvalidRequestError(f'"model" is for the draft_model method, not {self.method}', param)
        if self.num_layers is not None:
            if self.method != "layer_skip":
                raise InvalidRequestError(f'"num_layers" is for the layer_skip method, not {self.method}', param)
            if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool) or self.num_layers < 1:
                raise InvalidRequestError(f"num_layers must be a positive integer, got {self.num_layers!r}", param)
        if self.numerics not in DRAFT_NUMERICS:
            raise InvalidRequestError(f"numerics must be one of {', '.join(DRAFT_NUMERICS)}, got {self.numerics!r}",
                                      param)
        if self.method in ("qspec", "layer_skip") and self.numerics != "auto":
            raise InvalidRequestError(f"{self.method} drafts at numerics of its own choosing; it takes no "
                                      "\"numerics\"", param)

    @property
    def uses_draft_model(self) -> bool:
        """Drafts come from a model the runner runs (not from the sequence itself)."""
        return self.method in DRAFT_MODEL_METHODS

    @classmethod
    def from_dict(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """None, a SpeculativeConfig, or vLLM's dict (with "model" and no "method", the draft_model method)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError("speculative_config must be a JSON object", "speculative_config")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "adaptive",
                 "disable_by_batch_size", "model", "num_layers", "numerics"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"unsupported speculative_config keys: {', '.join(unknown)} "
                                      f"(known: {', '.join(sorted(known))})", "speculative_config")
        lookup_min = value.get("prompt_lookup_min", 1)
        lookup_max = value.get("prompt_lookup_max", max(4, lookup_min) if isinstance(lookup_min, int) else 4)
        method = value.get("method", "draft_model" if "model" in value else "ngram")
        return cls(method=method, num_speculative_tokens=value.get("num_speculative_tokens", 4),
                   prompt_lookup_max=lookup_max, prompt_lookup_min=lookup_min, adaptive=value.get("adaptive", True),
                   disable_by_batch_size=value.get("disable_by_batch_size"), model=value.get("model"),
                   num_layers=value.get("num_layers"), numerics=value.get("numerics", "auto"))


def _speculative_config(value: Any) -> Optional[SpeculativeConfig]:
    return SpeculativeConfig.from_dict(value)


def _json_object(value: str) -> dict:
    """CLI parser of --speculative-config."""
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r} ({exc})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


# ---- bounds: name -> (holds, what the error says the value must be) ----------------------------------
BOUNDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "positive": (lambda v: v > 0, "positive"),
    "non_negative": (lambda v: v >= 0, "non-negative"),
    "fraction": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "niceness": (lambda v: 0 <= v <= 19, "between 0 and 19"),
    "port": (lambda v: 0 <= v <= 65535, "between 0 and 65535"),
}


# How requests are spread over data-parallel engine cores (engine/dp_router.py).
DATA_PARALLEL_ROUTING = ("prefix", "round_robin")


def option(default: Any, help: str, *, choices: Optional[tuple] = None, bound: Optional[str] = None,
           convert: Optional[Callable[[Any], Any]] = None, parse: Optional[Callable[[str], Any]] = None,
           aliases: tuple[str, ...] = (), metavar: Optional[str] = None, repeat: bool | str = False) -> Any:
    """A dataclass field that carries everything the CLI and validation need (EngineConfig here, the
    server's ServerConfig in entrypoints/openai/cli_args.py; entrypoints/engine_args.py makes the flags).

    choices: allowed values (None too when the default is None); bound: a key of BOUNDS (None always
    passes); convert: turns an accepted input form into the stored one (an alias, '4GiB', a dict) and
    raises InvalidRequestError for bad input; parse: the CLI's reader of the flag's string when neither
    the field's type nor `convert` is the right one; aliases: extra flags (e.g. "-q"); repeat: the flag
    may be given several times, its values collected in order ("many": each use may also list several
    values, as vLLM's `--lora-modules a=PATH b=PATH`).
    """
    if bound is not None and bound not in BOUNDS:
        raise ValueError(f"unknown bound {bound!r}")
    metadata = {"help": help, "choices": choices, "bound": bound, "convert": convert, "parse": parse,
                "aliases": aliases, "metavar": metavar, "repeat": repeat}
    return dataclasses.field(default=default, metadata=metadata)


def validate_options(options: Any) -> None:
    """Converts, then checks, every `option` field of a dataclass instance in place (its __post_init__).

    Converting accepted input forms (an alias, "4GiB", a dict) is part of construction; nothing rewrites
    a validated value afterwards, and object.__setattr__ keeps that true for frozen classes.
    """
    for f in dataclasses.fields(options):
        convert = f.metadata.get("convert")
        if convert is not None and getattr(options, f.name) is not None:
            object.__setattr__(options, f.name, convert(getattr(options, f.name)))
    for f in dataclasses.fields(options):
        check_value(f, getattr(options, f.name))


@dataclass(frozen=True)
class EngineConfig:
    model: Optional[str] = option(
        None, "HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    served_model_name: Optional[str] = option(None, "name the model is served under")
    tokenizer: Optional[str] = option(None, "tokenizer directory (default: the model's)")
    dtype: str = option(
        "auto", "weights and activations; auto: float32 under block-quantized weights the CPU kernels run (a GGUF's "
        "kept blocks, q8_0, dense weights rounded to Q8_0 by default), else bfloat16 where the hardware has it "
        "natively (CUDA, CPUs with AVX-512 BF16 or AMX), else float32 (chosen at start-up and logged; --numerics "
        "exact pins float32)", choices=DTYPES)
    device: Optional[str] = option(None, "default: cuda when available, else cpu", choices=DEVICES)
    max_model_len: Optional[int] = option(None, "longest sequence, prompt and output (default: the model's)",
                                          bound="positive")
    block_size: int = option(16, "tokens per KV cache block", bound="positive")
    max_num_seqs: int = option(64, "most requests running at once", bound="positive")
    max_num_batched_tokens: Optional[int] = option(
        None, "tokens per step, prefill chunks and decodes together (default: 1024 on CPU, 2048 on GPU)",
        bound="positive")
    kv_cache_memory_bytes: Optional[int] = option(
        None, "KV cache size, e.g. 4GiB (default on CPU: 2GiB)", convert=parse_memory_size)
    gpu_memory_utilization: float = option(
        0.9, "CUDA: fraction of the device memory the engine may use (the KV cache gets what the model and a "
        "profiling step leave)", bound="fraction")
    num_kv_blocks: Optional[int] = option(None, "override the KV block count", bound="positive")
    enable_chunked_prefill: bool = option(True, "cut long prompts into chunks that share steps with decodes")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompt prefixes seen before")
    scheduling_policy: str = option(
        "fcfs", "fcfs; priority (per-request `priority`, lower first); fair (share tokens between tenants); lpm "
        "(longest cached prefix first, bounded wait)", choices=SCHEDULING_POLICIES)
    lpm_max_wait: float = option(
        5.0, "lpm: seconds after which a waiting request goes first regardless of prefix", bound="positive")
    # No thrash: a request preempted this often is spared while other victims remain.
    max_preemptions: Optional[int] = option(
        4, "a request preempted this many times is spared from further preemption", bound="positive")
    # Admission control: refuse (429) beyond this many waiting requests; expire long waits.
    max_num_queued_requests: Optional[int] = option(
        None, "refuse new requests with 429 beyond this many waiting", bound="positive")
    max_queue_time: Optional[float] = option(
        None, "seconds a request may wait before it is rejected", bound="positive")
    max_prompt_tokens: Optional[int] = option(None, "refuse longer prompts", bound="positive")
    max_mixed_prefill_tokens: Optional[int] = option(
        None, "prompt tokens a step may compute while it also carries running decodes: bounds the inter-token "
        "latency a prefill chunk adds to every stream, with chunked prefill (default: half of --max-num-batched-tokens "
        "on CPU, no cap on GPU; set it to --max-num-batched-tokens to turn it off)", bound="positive")
    long_prefill_token_threshold: Optional[int] = option(
        None, "prompts longer than this advance at most this many tokens per step", bound="positive")
    max_long_partial_prefills: int = option(
        1, "how many prompts above --long-prefill-token-threshold may be in prefill at once", bound="positive")
    # On the CPU a copy to "host" memory saves nothing, so preemption recomputes there unless forced.
    swap_space: float = option(
        0.0, "GiB of host memory for preempted requests' KV blocks; preemption swaps to it on accelerators (on "
        "CPU it recomputes unless --preemption-mode swap)", bound="non_negative")
    kv_offload_dir: Optional[str] = option(
        None, "a directory for the prefix cache's second tier: every full KV block is also written there (in the "
        "background), and a prompt prefix the memory cache has lost (evicted, or before a restart) is read back "
        "instead of computed when reading is estimated faster. Blocks are keyed by their tokens and a fingerprint "
        "of the model file, dtypes, numerics and block size, so a changed setup never reads them; several engine "
        "cores may share one directory", metavar="DIR")
    kv_offload_size: int = option(
        8 * 1024**3, "with --kv-offload-dir: the most the tier keeps there, e.g. 20GiB (least recently used blocks "
        "are removed first)", convert=parse_memory_size)
    kv_offload_host_size: Optional[int] = option(
        None, "with --kv-offload-dir: a level in process memory in front of the directory, e.g. 4GiB, holding the "
        "latest blocks written or read (default: 4GiB on CUDA, where the copies are staged through pinned memory; "
        "none on CPU, where the KV cache is host memory already and the OS page cache keeps recent files)",
        convert=parse_memory_size)
    kv_cache_pin_fraction: float = option(
        0.5, "the share of the KV cache that pinned prefixes (a request's `cache_ttl_s`: its prompt stays cached "
        "that long after it ends) may hold at once; a pin beyond it holds the prefix's first blocks only",
        bound="fraction")
    preemption_mode: Optional[str] = option(
        None, "default: swap when --swap-space > 0 on an accelerator, else recompute", choices=PREEMPTION_MODES)
    seed: int = option(0, "random seed of the engine's sampler")
    max_logprobs: int = option(20, "most logprobs (and prompt logprobs) per token a request may ask for",
                               bound="non_negative")
    num_threads: Optional[int] = option(None, "torch CPU threads (default: the CPUs this process may run on)",
                                        bound="positive")
    attention_backend: str = option(
        "auto", "auto: on CUDA the triton paged-attention kernels when triton is installed; on CPU tokenmill's C++ "
        "paged-attention kernels (built on first use) when a compiler is present; else the portable torch backend",
        choices=ATTENTION_BACKENDS)
    packed_linear: bool = option(
        True, "CPU: keep projection weights in oneDNN's packed layout (faster matmuls at serving batch sizes)")
    quantization: Optional[str] = option(
        None, "weights. Unset: a GGUF's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K matrices stay quantized as stored where "
        "tokenmill's int8 kernels run (CPU, float32) or its triton kernel does (CUDA), other tensors are "
        "dequantized; dense weights (safetensors, a float GGUF) are rounded to Q8_0 at load on a CPU whose int8 "
        "dot kernels run (--numerics auto, --dtype and --block-matmul unset; not for mixtures of experts), else "
        "kept; gguf: insist on kept blocks; q8_0: round any model's projection, LM-head and embedding weights to "
        "Q8_0 at load, as they stream in; none: keep dense weights and dequantize blocks to --dtype",
        choices=QUANTIZATIONS, aliases=("-q",))
    numerics: str = option(
        "auto", "auto: --dtype, --block-matmul and --kv-cache-dtype left at auto take the fastest path this machine "
        "runs whose accuracy is measured (chosen at start-up and logged); exact: float32 weights math, activations "
        "and KV cache, which match HF transformers' float32 outputs token for token (what --dtype float32 "
        "--block-matmul float32 --kv-cache-dtype float32 also give)", choices=NUMERICS)
    block_matmul: str = option(
        "auto", "CPU, how block-quantized weights (kept GGUF blocks, q8_0) multiply. auto: bfloat16-int8 on CPUs with "
        "AMX, int8 where the integer dot kernels run (AVX-512 VNNI or AVX2), else float32. float32 widens their "
        "integers to float32 (matches HF transformers' float32 outputs token for token); int8 also rounds each "
        "activation row to int8 per block of 32 inputs, as llama.cpp does, and takes integer dot products: faster "
        "prefill and decode matmuls, outputs differ slightly from float32; bfloat16 multiplies steps of more than 64 "
        "rows (prefill chunks) in bfloat16 (AMX tiles, else MKL's AVX-512 BF16 GEMM), decode-sized steps as float32 "
        "does; bfloat16-int8: prefill-sized steps as bfloat16, decode-sized steps as int8. With AMX, both bfloat16 "
        "modes also run prefill attention on bfloat16 tiles",
        choices=BLOCK_MATMULS)
    kv_cache_dtype: str = option(
        "auto", "KV cache storage; auto: on CPU a 16-bit cache under a float32 model (bfloat16 where the CPU has "
        "native bfloat16, else float16: half the memory and half the bytes a decode step reads; attention still "
        "computes in float32), elsewhere the model's dtype. int8 (alias q8_0): 8-bit values with a float16 scale "
        "per 32 of them, as llama.cpp's q8_0 cache: 1.88x a 16-bit cache's tokens in the same memory; read by "
        "the C++ CPU kernels and the torch backend",
        choices=KV_CACHE_DTYPES, convert=_kv_cache_dtype)
    structured_outputs_fast_forward: bool = option(
        True, "structured outputs: append the tokens a grammar forces (JSON keys, punctuation) without a model "
        "step for each")
    data_parallel_size: int = option(
        1, "engine cores behind one server, each with its own KV cache (and, on CPU, its share of the cores); "
        "a router sends each request to the core most likely to hold its prefix", bound="positive")
    data_parallel_routing: str = option(
        "prefix", "with --data-parallel-size > 1: prefix (the core holding the longest cached prefix, unless it "
        "is much busier than the least-loaded one) or round_robin", choices=DATA_PARALLEL_ROUTING)
    data_parallel_long_prompt_threshold: Optional[int] = option(
        None, "with --data-parallel-size > 1: prompts of more tokens than this go to a lane of their own (the last "
        "engine core) and shorter ones to the others, so short requests' first tokens never wait behind a queue of "
        "long prefills; a long prompt that would queue in its lane borrows a core of the other lane that carries "
        "none, and there advances at most 256 tokens a step (unless --long-prefill-token-threshold says "
        "otherwise) so the short prompts keep their place in every step", bound="positive")
    data_parallel_long_prompt_borrowing: bool = option(
        True, "with --data-parallel-long-prompt-threshold: a long prompt that would queue in its lane may borrow a "
        "short-lane core carrying no long prompt (--no-data-parallel-long-prompt-borrowing keeps every long prompt "
        "on its own lane, at the cost of the short lane's idle time)")
    tensor_parallel_size: int = option(
        1, "worker processes that each hold 1/N of the model (its attention heads, KV heads, MLP features and "
        "vocabulary) and of every KV block, joined by all-reduces (gloo on CPU, nccl on CUDA: one GPU per "
        "worker); the model's attention heads, KV heads and intermediate size must divide by N. "
        "--kv-cache-memory-bytes is each worker's", bound="positive")
    engine_core_nice: Optional[int] = option(
        None, "niceness the engine-core process (and its tensor-parallel workers) adds to its own, as `nice -n N`: "
        "on CPU the model's compute threads hold every core, and a lower priority lets the HTTP frontend answer "
        "and stream as soon as it wakes while the core keeps every idle cycle (default: 10 on CPU, 0 on GPU; 0 "
        "keeps the server's priority). A CPU-bound process of default priority on the same machine then takes "
        "the cores first", bound="niceness")
    speculative_config: Optional[Any] = option(
        None, 'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (drafts from n-grams '
        'already in the sequence), \'{"method": "draft_model", "model": PATH}\' (a smaller model with the same '
        'vocabulary), \'{"method": "layer_skip"}\' or \'{"method": "qspec"}\' (drafts from the model\'s own weights); '
        'greedy requests keep their exact output, sampled ones their distribution, through speculative sampling',
        convert=_speculative_config, parse=_json_object, metavar="JSON")
    enable_lora: bool = option(
        False, "serve LoRA adapters (PEFT directories) on top of the model: a request picks one by its `model` "
        "(the server) or `lora_request` (LLM.generate); requests for different adapters and for the base model "
        "share steps")
    max_loras: int = option(1, "with --enable-lora: the most adapters in one step (each holds a slot of weights "
                            "on every projection)", bound="positive")
    max_lora_rank: int = option(16, "with --enable-lora: the highest adapter rank the slots hold", bound="positive")
    max_cpu_loras: Optional[int] = option(
        None, "with --enable-lora: adapters kept read in host memory (default: --max-loras)", bound="positive")

    def __post_init__(self) -> None:
        validate_options(self)
        if self.numerics == "exact":
            for name in ("dtype", "block_matmul", "kv_cache_dtype"):
                value = getattr(self, name)
                if value not in ("auto", "float32"):
                    raise InvalidRequestError(f"--numerics exact computes in float32 throughout; it cannot be combined "
                                              f"with --{name.replace('_', '-')} {value}", name)

    # ---- derived values: computed, never written back -----------------------------------------------
    def resolved_preemption_mode(self, device_type: str) -> str:
        """`preemption_mode`, or its default: swap where there is swap space and the device is not the CPU."""
        if self.preemption_mode is not None:
            return self.preemption_mode
        return "swap" if self.swap_space > 0 and device_type != "cpu" else "recompute"

    def with_resolved_defaults(self, device_type: str, max_model_len: Optional[int] = None) -> "EngineConfig":
        """A NEW config with every device- and model-dependent scheduling default filled in, resolved once
        before anything is built from it: max_num_batched_tokens (default_max_num_batched_tokens(device_type);
        without chunked prefill at least max_model_len, the model's limit, since a prompt must fit one step),
        max_mixed_prefill_tokens and preemption_mode. `self` is left as it is. The numerics (dtype, block
        matmul, KV cache dtype) are resolved from the hardware by runner.numerics."""
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = default_max_num_batched_tokens(device_type)
            if not self.enable_chunked_prefill and max_model_len is not None:
                budget = max(budget, max_model_len)
        mixed = self.max_mixed_prefill_tokens
        if mixed is None and self.enable_chunked_prefill:
            mixed = default_max_mixed_prefill_tokens(device_type, budget)
        return dataclasses.replace(self, max_num_batched_tokens=budget, max_mixed_prefill_tokens=mixed,
                                   preemption_mode=self.resolved_preemption_mode(device_type))

    def for_data_parallel_core(self, index: int, cpu_count: int) -> "EngineConfig":
        """Data-parallel core `index`'s config: its share of the machine's CPU cores for its torch threads
        (the cores share the machine; unless --num-threads says), and on the short lane's cores the step cap
        of a borrowed long prompt (borrowed_prompt_step_cap), while the long lane's core (the last) runs its
        long prompts in whole chunks."""
        changes: dict[str, Any] = {}
        if self.num_threads is None:
            changes["num_threads"] = max(1, cpu_count // self.data_parallel_size)
        cap = self.borrowed_prompt_step_cap(self.data_parallel_long_prompt_threshold,
                                            self.data_parallel_long_prompt_borrowing)
        if cap is not None and index < self.data_parallel_size - 1:
            changes["long_prefill_token_threshold"] = cap
        return dataclasses.replace(self, **changes) if changes else self

    def borrowed_prompt_step_cap(self, lane_threshold: Optional[int], borrowing: bool) -> Optional[int]:
        """With length-aware lanes (prompts above lane_threshold) that may lend a short-lane core to a long
        prompt: how many tokens a long prompt advances per step on such a core, so the core still admits
        short prompts every step where a whole chunk of the long one would take the step's budget (measured
        in docs/benchmarks.md, "A lane for long prompts"). None where there is nothing to cap: no lanes, no
        borrowing, no chunked prefill, or --long-prefill-token-threshold already set."""
        if (lane_threshold is None or not borrowing or self.long_prefill_token_threshold is not None
                or not self.enable_chunked_prefill):
            return None
        return min(LANE_LONG_PREFILL_TOKENS, lane_threshold)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """EngineConfig(**kwargs), with an unknown keyword refused by name (and the nearest valid one)."""
        check_option_names(kwargs)
        return cls(**kwargs)


def check_value(f: dataclasses.Field, value: Any) -> None:
    """Validate one field's (converted) value against its choices and bound."""
    choices, bound = f.metadata.get("choices"), f.metadata.get("bound")
    if choices is not None and value not in choices and not (value is None and f.default is None):
        unset = " (or unset)" if f.default is None else ""
        raise InvalidRequestError(f"{f.name} must be one of {', '.join(choices)}{unset}, got {value!r}", f.name)
    if bound is not None and value is not None:
        holds, must_be = BOUNDS[bound]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not holds(value):
            raise InvalidRequestError(f"{f.name} must be {must_be}, got {value!r}", f.name)


def engine_options() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(EngineConfig)


def option_types(options_class: Optional[type] = None) -> dict[str, Any]:
    """Field name -> its resolved type annotation (Optional[int], bool, ...) of EngineConfig, or of another
    class of `option` fields."""
    return typing.get_type_hints(options_class or EngineConfig)


def check_option_names(kwargs: Mapping[str, Any]) -> None:
    """Raise InvalidRequestError for the first keyword that is not an EngineConfig field, naming it and
    suggesting the closest field name."""
    names = [f.name for f in engine_options()]
    for key in kwargs:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise InvalidRequestError(f"unknown engine option {key!r}{hint}", key)
