"""Benchmark prompts, generated deterministically from a seed or read from a workload file (no downloads).

Datasets (`--dataset`):
- `random`: token-id prompts of `--random-input-len` tokens (± `--random-range-ratio`), `--random-output-len`
  output tokens each.
- `shared-prefix`: `--num-prefixes` random prefixes of `--prefix-len` tokens; every prompt is one of them plus a
  random suffix of `--suffix-len` tokens (exercises the prefix cache).
- `sharegpt-like`: synthetic multi-turn chats with ShareGPT-like (log-normal, heavy-tailed) lengths; text only.
- `file:PATH.jsonl`: the shared workload format (`prompt_token_ids`, `max_tokens`, optional `prompt`).

Random ids are drawn from [1000, 32000) unless a tokenizer is given: every common tokenizer (Llama 2/3, Mistral,
Qwen, SmolLM, GPT-2) has ordinary tokens there and its special tokens outside, so no tokenizer has to be loaded
to benchmark with id prompts. A tokenizer is loaded only when text must become ids or ids must become text.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from tokenmill.errors import InvalidRequestError

DATASET_NAMES = ("random", "sharegpt-like", "shared-prefix", "file:PATH.jsonl")
SAFE_ID_RANGE = (1000, 32000)
# Below this id tokenizers keep control and byte tokens; a tokenizer's own ids start here too.
_MIN_TOKENIZER_ID = 100

_WORDS = (
    "the of and to in is that it for was on are as with his they at be this from have or by one had not but "
    "what all were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called just "
    "where most know get through back much before go good new write our used me man too any day same right look "
    "think also around another came come work three word must because does part even place well such here take "
    "why things help put years different away again off went old number great tell men say small every found "
    "still between name should home big give air line set own under read last never us left end along while "
    "might next sound below saw something thought both few those always looked show large often together asked "
    "house world going want school important until form food keep children feet land side without boy once "
    "animals life enough took sometimes four head above kind began almost live page got earth need far hand "
    "high year mother light parts country father let night following picture being study second eyes soon "
    "times story boys since white days ever paper hard near sentence better best across during today others "
    "however sure means knew try told young miles sun ways thing whole hear example heard several change answer "
    "room sea against top turned learn point city play toward five using himself usually model engine server "
    "token cache memory request batch queue latency throughput"
).split()


@dataclass(slots=True)
class BenchRequest:
    """One prompt to send. `prompt_len` is exact for id prompts and an estimate (≈ words) for text ones."""

    prompt_len: int
    max_tokens: int
    prompt_token_ids: Optional[list[int]] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, str]]] = None  # the chat form of a multi-turn prompt


@dataclass(slots=True)
class DatasetConfig:
    name: str = "random"
    num_prompts: int = 1000
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    num_prefixes: int = 8
    prefix_len: int = 1000
    suffix_len: int = 32
    sharegpt_max_input_len: int = 1024
    sharegpt_max_output_len: int = 512
    path: Optional[str] = None  # set for file:PATH.jsonl

    def __post_init__(self) -> None:
        if self.name.startswith("file:"):
            self.path, self.name = self.name[len("file:"):], "file"
        if self.name not in ("random", "sharegpt-like", "shared-prefix", "file"):
            raise InvalidRequestError(f"unknown dataset {self.name!r}; choose one of {', '.join(DATASET_NAMES)}")
        if self.name == "file" and not self.path:
            raise InvalidRequestError("--dataset file:PATH.jsonl needs a path after 'file:'")
        if self.num_prompts < 1:
            raise InvalidRequestError("--num-prompts must be at least 1")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise InvalidRequestError("--random-range-ratio must be in [0, 1)")
        for flag, value in (("--random-input-len", self.random_input_len), ("--random-output-len",
                            self.random_output_len), ("--num-prefixes", self.num_prefixes),
                            ("--prefix-len", self.prefix_len), ("--suffix-len", self.suffix_len),
                            ("--sharegpt-max-input-len", self.sharegpt_max_input_len),
                            ("--sharegpt-max-output-len", self.sharegpt_max_output_len)):
            if value < 1:
                raise InvalidRequestError(f"{flag} must be at least 1")


@dataclass(slots=True)
class TokenIdSpace:
    """The ids random prompts are drawn from: a contiguous range minus a few special ids."""

    low: int = SAFE_ID_RANGE[0]
    high: int = SAFE_ID_RANGE[1]
    excluded: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "TokenIdSpace":
        specials = set(getattr(tokenizer, "all_special_ids", []) or [])
        specials.update(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        return cls(min(_MIN_TOKENIZER_ID, len(tokenizer) // 2), len(tokenizer), frozenset(specials))

    def sample(self, rng: np.random.Generator, count: int) -> list[int]:
        ids = rng.integers(self.low, self.high, size=count)
        if self.excluded:
            # Redraw the rare special ids rather than filtering, so the length stays exact.
            bad = np.isin(ids, list(self.excluded))
            while bad.any():
                ids[bad] = rng.integers(self.low, self.high, size=int(bad.sum()))
                bad = np.isin(ids, list(self.excluded))
        return [int(i) for i in ids]


def sample_lengths(rng: np.random.Generator, mean: int, range_ratio: float, count: int) -> list[int]:
    """Uniform integers in [mean·(1−r), mean·(1+r)], at least 1 (vLLM's --random-range-ratio)."""
    low = max(1, int(math.floor(mean * (1.0 - range_ratio))))
    high = max(low, int(math.ceil(mean * (1.0 + range_ratio))))
    return [int(x) for x in rng.integers(low, high + 1, size=count)]


def random_requests(cfg: DatasetConfig, space: TokenIdSpace) -> list[BenchRequest]:
    rng = np.random.default_rng(cfg.seed)
    inputs = sample_lengths(rng, cfg.random_input_len, cfg.random_range_ratio, cfg.num_prompts)
    outputs = sample_lengths(rng, cfg.random_output_len, cfg.random_range_ratio, cfg.num_prompts)
    return [BenchRequest(prompt_len=n, max_tokens=m, prompt_token_ids=space.sample(rng, n))
            for n, m in zip(inputs, outputs)]


def shared_prefix_requests(cfg: DatasetConfig, space: TokenIdSpace) -> list[BenchRequest]:
    """Prompt i = prefix[i mod P] + its own suffix, in a seeded shuffled order (so hits interleave)."""
    rng = np.random.default_rng(cfg.seed)
    prefixes = [space.sample(rng, cfg.prefix_len) for _ in range(cfg.num_prefixes)]
    outputs = sample_lengths(rng, cfg.random_output_len, cfg.random_range_ratio, cfg.num_prompts)
    requests = []
    for i, max_tokens in enumerate(outputs):
        ids = prefixes[i % cfg.num_prefixes] + space.sample(rng, cfg.suffix_len)
        requests.append(BenchRequest(prompt_len=len(ids), max_tokens=max_tokens, prompt_token_ids=ids))
    order = rng.permutation(len(requests))
    return [requests[int(i)] for i in order]


def synthetic_text(rng: np.random.Generator, num_words: int) -> str:
    """English-looking sentences of about `num_words` tokens (common words are one token each)."""
    words = rng.choice(len(_WORDS), size=max(1, num_words))
    pieces, sentence_left = [], 0
    for count, index in enumerate(words):
        word = _WORDS[int(index)]
        if sentence_left == 0:
            word, sentence_left = word.capitalize(), int(rng.integers(6, 19))
        sentence_left -= 1
        last = count == len(words) - 1
        pieces.append(word + ("." if sentence_left == 0 or last else ""))
    return " ".join(pieces)


def _lognormal(rng: np.random.Generator, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(median * math.exp(sigma * rng.standard_normal())))))


def sharegpt_like_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    """Synthetic chats: 1–4 user turns (earlier ones answered), lengths log-normal like ShareGPT's.

    ShareGPT (as vLLM filters it) has median user turns of ~60 tokens and replies of ~180 with long tails;
    the earliest turns are dropped while the prompt exceeds --sharegpt-max-input-len.
    """
    rng = np.random.default_rng(cfg.seed)
    requests = []
    for _ in range(cfg.num_prompts):
        num_turns = int(rng.choice([1, 2, 3, 4], p=[0.5, 0.25, 0.15, 0.1]))
        turns: list[tuple[str, int]] = []
        for turn in range(num_turns):
            if turn:
                turns.append(("assistant", _lognormal(rng, 180, 0.8, 4, cfg.sharegpt_max_output_len)))
            turns.append(("user", _lognormal(rng, 60, 1.0, 4, cfg.sharegpt_max_input_len)))
        while len(turns) > 1 and _chat_len(turns) > cfg.sharegpt_max_input_len:
            turns = turns[2:]
        if _chat_len(turns) > cfg.sharegpt_max_input_len:  # one very long user turn: clip it
            turns = [("user", max(1, cfg.sharegpt_max_input_len - _chat_len([]) - 3))]
        messages = [{"role": role, "content": synthetic_text(rng, n)} for role, n in turns]
        max_tokens = _lognormal(rng, 180, 0.8, 4, cfg.sharegpt_max_output_len)
        requests.append(BenchRequest(prompt_len=_chat_len(turns), max_tokens=max_tokens,
                                     prompt=flatten_chat(messages), messages=messages))
    return requests


def _chat_len(turns: list[tuple[str, int]]) -> int:
    return sum(n + 3 for _, n in turns) + 3  # role labels and newlines, then "Assistant:"


def flatten_chat(messages: list[dict[str, str]]) -> str:
    """A plain-text rendering of a chat, for completion endpoints."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


def file_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    from tokenmill.bench.workloads import load_workload

    try:
        loaded = load_workload(Path(cfg.path or ""), limit=cfg.num_prompts)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(str(exc)) from None
    return [BenchRequest(prompt_len=r.prompt_len, max_tokens=r.max_tokens,
                         prompt_token_ids=list(r.prompt_token_ids), prompt=r.prompt) for r in loaded]


TokenizerLoader = Callable[[], Any]


def load_tokenizer(path: Optional[str]) -> Any:
    """--tokenizer PATH (a tokenizer/model directory or .gguf), or the embedded SmolLM2 one (~10 s)."""
    if path is None or path in ("embedded", "default"):
        from tokenmill.model.loader import load_model_source

        return load_model_source(None).tokenizer
    target = Path(path).expanduser()
    if target.suffix.lower() == ".gguf":
        from tokenmill.model.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(target)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"cannot load the tokenizer at {path}: {exc}") from None


def build_requests(cfg: DatasetConfig, tokenizer: Optional[Any] = None) -> list[BenchRequest]:
    """The dataset's requests; `tokenizer` only narrows the ids random prompts are drawn from."""
    space = TokenIdSpace.from_tokenizer(tokenizer) if tokenizer is not None else TokenIdSpace()
    if cfg.name == "random":
        return random_requests(cfg, space)
    if cfg.name == "shared-prefix":
        return shared_prefix_requests(cfg, space)
    if cfg.name == "sharegpt-like":
        return sharegpt_like_requests(cfg)
    return file_requests(cfg)


def apply_prompt_format(requests: list[BenchRequest], prompt_format: str, get_tokenizer: TokenizerLoader) -> None:
    """Make every request carry what `prompt_format` sends: "ids", "text", or "auto" (ids when present).

    `get_tokenizer` is called (once) only when a conversion is needed.
    """
    if prompt_format not in ("auto", "ids", "text"):
        raise InvalidRequestError(f"--prompt-format must be auto, ids or text, not {prompt_format!r}")
    tokenizer = None
    for request in requests:
        if prompt_format == "ids" and request.prompt_token_ids is None:
            tokenizer = get_tokenizer() if tokenizer is None else tokenizer
            request.prompt_token_ids = list(tokenizer.encode(request.prompt or "", add_special_tokens=False))
            request.prompt_len = len(request.prompt_token_ids)
        elif prompt_format == "text" and request.prompt is None:
            tokenizer = get_tokenizer() if tokenizer is None else tokenizer
            request.prompt = tokenizer.decode(request.prompt_token_ids or [])
        if prompt_format == "text":
            request.prompt_token_ids = None
