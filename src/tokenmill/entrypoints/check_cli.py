"""`tokenmill check URL`: the smoke check of a running server (tokenmill.bench.check), one line per check and
a non-zero exit status on any failure."""
from __future__ import annotations

import argparse
import os


def add_check_subcommand(subparsers) -> None:
    parser = subparsers.add_parser(
        "check", help="smoke-check a running server: /health, /metrics, short/medium/long prompts (streamed and "
        "not), one structured output; exit status 1 on any failure (a deploy gate)")
    parser.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="sent as a bearer token (default: $TOKENMILL_API_KEY)")
    parser.add_argument("--model", default=None, help="the model to ask (default: the first /v1/models lists)")
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="fail a streamed prompt whose first token "
                        "takes longer")
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="fail a streamed prompt whose tokens "
                        "come slower than this, on average after the first")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    parser.set_defaults(handler=_run_check)


def _run_check(args: argparse.Namespace) -> int:
    from tokenmill.bench.check import CheckConfig, run_checks

    cfg = CheckConfig(args.url, api_key=args.api_key or os.environ.get("TOKENMILL_API_KEY"), model=args.model,
                      slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, timeout_s=args.timeout)
    ok = run_checks(cfg, lambda line: print(line, flush=True))
    failed = sum(not result.ok for result in cfg.results)
    print(f"{'OK' if ok else 'FAILED'}: {len(cfg.results) - failed} of {len(cfg.results)} checks passed")
    return 0 if ok else 1
