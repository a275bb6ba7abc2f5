"""`tokenmill eval perplexity`: how well the engine, at the numerics it runs, predicts a text.

    tokenmill eval perplexity --model M --file F [--context-size 512] [--max-chunks N] [engine options]

The text is tokenized whole (with the tokenizer's BOS where it adds one) and cut into consecutive
windows of --context-size tokens; each window is one prompt (its first token replaced by BOS where the
tokenizer adds one), and the tokens of its second half are scored, each with at least half a window of
context: the method of llama.cpp's `llama-perplexity`, so the two tools' figures on the same GGUF and
text compare directly. Every window goes to the engine at once, so prefill batches them under the step
budget; scores come from the prompt logprobs the engine computes anyway.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tokenmill.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    perplexity: float
    # The standard error of the perplexity, from the spread of the per-token negative log-likelihoods
    # (as llama-perplexity's "+/-").
    perplexity_stderr: float
    tokens_scored: int
    windows: int
    context_size: int
    seconds: float


def perplexity_windows(token_ids: Sequence[int], context_size: int, bos_token_id: Optional[int] = None,
                       max_windows: Optional[int] = None) -> list[list[int]]:
    """Consecutive windows of context_size tokens (a shorter tail is dropped), each starting with BOS when
    bos_token_id is given. Raises InvalidRequestError when the text holds fewer than two windows."""
    if context_size < 4:
        raise InvalidRequestError(f"--context-size must be at least 4, got {context_size}", "context_size")
    count = len(token_ids) // context_size
    if count < 2:
        raise InvalidRequestError(
            f"the text has {len(token_ids)} tokens; perplexity with a context of {context_size} needs at least "
            f"{2 * context_size}", "file")
    if max_windows is not None:
        count = min(count, max_windows)
    windows = []
    for index in range(count):
        window = list(token_ids[index * context_size:(index + 1) * context_size])
        if bos_token_id is not None:
            window[0] = bos_token_id
        windows.append(window)
    return windows


def scored_positions(context_size: int) -> range:
    """The positions of a window whose tokens are scored: context_size // 2 + 1 .. context_size - 1, each
    predicted from the context_size // 2 or more tokens before it (llama-perplexity's `first`)."""
    return range(context_size // 2 + 1, context_size)


def perplexity_from_logprobs(logprobs: Sequence[float]) -> tuple[float, float]:
    """(exp(mean NLL), its standard error), as llama-perplexity reports them."""
    count = len(logprobs)
    nll = -sum(logprobs) / count
    nll2 = sum(lp * lp for lp in logprobs) / count - nll * nll
    spread = math.sqrt(nll2 / (count - 1)) if nll2 > 0 and count > 1 else 0.0
    ppl = math.exp(nll)
    return ppl, spread * ppl


def adds_bos(tokenizer) -> Optional[int]:
    """The BOS id when the tokenizer puts one before a text (llama.cpp's add_bos), else None."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    ids = tokenizer("a").input_ids
    return bos if ids and ids[0] == bos else None


def score_windows(llm, windows: list[list[int]]) -> list[float]:
    """The logprob of every scored token of every window, window after window, through the engine's prompt
    logprobs (all windows submitted together)."""
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": window} for window in windows], params, use_tqdm=False)
    logprobs: list[float] = []
    for window, output in zip(windows, outputs):
        for position in scored_positions(len(window)):
            logprobs.append(output.prompt_logprobs[position][window[position]].logprob)
    return logprobs


def evaluate_perplexity(llm, text: str, context_size: int = 512, max_windows: Optional[int] = None
                        ) -> PerplexityResult:
    tokenizer = llm.get_tokenizer()
    windows = perplexity_windows(tokenizer(text).input_ids, context_size, adds_bos(tokenizer), max_windows)
    start = time.perf_counter()
    logprobs = score_windows(llm, windows)
    seconds = time.perf_counter() - start
    ppl, stderr = perplexity_from_logprobs(logprobs)
    return PerplexityResult(ppl, stderr, len(logprobs), len(windows), context_size, seconds)


def _add_perplexity(subparsers) -> None:
    parser = subparsers.add_parser(
        "perplexity", help="perplexity of a text through the engine (llama-perplexity's method)",
        description=__doc__.splitlines()[0])
    parser.add_argument("--file", required=True, help="a UTF-8 text file")
    parser.add_argument("--context-size", type=int, default=512,
                        help="tokens per window; the second half of each is scored (llama-perplexity's -c)")
    parser.add_argument("--max-chunks", type=int, default=None,
                        help="score at most this many windows (llama-perplexity's --chunks)")
    parser.add_argument("--json", default=None, help="also write the result, with the engine's numerics, here")
    add_engine_args(parser)
    parser.set_defaults(handler=_run_perplexity)


def _run_perplexity(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM

    path = Path(args.file)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read {path}: {exc}", "file") from None
    if args.max_chunks is not None and args.max_chunks < 1:
        raise InvalidRequestError(f"--max-chunks must be positive, got {args.max_chunks}", "max_chunks")
    config = engine_config_from_args(args)
    if config.max_model_len is not None and config.max_model_len <= args.context_size:
        # a window is a prompt that generates one token
        raise InvalidRequestError("--max-model-len must exceed --context-size", "max_model_len")
    llm = LLM.from_config(config)
    result = evaluate_perplexity(llm, text, args.context_size, args.max_chunks)
    print(f"perplexity {result.perplexity:.4f} +/- {result.perplexity_stderr:.5f} over {result.tokens_scored} tokens "
          f"({result.windows} windows of {result.context_size}, {result.seconds:.1f} s)")
    if args.json:
        body = {"file": str(path), **asdict(result), "numerics": llm.llm_engine.numerics}
        Path(args.json).write_text(json.dumps(body, indent=2) + "\n")
    return 0


def add_eval_subcommands(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="measure the engine's accuracy (perplexity)")
    commands = parser.add_subparsers(dest="eval_command", required=True, parser_class=type(parser))
    _add_perplexity(commands)

