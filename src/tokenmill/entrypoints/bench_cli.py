"""`tokenmill bench {serve,sweep,compare,throughput}` and `tokenmill plan`.

`add_bench_subcommands(subparsers)` registers them on the `tokenmill` command's subparsers; each sets
`handler=` a function (args) -> exit code. Heavy imports (httpx, matplotlib, torch) wait for the handler,
so `tokenmill --help` stays fast. They run through the `tokenmill` command (cli.py, which imports this
module; this module never imports it back).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional

from tokenmill.errors import InvalidRequestError


def _int_list(value: str) -> list[int]:
    try:
        items = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not items or any(i < 1 for i in items):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {value!r}")
    return items


def _prices(value: str) -> tuple[float, ...]:
    try:
        items = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated prices, got {value!r}") from None
    if not items or any(not price > 0 for price in items):
        raise argparse.ArgumentTypeError(f"prices must be positive, got {value!r}")
    return items


def _float_list(value: str) -> tuple[float, ...]:
    try:
        items = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {value!r}") from None
    if not items or any(not 0 <= q <= 100 for q in items):
        raise argparse.ArgumentTypeError(f"percentiles must lie in [0, 100], got {value!r}")
    return items


def add_bench_subcommands(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmark a server (serve, sweep), compare results, or "
                                                "measure offline throughput")
    bench.set_defaults(handler=lambda args: _missing_subcommand(bench))
    inner = bench.add_subparsers(dest="bench_command", parser_class=type(bench))
    _add_serve(inner)
    _add_sweep(inner)
    _add_compare(inner)
    _add_throughput(inner)
    _add_plan(subparsers)


def _missing_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


# ---- shared arguments --------------------------------------------------------------------------------
def _add_dataset_args(parser: argparse.ArgumentParser, seed_and_tokenizer: bool = True) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                       help="random | sharegpt-like | shared-prefix | file:PATH.jsonl (default: random)")
    group.add_argument("--num-prompts", type=int, default=1000, help="number of requests (default: 1000)")
    group.add_argument("--random-input-len", type=int, default=1024)
    group.add_argument("--random-output-len", type=int, default=128,
                       help="output tokens per request (random and shared-prefix)")
    group.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="lengths uniform in [len·(1−r), len·(1+r)]")
    group.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: distinct prefixes")
    group.add_argument("--prefix-len", type=int, default=1000, help="shared-prefix: tokens per prefix")
    group.add_argument("--suffix-len", type=int, default=32, help="shared-prefix: unique tokens per prompt")
    group.add_argument("--sharegpt-max-input-len", type=int, default=1024)
    group.add_argument("--sharegpt-max-output-len", type=int, default=512)
    if seed_and_tokenizer:  # `bench throughput` gets both from the engine's flags
        group.add_argument("--seed", type=int, default=0)
        group.add_argument("--tokenizer", default=None,
                           help="tokenizer dir or .gguf, or 'embedded' (SmolLM2); loaded only when needed")


def _dataset_config(args: argparse.Namespace):
    from tokenmill.bench.datasets import DatasetConfig

    return DatasetConfig(name=args.dataset, num_prompts=args.num_prompts, seed=args.seed,
                         random_input_len=args.random_input_len, random_output_len=args.random_output_len,
                         random_range_ratio=args.random_range_ratio, num_prefixes=args.num_prefixes,
                         prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                         sharegpt_max_input_len=args.sharegpt_max_input_len,
                         sharegpt_max_output_len=args.sharegpt_max_output_len)


def _add_client_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("client")
    group.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (any OpenAI-compatible)")
    group.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    group.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    group.add_argument("--api-key", default=None,
                       help="bearer token (default: $OPENAI_API_KEY, then $TOKENMILL_API_KEY)")
    group.add_argument("--prompt-format", default="auto", choices=["auto", "ids", "text"],
                       help="send token ids (auto: when the dataset has them) or text")
    group.add_argument("--request-rate", type=float, default=math.inf,
                       help="requests/s with Poisson (gamma) arrivals; inf sends all at once (default)")
    group.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    group.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                       help="let requests stop at EOS (default: always generate max_tokens)")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--extra-body", type=_json_object, default={},
                       help='JSON object merged into every request body, e.g. \'{"cache_prompt": false}\'')
    group.add_argument("--timeout-s", type=float, default=600.0,
                       help="seconds a request may wait for data before it fails")
    group.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT limit")
    group.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT limit")
    group.add_argument("--slo-e2el-ms", type=float, default=None, help="goodput: end-to-end limit")
    group.add_argument("--price-per-hour", type=float, default=None,
                       help="what the server costs an hour: the result adds the cost of a million tokens at the "
                       "measured throughput")
    group.add_argument("--metric-percentiles", type=_float_list, default=(50.0, 90.0, 95.0, 99.0),
                       help="comma-separated (default: 50,90,95,99)")
    group.add_argument("--server-pid", type=int, default=None,
                       help="local server process: sample its (and its children's) VmRSS for peak memory")
    group.add_argument("--no-sample-server", dest="sample_server", action="store_false",
                       help="do not poll /stats or /metrics for queue depth and memory")
    group.add_argument("--label", default=None, help="name of this run in `bench compare` (e.g. tokenmill)")
    group.add_argument("--disable-tqdm", action="store_true")
    group.add_argument("--result-json", default=None, help="write the full result here")


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc.msg}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return parsed


def _serve_config(args: argparse.Namespace, max_concurrency: Optional[int]):
    from tokenmill.bench.serve import ServeConfig

    return ServeConfig(base_url=args.base_url, endpoint=args.endpoint, model=args.model,
                       api_key=_api_key(args), max_concurrency=max_concurrency,
                       request_rate=args.request_rate, burstiness=args.burstiness, seed=args.seed,
                       ignore_eos=args.ignore_eos, temperature=args.temperature, timeout_s=args.timeout_s,
                       slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, slo_e2el_ms=args.slo_e2el_ms,
                       percentiles=tuple(args.metric_percentiles), server_pid=args.server_pid,
                       sample_server=args.sample_server, disable_tqdm=args.disable_tqdm, label=args.label,
                       extra_body=args.extra_body, price_per_hour=args.price_per_hour)


def _api_key(args: argparse.Namespace) -> Optional[str]:
    return args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("TOKENMILL_API_KEY")


def _client_requests(args: argparse.Namespace) -> tuple[list, dict[str, Any]]:
    """The dataset's requests in the form the endpoint takes, and a description for the result JSON."""
    from tokenmill.bench.datasets import apply_prompt_format, build_requests, load_tokenizer

    cfg = _dataset_config(args)
    cache: dict[str, Any] = {}

    def tokenizer() -> Any:
        if "tok" not in cache:
            cache["tok"] = load_tokenizer(args.tokenizer)
        return cache["tok"]

    requests = build_requests(cfg, tokenizer() if args.tokenizer else None)
    chat = args.endpoint == "/v1/chat/completions"
    prompt_format = "text" if chat else args.prompt_format  # chat messages are text
    apply_prompt_format(requests, prompt_format, tokenizer)
    return requests, {"dataset": asdict(cfg), "prompt_format": prompt_format}


def _write_json(path: Optional[str], data: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2), encoding="utf-8")
        print(f"wrote {path}")


# ---- bench serve / sweep -----------------------------------------------------------------------------
def _add_serve(subparsers: Any) -> None:
    parser = subparsers.add_parser("serve", help="load-test an OpenAI-compatible server (streaming)")
    _add_client_args(parser)
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                        help="a time-boxed load test: send the dataset's requests (cycled) for --warmup + SECONDS at "
                        "--max-concurrency or --request-rate, and report the stable segment after the warm-up "
                        "(the drain excluded) with a verdict against --slo-ttft-ms/--slo-tpot-ms")
    parser.add_argument("--warmup", type=float, default=0.0, metavar="SECONDS",
                        help="with --duration: seconds of load before the measured segment (default: 0)")
    _add_dataset_args(parser)
    parser.set_defaults(handler=run_bench_serve)


def run_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from tokenmill.bench.report import format_serve_table
    from tokenmill.bench.serve import run_benchmark

    cfg = replace(_serve_config(args, args.max_concurrency), duration_s=args.duration, warmup_s=args.warmup)
    requests, extra = _client_requests(args)
    result = asyncio.run(run_benchmark(requests, cfg, extra))
    print(format_serve_table(result))
    _write_json(args.result_json, result)
    return 0 if result["completed"] else 1


def _add_sweep(subparsers: Any) -> None:
    parser = subparsers.add_parser("sweep", help="`bench serve` once per concurrency, one JSON with all points")
    _add_client_args(parser)
    parser.add_argument("--concurrencies", type=_int_list, default=[1, 4, 16, 64],
                        help="comma-separated (default: 1,4,16,64)")
    _add_dataset_args(parser)
    parser.set_defaults(handler=run_bench_sweep)


def run_bench_sweep(args: argparse.Namespace) -> int:
    import asyncio

    from tokenmill.bench.report import format_sweep_table
    from tokenmill.bench.serve import run_sweep

    cfg = _serve_config(args, None)
    requests, extra = _client_requests(args)

    def progress(point: dict[str, Any]) -> None:
        print(f"concurrency {point['max_concurrency']}: {point['output_throughput']:.1f} output tok/s, "
              f"TTFT p95 {point.get('p95_ttft_ms') or float('nan'):.1f} ms, {point['failed']} failed", flush=True)

    sweep = asyncio.run(run_sweep(requests, cfg, args.concurrencies, extra, on_point=progress))
    print(format_sweep_table(sweep))
    _write_json(args.result_json, sweep)
    return 0 if all(p["completed"] for p in sweep["points"]) else 1


# ---- bench compare -----------------------------------------------------------------------------------
def _add_compare(subparsers: Any) -> None:
    parser = subparsers.add_parser("compare", help="side-by-side report (markdown + PNG plots) of results")
    parser.add_argument("results", nargs="+",
                        help="`bench serve` / `bench sweep` JSON files; the first is the baseline")
    parser.add_argument("--labels", default=None, help="comma-separated names, one per result")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--tie-threshold", type=float, default=0.10,
                        help="relative differences under this count as ties (default: 0.10)")
    parser.add_argument("--price-per-hour", type=_prices, default=None,
                        help="what the servers cost an hour: one price for all, or comma-separated, one per result; "
                        "the report adds the cost of a million output tokens at each measured throughput")
    parser.set_defaults(handler=run_bench_compare)


def run_bench_compare(args: argparse.Namespace) -> int:
    from tokenmill.bench.report import write_compare_report

    labels = [label.strip() for label in args.labels.split(",")] if args.labels else None
    if not 0 <= args.tie_threshold < 1:
        raise InvalidRequestError("--tie-threshold must be in [0, 1)")
    comparison = write_compare_report(args.results, labels, args.output_dir, args.tie_threshold,
                                      args.price_per_hour)
    print(comparison["markdown"])
    print(f"wrote {Path(args.output_dir) / 'report.md'}")
    return 0


# ---- bench throughput --------------------------------------------------------------------------------
def _add_throughput(subparsers: Any) -> None:
    from tokenmill.entrypoints.engine_args import add_engine_args

    parser = subparsers.add_parser("throughput", help="offline throughput through LLM.generate")
    add_engine_args(parser)
    _add_dataset_args(parser, seed_and_tokenizer=False)
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--result-json", default=None)
    parser.set_defaults(handler=run_bench_throughput)


def run_bench_throughput(args: argparse.Namespace) -> int:
    from tokenmill.bench.datasets import apply_prompt_format, build_requests
    from tokenmill.bench.throughput import BenchmarkError, run_offline_throughput
    from tokenmill.bench.workloads import WorkloadRequest
    from tokenmill.entrypoints.engine_args import engine_config_from_args
    from tokenmill.entrypoints.llm import LLM

    cfg = _dataset_config(args)
    llm = LLM.from_config(engine_config_from_args(args))
    tokenizer = llm.get_tokenizer()
    requests = build_requests(cfg, tokenizer)
    apply_prompt_format(requests, "ids", lambda: tokenizer)
    workload = [WorkloadRequest(id=i, prompt_token_ids=r.prompt_token_ids or [], max_tokens=r.max_tokens)
                for i, r in enumerate(requests)]
    try:
        result = run_offline_throughput(llm, workload, use_tqdm=not args.disable_tqdm)
    except BenchmarkError as exc:
        raise InvalidRequestError(str(exc)) from None
    result.update(kind="throughput", dataset=asdict(cfg))
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tok_s']:.2f} total tokens/s, "
          f"{result['output_tok_s']:.2f} output tokens/s ({result['num_requests']} requests, "
          f"{result['prompt_tokens']} prompt + {result['output_tokens']} output tokens in {result['wall_s']:.2f} s)")
    _write_json(args.result_json, result)
    return 0


# ---- plan --------------------------------------------------------------------------------------------
def _add_plan(subparsers: Any) -> None:
    parser = subparsers.add_parser("plan", help="devices needed for a model, context length and concurrency")
    parser.add_argument("--model", required=True, help="preset (llama-3-8b, llama-3-70b, qwen2.5-7b, mistral-7b, "
                                                       "smollm2-135m, gemma3-270m, ...), HF model dir, or .gguf")
    device = parser.add_mutually_exclusive_group(required=True)
    device.add_argument("--gpu", default=None, help="A100-40GB, A100-80GB, H100-80GB, H200, L4, L40S, A10G, "
                                                    "RTX-4090, MI300X")
    device.add_argument("--memory-gib", type=float, default=None, help="memory of one device (e.g. a CPU host)")
    parser.add_argument("--bandwidth-gbps", type=float, default=None, help="with --memory-gib: memory bandwidth")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--concurrency", type=int, default=None, help="target concurrent sequences")
    parser.add_argument("--target-ttft-ms", type=float, default=None, help="P95 TTFT target (needs --profile)")
    parser.add_argument("--headroom", type=float, default=0.3, help="fraction of memory kept free (default: 0.3)")
    parser.add_argument("--dtype", default="auto", help="weights: auto, float32, float16, bfloat16, fp8, int8, int4")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto (the activation dtype), float32, float16, bfloat16 or int8 "
                             "(as the engine stores it)")
    parser.add_argument("--block-size", type=int, default=None, help="KV block size (default: the engine's)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None, help="default: smallest that fits")
    parser.add_argument("--profile", default=None, help="a `bench sweep` JSON measured on this model and device")
    parser.add_argument("--price-per-hour", type=float, default=None,
                        help="what one device costs an hour: the plan adds its hourly cost and, with --profile, the "
                        "cost of a million output tokens at the operating concurrency")
    parser.add_argument("--price-table", default=None, metavar="FILE",
                        help='JSON of your prices per device hour, e.g. {"H100-80GB": 3.0, "L4": 0.8, "cpu": 0.4} '
                        "(\"cpu\": a --memory-gib host); used when --price-per-hour is not given")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(handler=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from tokenmill.bench.report import load_result
    from tokenmill.planning.gpus import custom_device, device_price, find_gpu, load_price_table
    from tokenmill.planning.planner import PlanInputs, format_plan, make_plan, resolve_model

    device = find_gpu(args.gpu) if args.gpu else custom_device(args.memory_gib, args.bandwidth_gbps)
    if args.target_ttft_ms is not None and args.profile is None:
        print("note: --target-ttft-ms without --profile only sets the scale-out trigger", file=sys.stderr)
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        raise InvalidRequestError("--tensor-parallel-size must be at least 1")
    block_size = args.block_size or _engine_default("block_size")
    inputs = PlanInputs(model=resolve_model(args.model), device=device, max_model_len=args.max_model_len,
                        concurrency=args.concurrency, headroom=args.headroom, dtype=args.dtype,
                        kv_cache_dtype=args.kv_cache_dtype, block_size=block_size,
                        tensor_parallel_size=args.tensor_parallel_size, target_ttft_ms=args.target_ttft_ms,
                        profile=load_result(args.profile) if args.profile else None, profile_path=args.profile,
                        price_per_device_hour=args.price_per_hour)
    if args.price_per_hour is None and args.price_table is not None:
        price = device_price(load_price_table(args.price_table), device)
        if price is None:
            print(f"note: {args.price_table} has no price for {device.name}", file=sys.stderr)
        inputs = replace(inputs, price_per_device_hour=price)
    plan = make_plan(inputs)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


def _engine_default(name: str) -> Any:
    """EngineConfig's default of one option: the plan sizes blocks as the engine would."""
    import dataclasses

    from tokenmill.config import EngineConfig

    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)
