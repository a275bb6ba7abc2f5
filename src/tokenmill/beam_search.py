"""Beam search on the engine core: beams share KV blocks and fork with copy-on-write.

The user-facing shapes are vLLM's: `LLM.beam_search(prompts, BeamSearchParams(...))` returns one
`BeamSearchOutput` per prompt whose `sequences` are sorted best first; a sequence's `tokens` hold
the prompt followed by the generated ids. The server's `use_beam_search` runs the same search.

Each beam is a live core request that parks after every sampled token (`park_after_sample`), and
the next beams fork from it through the scheduler's fork machinery (the one n > 1 uses), driven by
messages only:

    step s   every live beam computes its newest token and samples once, asking for the top
             2 * beam_width logprobs, then parks: it keeps its blocks and computes nothing more.
    select   once every live beam of a prompt has reported: candidate (beam b, token t) scores
             cum_logprob(b) + logprob(t | b); EOS candidates become finished hypotheses, the best
             beam_width others become the next beams.
    fork     an EngineCoreFork names b's children (each replacing b's last sampled token with its
             own t); the scheduler forks them at its next step: every block of b is shared (ref
             counts up) and the partially filled last block is copied on a child's first write.
             Beams nobody picked are aborted, dropping their references.

So the prompt is computed once and each further step costs one token per beam, whatever the
context length. Prompts advance independently: one prompt's selection never waits for another's.
`BeamSearch` is the selection logic for one prompt; `run_beam_search` drives it over the offline
engine's in-process core, `async_beam_search` over the server's AsyncLLM.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

from tokenmill.engine.messages import EngineCoreAbort, EngineCoreFork, EngineCoreOutput, EngineCoreRequest, ForkChild
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import Logprob
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.engine.input_processor import ProcessedPrompt
    from tokenmill.engine.llm_engine import LLMEngine


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams fields and defaults."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        # Each beam asks the sampler for 2 * beam_width logprobs, capped like any request's.
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise InvalidRequestError(f"beam_width must be in [1, {MAX_LOGPROBS // 2}], got {self.beam_width}",
                                      "beam_width")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be non-negative, got {self.temperature}", "temperature")


@dataclass
class BeamSearchSequence:
    """One hypothesis. `tokens` include the prompt (as in vLLM); `logprobs` has one entry per
    generated token: the top logprobs the sampler returned at that position."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None  # "stop" (EOS) | "length"
    stop_reason: int | str | None = None

    def extended(self, token: int, top: dict[int, Logprob]) -> "BeamSearchSequence":
        return BeamSearchSequence(self.tokens + [token], self.logprobs + [top],
                                  self.cum_logprob + top[token].logprob)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: Sequence[int], cumulative_logprob: float, eos_token_ids: Sequence[int],
                          length_penalty: float = 1.0) -> float:
    """vLLM's (and HF's) length-normalised score: cum_logprob / len ** length_penalty, where len
    counts the prompt and the generated tokens but not a final EOS."""
    seq_len = len(tokens)
    if tokens and tokens[-1] in eos_token_ids:
        seq_len -= 1
    return cumulative_logprob / (seq_len ** length_penalty)


@dataclass(eq=False)
class _Beam:
    sequence: BeamSearchSequence
    core_id: str  # the core request computing this beam
    top: Optional[dict[int, Logprob]] = None  # its sampler logprobs, once it has sampled this step
    ended: bool = False  # the core finished it (max_tokens) when it sampled: nothing can fork from it


class BeamSearch:
    """The search for one prompt: turns the beams' outputs into the next fork and abort messages."""

    _ids = itertools.count()

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Sequence[int],
                 id_prefix: str = "beam") -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = list(eos_token_ids)
        self.id_prefix = id_prefix
        # EOS is the search's business (a finished hypothesis), so the core never stops on it; the
        # core ends a beam only at max_tokens, which every beam of a prompt reaches in the same round.
        self.core_params = SamplingParams(temperature=params.temperature, max_tokens=params.max_tokens,
                                          logprobs=2 * params.beam_width, ignore_eos=True, detokenize=False)
        self.beams: list[_Beam] = []
        self.live: dict[str, _Beam] = {}
        self.completed: list[BeamSearchSequence] = []
        self.num_generated = 0
        # Parents of the last fork: the scheduler replaces them with their children at its next step.
        self.forking: list[str] = []

    def _new_id(self) -> str:
        return f"{self.id_prefix}-{next(self._ids)}"

    @property
    def core_ids(self) -> list[str]:
        """Everything of this search the core may still hold (to abort when the search is abandoned)."""
        return list(self.live) + self.forking

    def first_request(self, arrival_time: float = 0.0) -> EngineCoreRequest:
        beam = _Beam(BeamSearchSequence(list(self.prompt_token_ids)), self._new_id())
        self._add_beam(beam)
        return EngineCoreRequest(beam.core_id, list(self.prompt_token_ids), self.core_params,
                                 self.eos_token_ids[0] if self.eos_token_ids else None,
                                 arrival_time=arrival_time, park_after_sample=True)

    def _add_beam(self, beam: _Beam) -> None:
        self.beams.append(beam)
        self.live[beam.core_id] = beam

    @property
    def done(self) -> bool:
        return not self.beams

    @property
    def ready(self) -> bool:
        return bool(self.beams) and all(b.top is not None for b in self.beams)

    def record(self, out: EngineCoreOutput) -> None:
        beam = self.live.get(out.request_id)
        if beam is None:
            return
        if out.error is not None:
            raise InvalidRequestError(out.error)
        if out.new_token_ids:
            if not out.new_logprobs:
                raise InvalidRequestError("beam search needs the sampler's logprobs of each beam")
            beam.top = out.new_logprobs[0]
            beam.ended = out.finish_reason is not None
        elif out.finish_reason is not None:  # ended without sampling (e.g. a queue timeout)
            self.beams.remove(beam)
            del self.live[out.request_id]

    def _score(self, seq: BeamSearchSequence) -> float:
        return get_beam_search_score(seq.tokens, seq.cum_logprob, self.eos_token_ids, self.params.length_penalty)

    def advance(self) -> tuple[list[EngineCoreFork], list[str]]:
        """All beams sampled: pick the next beams. Returns the forks to send and the core ids to abort."""
        self.num_generated += 1
        candidates: list[tuple[_Beam, int, BeamSearchSequence]] = []
        for beam in self.beams:
            top = beam.top or {}  # every beam has sampled when this runs
            for token in top:
                seq = beam.sequence.extended(token, top)
                if token in self.eos_token_ids and not self.params.ignore_eos:
                    seq.finish_reason, seq.stop_reason = "stop", None
                    self.completed.append(seq)
                else:
                    candidates.append((beam, token, seq))
        # A stable sort: among equal scores, earlier beams and higher-ranked tokens win (as vLLM).
        candidates.sort(key=lambda c: self._score(c[2]), reverse=True)
        chosen = candidates[:self.params.beam_width]
        old_beams, self.beams = self.beams, []
        for beam in old_beams:
            del self.live[beam.core_id]
        if self.num_generated >= self.params.max_tokens or not chosen:
            for _, _, seq in chosen:
                seq.finish_reason = "length"
                self.completed.append(seq)
            return [], [b.core_id for b in old_beams if not b.ended]
        children: dict[str, list[ForkChild]] = {}
        for parent, token, seq in chosen:
            if parent.ended:
                raise RuntimeError("beam search: a finished beam cannot be continued")
            child = _Beam(seq, self._new_id())
            children.setdefault(parent.core_id, []).append(ForkChild(child.core_id, last_token_id=token))
            self._add_beam(child)
        forks = [EngineCoreFork(parent_id, kids) for parent_id, kids in children.items()]
        self.forking = list(children)
        aborts = [b.core_id for b in old_beams if b.core_id not in children]
        return forks, aborts

    def result(self, tokenizer) -> BeamSearchOutput:
        best = sorted(self.completed, key=self._score, reverse=True)[:self.params.beam_width]
        num_prompt = len(self.prompt_token_ids)
        for seq in best:
            generated = seq.tokens[num_prompt:]
            if seq.finish_reason == "stop":
                generated = generated[:-1]  # EOS ends the text without joining it (as generate does)
            seq.text = tokenizer.decode(generated, skip_special_tokens=True)
        return BeamSearchOutput(best)


def run_beam_search(engine: "LLMEngine", prompts: Sequence["ProcessedPrompt"],
                    params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """Offline: drives the searches over the engine's in-process core (which must be idle, since the
    search reads the core's outputs itself)."""
    from tqdm.auto import tqdm

    if engine.has_unfinished_requests():
        raise InvalidRequestError("beam search needs an idle engine (other requests are running)")
    searches = [BeamSearch(p.prompt_token_ids, params, engine.eos_token_ids) for p in prompts]
    for search in searches:  # all validated before any runs
        engine.input_processor.validate_lengths(search.prompt_token_ids, search.core_params)
    core = engine.core
    owner: dict[str, BeamSearch] = {}
    bar = tqdm(total=len(searches), desc="Beam search", disable=not use_tqdm, leave=False)
    try:
        for search in searches:
            core.add_request(search.first_request())
            owner.update(dict.fromkeys(search.live, search))
        while any(not s.done for s in searches):
            for out in core.get_output().outputs:
                owning = owner.get(out.request_id)
                if owning is not None:
                    owning.record(out)
            for search in searches:
                if search.ready:
                    forks, aborts = search.advance()
                    for fork in forks:
                        core.fork(fork)
                    core.abort(EngineCoreAbort(aborts))
                    owner.update(dict.fromkeys(search.live, search))
                    bar.update(1 if search.done else 0)
    except BaseException:
        # Unforked parents too, or the next step would fork their children into the engine.
        core.abort(EngineCoreAbort([core_id for s in searches for core_id in s.core_ids]))
        raise
    finally:
        bar.close()
    return [search.result(engine.tokenizer) for search in searches]


async def async_beam_search(engine: "AsyncLLM", prompt: "ProcessedPrompt", params: BeamSearchParams,
                            request_id: str) -> BeamSearchOutput:
    """The server's beam search: the same search, its beams' outputs routed to it by the AsyncLLM
    while the engine keeps serving other requests."""
    import asyncio
    import time

    search = BeamSearch(prompt.prompt_token_ids, params, engine.eos_token_ids, id_prefix=f"{request_id}-beam")
    engine.input_processor.validate_lengths(search.prompt_token_ids, search.core_params)
    outputs: asyncio.Queue = asyncio.Queue()
    known: set[str] = set()
    try:
        await engine.add_core_request(search.first_request(time.monotonic()), outputs)
        known.update(search.live)
        while not search.done:
            out = await outputs.get()
            if isinstance(out, BaseException):
                raise out
            search.record(out)
            if search.ready:
                forks, aborts = search.advance()
                for fork in forks:
                    await engine.fork_core_request(fork, outputs)
                engine.release_core_requests(aborts, abort=True)
                known.update(search.live)
    finally:
        engine.release_core_requests(search.core_ids, abort=True)
        engine.release_core_requests(list(known), abort=False)
    return search.result(engine.tokenizer)
