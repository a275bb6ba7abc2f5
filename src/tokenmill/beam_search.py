"""Beam search on the engine core: beams share KV blocks and fork with copy-on-write.

The user-facing shapes are vLLM's: `LLM.beam_search(prompts, BeamSearchParams(...))` returns one
`BeamSearchOutput` per prompt whose `sequences` are sorted best first; a sequence's `tokens` hold
the prompt followed by the generated ids.

Unlike vLLM's offline beam search (which re-submits every beam as a new one-token request and
relies on the prefix cache for the full blocks), each beam here is a live core `Request`, and the
next beams fork from it through the scheduler's fork machinery (the one n > 1 uses):

    step s   every live beam computes its newest token and samples once, asking for the top
             2 * beam_width logprobs; the search then parks it (fork_children = []), so it keeps
             its blocks and computes nothing more.
    select   once every live beam of a prompt has reported: candidate (beam b, token t) scores
             cum_logprob(b) + logprob(t | b); EOS candidates become finished hypotheses, the best
             beam_width others become the next beams.
    fork     each picked candidate is a child Request holding b's tokens + t; setting
             b.fork_children = [children] lets the scheduler fork them from b in its next step:
             every block of b is shared (ref counts up) and the partially filled last block is
             copied on a child's first write. Beams nobody picked are aborted, dropping their
             references.

So the prompt is computed once and each further step costs one token per beam, whatever the
context length. Prompts advance independently: one prompt's selection never waits for another's.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

from tokenmill.core.request import Request
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import Logprob
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.engine_core import EngineCore
    from tokenmill.engine.input_processor import ProcessedPrompt
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.messages import EngineCoreOutput


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
    request: Request  # the core request computing this beam
    top: Optional[dict[int, Logprob]] = None  # its sampler logprobs, once it has sampled this step
    ended: bool = False  # the core finished it (max_tokens) when it sampled: nothing can fork from it


@dataclass(eq=False)
class _Instance:
    """The search for one prompt."""

    prompt_token_ids: list[int]
    beams: list[_Beam]
    completed: list[BeamSearchSequence] = field(default_factory=list)
    num_generated: int = 0

    @property
    def ready(self) -> bool:
        return bool(self.beams) and all(b.top is not None for b in self.beams)


class BeamSearchRunner:
    """Drives the engine core step by step for a batch of prompts (offline; needs an idle engine,
    since it reads the core's outputs itself)."""

    _ids = itertools.count()

    def __init__(self, engine: "LLMEngine", params: BeamSearchParams) -> None:
        self.engine = engine
        self.core: "EngineCore" = engine.core
        self.params = params
        self.eos_token_ids = list(engine.eos_token_ids)
        # EOS is the search's business (a finished hypothesis), so the core never stops on it; the
        # core ends a beam only at max_tokens, which every beam of a prompt reaches in the same round.
        self.core_params = SamplingParams(temperature=params.temperature, max_tokens=params.max_tokens,
                                          logprobs=2 * params.beam_width, ignore_eos=True, detokenize=False)
        self.live: dict[str, tuple[_Instance, _Beam]] = {}
        # Parents handed their children this round; the scheduler forks them in the next step.
        self.forking: list[Request] = []

    # ---- driving -------------------------------------------------------------------------
    def run(self, prompts: Sequence["ProcessedPrompt"], use_tqdm: bool = False) -> list[BeamSearchOutput]:
        from tqdm.auto import tqdm

        if self.engine.has_unfinished_requests() or self.core.has_unfinished_requests():
            raise InvalidRequestError("beam search needs an idle engine (other requests are running)")
        for prompt in prompts:  # all validated before any runs
            self.engine.input_processor.validate_lengths(prompt.prompt_token_ids, self.core_params)
        instances = [self._start(p.prompt_token_ids) for p in prompts]
        bar = tqdm(total=len(instances), desc="Beam search", disable=not use_tqdm, leave=False)
        try:
            while any(inst.beams for inst in instances):
                if not self.core.has_unfinished_requests():
                    raise RuntimeError("beam search: live beams but no work left in the engine core")
                outputs = self.core.step()
                self.forking.clear()
                for out in outputs:
                    self._record(out)
                for inst in instances:
                    if inst.ready:
                        self._advance(inst)
                        bar.update(0 if inst.beams else 1)
        except BaseException:
            # Unforked parents too, or the next step would fork their children into the engine.
            self.core.abort_requests([r.request_id for r in self.forking] + list(self.live))
            self.live.clear()
            raise
        finally:
            bar.close()
        return [self._result(inst) for inst in instances]

    def _start(self, prompt_token_ids: list[int]) -> _Instance:
        request = Request(self._new_id(), list(prompt_token_ids), self.core_params,
                          self.eos_token_ids[0] if self.eos_token_ids else None)
        inst = _Instance(list(prompt_token_ids), [])
        self._add_beam(inst, _Beam(BeamSearchSequence(list(prompt_token_ids)), request))
        self.core.add_request(request)
        return inst

    def _new_id(self) -> str:
        return f"beam-{next(self._ids)}"

    def _add_beam(self, inst: _Instance, beam: _Beam) -> None:
        inst.beams.append(beam)
        self.live[beam.request.request_id] = (inst, beam)

    def _record(self, out: "EngineCoreOutput") -> None:
        entry = self.live.get(out.request_id)
        if entry is None:
            return
        inst, beam = entry
        if out.new_token_ids:
            beam.top = out.new_logprobs[0]
            if out.finish_reason is None:
                beam.request.fork_children = []  # park: hold the blocks until the children are known
            else:
                beam.ended = True
        elif out.finish_reason is not None:  # ended without sampling (e.g. a queue timeout)
            inst.beams.remove(beam)
            del self.live[out.request_id]

    # ---- selection -----------------------------------------------------------------------
    def _score(self, seq: BeamSearchSequence) -> float:
        return get_beam_search_score(seq.tokens, seq.cum_logprob, self.eos_token_ids, self.params.length_penalty)

    def _advance(self, inst: _Instance) -> None:
        """All beams of the prompt sampled: pick the next beams and fork them from their parents."""
        inst.num_generated += 1
        candidates: list[tuple[_Beam, int, BeamSearchSequence]] = []
        for beam in inst.beams:
            for token in beam.top:
                seq = beam.sequence.extended(token, beam.top)
                if token in self.eos_token_ids and not self.params.ignore_eos:
                    seq.finish_reason, seq.stop_reason = "stop", None
                    inst.completed.append(seq)
                else:
                    candidates.append((beam, token, seq))
        # A stable sort: among equal scores, earlier beams and higher-ranked tokens win (as vLLM).
        candidates.sort(key=lambda c: self._score(c[2]), reverse=True)
        chosen = candidates[:self.params.beam_width]
        old_beams, inst.beams = inst.beams, []
        for beam in old_beams:
            del self.live[beam.request.request_id]
        if inst.num_generated >= self.params.max_tokens or not chosen:
            for _, _, seq in chosen:
                seq.finish_reason = "length"
                inst.completed.append(seq)
            self.core.abort_requests([b.request.request_id for b in old_beams if not b.ended])
            return
        children: dict[_Beam, list[Request]] = {}
        for parent, token, seq in chosen:
            child = self._child_request(parent, token)
            children.setdefault(parent, []).append(child)
            self._add_beam(inst, _Beam(seq, child))
        for beam in old_beams:
            if beam in children:
                beam.request.fork_children = children[beam]  # the scheduler forks them next step
                self.forking.append(beam.request)
            else:
                self.core.abort_requests([beam.request.request_id])

    def _child_request(self, parent: _Beam, token: int) -> Request:
        if parent.ended:
            raise RuntimeError("beam search: a finished beam cannot be continued")
        request = parent.request
        child = Request(self._new_id(), list(request.prompt_token_ids), request.sampling_params,
                        request.eos_token_id, arrival_time=request.arrival_time)
        # The parent's last output token is its own sample, never computed: the child replaces it.
        for generated in request.output_token_ids[:-1]:
            child.append_output_token(generated)
        child.append_output_token(token)
        return child

    def _result(self, inst: _Instance) -> BeamSearchOutput:
        best = sorted(inst.completed, key=self._score, reverse=True)[:self.params.beam_width]
        tokenizer = self.engine.tokenizer
        num_prompt = len(inst.prompt_token_ids)
        for seq in best:
            generated = seq.tokens[num_prompt:]
            if seq.finish_reason == "stop":
                generated = generated[:-1]  # EOS ends the text without joining it (as generate does)
            seq.text = tokenizer.decode(generated, skip_special_tokens=True)
        return BeamSearchOutput(best)


def run_beam_search(engine: "LLMEngine", prompts: Sequence["ProcessedPrompt"],
                    params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    return BeamSearchRunner(engine, params).run(prompts, use_tqdm)
