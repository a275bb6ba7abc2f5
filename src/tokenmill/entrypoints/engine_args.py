"""Engine flags shared by every CLI command (vLLM's flag names)."""
from __future__ import annotations

import argparse
import json

from tokenmill.config import KV_CACHE_DTYPES, EngineConfig, parse_memory_size


def _memory(value: str) -> int:
    try:
        return parse_memory_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return number


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    group.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    group.add_argument("--served-model-name", default=None, help="name the model is served under")
    group.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                       help="weights and activations; auto: bfloat16 where the hardware has it natively (CUDA, "
                       "CPUs with AVX-512 BF16 or AMX), else float32. float32 (the default) matches HF "
                       "transformers' float32 outputs token for token")
    group.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    group.add_argument("--max-model-len", type=_positive_int, default=None)
    group.add_argument("--block-size", type=_positive_int, default=16)
    group.add_argument("--max-num-seqs", type=_positive_int, default=64)
    group.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                       help="tokens per step, prefill chunks and decodes together (default: 1024 on CPU, 2048 on GPU)")
    group.add_argument("--kv-cache-memory-bytes", type=_memory, default=None,
                       help="KV cache size, e.g. 4GiB (default on CPU: 2GiB)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    group.add_argument("--num-kv-blocks", type=_positive_int, default=None, help="override the KV block count")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "fair", "lpm"],
                       help="fcfs; priority (per-request `priority`, lower first); fair (share tokens between "
                            "tenants); lpm (longest cached prefix first, bounded wait)")
    group.add_argument("--lpm-max-wait", type=_positive_float, default=5.0,
                       help="lpm: seconds after which a waiting request goes first regardless of prefix")
    group.add_argument("--max-preemptions", type=_positive_int, default=4,
                       help="a request preempted this many times is spared from further preemption")
    group.add_argument("--max-num-queued-requests", type=_positive_int, default=None,
                       help="refuse new requests with 429 beyond this many waiting")
    group.add_argument("--max-queue-time", type=_positive_float, default=None,
                       help="seconds a request may wait before it is rejected")
    group.add_argument("--max-prompt-tokens", type=_positive_int, default=None)
    group.add_argument("--long-prefill-token-threshold", type=_positive_int, default=None,
                       help="prompts longer than this advance at most this many tokens per step")
    group.add_argument("--max-long-partial-prefills", type=_positive_int, default=1)
    group.add_argument("--swap-space", type=float, default=0.0,
                       help="GiB of host memory for preempted requests' KV blocks; preemption swaps to it on "
                            "accelerators (on CPU it recomputes unless --preemption-mode swap)")
    group.add_argument("--preemption-mode", default=None, choices=["swap", "recompute"])
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--num-threads", type=_positive_int, default=None, help="torch CPU threads")
    group.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"],
                       help="auto: tokenmill's C++ paged-attention kernels on CPU (built on first use) when a "
                            "compiler is present, else the portable torch backend")
    group.add_argument("--quantization", "-q", default=None, choices=["gguf", "q8_0", "none"],
                       help="weights. Unset: a GGUF's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K matrices stay quantized as "
                            "stored where tokenmill's int8 kernels run (CPU, float32), other tensors are "
                            "dequantized; gguf: insist on that; q8_0: round any model's projection and LM-head "
                            "weights to Q8_0 at load; none: dequantize everything to --dtype")
    group.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="KV cache storage; auto: the model's dtype. float16/bfloat16 under a float32 model "
                            "halve the cache's memory and the bytes a decode step reads (attention still computes "
                            "in float32)")
    group.add_argument("--structured-outputs-fast-forward", action=argparse.BooleanOptionalAction, default=True,
                       help="structured outputs: append the tokens a grammar forces (JSON keys, punctuation) "
                            "without a model step for each")
    group.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                       help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                       '"prompt_lookup_max": 4}\' (greedy requests; drafts from n-grams already in the sequence)')
    group.add_argument("--packed-linear", action=argparse.BooleanOptionalAction, default=True,
                       help="CPU: keep projection weights in oneDNN's packed layout (faster matmuls at serving "
                            "batch sizes)")


def _json_object(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r} ({exc})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        lpm_max_wait=args.lpm_max_wait,
        max_preemptions=args.max_preemptions,
        max_num_queued_requests=args.max_num_queued_requests,
        max_queue_time=args.max_queue_time,
        max_prompt_tokens=args.max_prompt_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_long_partial_prefills=args.max_long_partial_prefills,
        swap_space=args.swap_space,
        preemption_mode=args.preemption_mode,
        seed=args.seed,
        num_threads=args.num_threads,
        attention_backend=args.attention_backend,
        packed_linear=args.packed_linear,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        structured_outputs_fast_forward=args.structured_outputs_fast_forward,
        speculative_config=getattr(args, "speculative_config", None),
    )
