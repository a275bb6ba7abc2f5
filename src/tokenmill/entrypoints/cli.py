"""The `tokenmill` command: generate, serve, bench, plan, eval."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tokenmill.errors import TokenmillError


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error and exit status 2 (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_generate(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="complete one prompt and print the text")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    add_engine_args(parser)
    parser.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed)
    llm = LLM.from_config(engine_config_from_args(args))
    if args.chat:
        output = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        output = llm.generate(args.prompt, params, use_tqdm=False)[0]
    print(output.outputs[0].text)
    return 0


def _add_serve(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    from tokenmill.entrypoints.openai.cli_args import add_serve_args

    add_engine_args(parser, repeatable=("model",))  # several models: --model A --model B
    add_serve_args(parser)
    parser.set_defaults(handler=_run_server)


def _run_server(args: argparse.Namespace) -> int:
    # The server (FastAPI, uvicorn) loads only when `serve` runs, so `tokenmill --help` stays fast.
    from tokenmill.entrypoints.openai.api_server import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tokenmill", description="tokenmill: an LLM inference serving engine")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    subparsers = parser.add_subparsers(dest="command", parser_class=_Parser)
    _add_generate(subparsers)
    try:
        _add_serve(subparsers)
    except ImportError:  # the server's dependencies are optional for offline use
        pass
    from tokenmill.entrypoints.bench_cli import add_bench_subcommands

    add_bench_subcommands(subparsers)
    from tokenmill.entrypoints.eval_cli import add_eval_subcommands

    add_eval_subcommands(subparsers)
    from tokenmill.entrypoints.check_cli import add_check_subcommand

    add_check_subcommand(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from tokenmill import __version__

        print(f"tokenmill {__version__}")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per HTTP call (the bench client polls /stats) would drown the output.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        return int(args.handler(args) or 0)
    except TokenmillError as exc:
        print(f"tokenmill: error: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
