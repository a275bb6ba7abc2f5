"""POST /v1/completions: one engine request per prompt, choices indexed prompt_i * n + sample_j."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator, Optional

from starlette.requests import Request
from starlette.responses import Response

from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    PromptLogprobEntry,
    UsageInfo,
)
from tokenmill.entrypoints.openai.serving_base import (
    CLIENT_CLOSED_REQUEST,
    GenerationGroup,
    GenerationJob,
    RequestLog,
    ServingBase,
    base_request_id,
    engine_request_id,
    safe_logprob,
    sse,
    token_text,
    usage_of,
)
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs

logger = logging.getLogger(__name__)

MAX_CHOICES = 1024  # prompts x n per request; more would flood the scheduler from one request


@dataclass
class _ChoiceState:
    """How much of one choice the client has already received."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    echoed: bool = False
    finished: bool = False


class OpenAIServingCompletion(ServingBase):
    async def create_completion(self, body: CompletionRequest, raw: Request) -> Response:
        lora = self.check_request(body.model)
        if body.suffix is not None:
            raise InvalidRequestError("suffix is not supported", "suffix")
        best_of = self._best_of(body)
        prompts = body.prompts()
        if len(prompts) * best_of > MAX_CHOICES:
            per_prompt = "best_of" if best_of > body.n else "n"
            raise InvalidRequestError(f"a request may ask for at most {MAX_CHOICES} choices (prompts x {per_prompt})",
                                      per_prompt)
        processor = self.engine.input_processor
        processed = [processor.process_prompt(p, "prompt") for p in prompts]
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
        if body.use_beam_search:
            if lora is not None:
                raise InvalidRequestError("beam search with a LoRA adapter is not supported", "use_beam_search")
            return await self._beam_search(body, processed, base_request_id(raw))
        params = body.sampling_params(max_tokens=body.max_tokens, logprobs=body.logprobs,
                                      prompt_logprobs=prompt_logprobs, vocab_size=processor.vocab_size)
        if best_of > body.n:  # the candidates' cumulative logprobs rank them, so each token's is kept
            params = params.clone(n=best_of, logprobs=body.logprobs or 0)
        request_id = base_request_id(raw)
        response_id = f"cmpl-{request_id}"
        jobs = [GenerationJob(engine_request_id(response_id, i), p, params) for i, p in enumerate(processed)]
        group = GenerationGroup(self.engine, jobs, RequestLog(request_id, "/v1/completions"), request=raw,
                                priority=body.priority, user=body.user, stream=body.stream, lora=lora)
        group.start()
        if body.stream:
            return await self._stream(body, group, processed, response_id)
        return await self._full(body, group, processed, response_id)

    @staticmethod
    def _best_of(body: CompletionRequest) -> int:
        """Samples generated per prompt: best_of (at least n; the n best are returned), or n."""
        if body.best_of is None or body.use_beam_search:
            return body.n
        if body.best_of < body.n:
            raise InvalidRequestError(f"best_of ({body.best_of}) must be greater than or equal to n ({body.n})",
                                      "best_of")
        if body.stream and body.best_of > body.n:
            raise InvalidRequestError("best_of greater than n cannot be used with stream", "best_of")
        return body.best_of

    # ---- beam search ---------------------------------------------------------------------
    async def _beam_search(self, body: CompletionRequest, prompts: list[ProcessedPrompt],
                           request_id: str) -> Response:
        """use_beam_search: n beams per prompt (beam width = n), best first; not streamed."""
        import asyncio

        from tokenmill.beam_search import BeamSearchParams, async_beam_search

        if body.stream:
            raise InvalidRequestError("use_beam_search cannot be combined with stream", "stream")
        if body.echo or body.logprobs is not None:
            raise InvalidRequestError("use_beam_search does not support echo or logprobs", "use_beam_search")
        if body.structured_outputs_params() is not None:
            raise InvalidRequestError("use_beam_search does not support structured outputs", "use_beam_search")
        try:
            params = BeamSearchParams(beam_width=body.n, max_tokens=body.max_tokens or 16,
                                      ignore_eos=body.ignore_eos, length_penalty=body.length_penalty)
        except InvalidRequestError as exc:  # the beam width is the request's `n`
            param = "n" if exc.param == "beam_width" else exc.param
            raise InvalidRequestError(exc.message.replace("beam_width", "n (the beam width)"), param) from None
        results = await asyncio.gather(*(async_beam_search(self.engine, p, params, f"{request_id}-{i}")
                                         for i, p in enumerate(prompts)))
        choices, completion_tokens = [], 0
        for i, (prompt, result) in enumerate(zip(prompts, results)):
            for j, seq in enumerate(result.sequences):
                num_generated = len(seq.tokens) - len(prompt.prompt_token_ids)
                completion_tokens += num_generated
                choices.append(CompletionResponseChoice(index=i * body.n + j, text=seq.text or "",
                                                        finish_reason=seq.finish_reason,
                                                        stop_reason=seq.stop_reason))
        num_prompt = sum(len(p.prompt_token_ids) for p in prompts)
        usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=completion_tokens,
                          total_tokens=num_prompt + completion_tokens)
        response = CompletionResponse(id=f"cmpl-{request_id}", model=self.model_name, choices=choices, usage=usage)
        return Response(response.model_dump_json(), media_type="application/json")

    # ---- non-streaming -------------------------------------------------------------------
    async def _full(self, body: CompletionRequest, group: GenerationGroup, prompts: list[ProcessedPrompt],
                    response_id: str) -> Response:
        if not await self.collect(group):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        outputs = group.final_outputs()
        choices = []
        for prompt_index, out in enumerate(outputs):
            prompt_text = self._prompt_text(prompts[prompt_index]) if body.echo else ""
            for rank, comp in enumerate(_best(out.outputs, body.n)):
                logprobs = None
                if body.logprobs is not None:
                    logprobs, _ = self._logprobs(body, out, comp, prompt_text, 0, 0, echo=body.echo)
                choices.append(CompletionResponseChoice(
                    index=prompt_index * body.n + rank, text=prompt_text + comp.text, logprobs=logprobs,
                    finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                    prompt_logprobs=_prompt_logprobs(out) if body.prompt_logprobs is not None else None))
        choices.sort(key=lambda c: c.index)
        response = CompletionResponse(id=response_id, model=self.response_model(group.lora), choices=choices,
                                      usage=usage_of(outputs))
        return Response(response.model_dump_json(), media_type="application/json")

    # ---- streaming -----------------------------------------------------------------------
    async def _stream(self, body: CompletionRequest, group: GenerationGroup, prompts: list[ProcessedPrompt],
                      response_id: str) -> Response:
        states: dict[int, _ChoiceState] = {}

        def render(batch: dict[int, RequestOutput]) -> Iterator[str]:
            for prompt_index, out in sorted(batch.items()):
                for comp in out.outputs:
                    index = prompt_index * body.n + comp.index
                    state = states.setdefault(index, _ChoiceState())
                    choice = self._delta(body, state, index, out, comp, prompts[prompt_index])
                    if choice is not None:
                        usage = usage_of(group.final_outputs()) if body.continuous_usage else None
                        yield sse(CompletionStreamResponse(id=response_id, model=self.response_model(group.lora),
                                                           choices=[choice], usage=usage))

        def tail() -> Iterator[str]:
            if body.include_usage:
                yield sse(CompletionStreamResponse(id=response_id, model=self.response_model(group.lora), choices=[],
                                                   usage=usage_of(group.final_outputs())))

        return await self.stream(group, render, tail)

    def _delta(self, body: CompletionRequest, state: _ChoiceState, index: int, out: RequestOutput,
               comp: CompletionOutput, prompt: ProcessedPrompt) -> Optional[CompletionStreamChoice]:
        if state.finished:
            return None
        # comp is a delta: its text, token ids and logprobs are the new ones only.
        echo_now = body.echo and not state.echoed
        prefix = self._prompt_text(prompt) if echo_now else ""
        delta = comp.text
        num_new = len(comp.token_ids)
        finish = comp.finish_reason
        if not (prefix or delta or finish or (body.logprobs is not None and num_new > 0)):
            return None
        logprobs = None
        if body.logprobs is not None:
            logprobs, state.text_offset = self._logprobs(body, out, comp, prefix, 0, state.text_offset,
                                                         echo=echo_now)
        state.echoed = state.echoed or echo_now
        state.text_len += len(delta)
        state.num_tokens += num_new
        state.finished = finish is not None
        return CompletionStreamChoice(index=index, text=prefix + delta, logprobs=logprobs, finish_reason=finish,
                                      stop_reason=comp.stop_reason if finish else None)

    # ---- helpers -------------------------------------------------------------------------
    def _prompt_text(self, prompt: ProcessedPrompt) -> str:
        if prompt.prompt is not None:
            return prompt.prompt
        return self.engine.tokenizer.decode(prompt.prompt_token_ids)

    def _logprobs(self, body: CompletionRequest, out: RequestOutput, comp: CompletionOutput, prompt_text: str,
                  start: int, offset: int, *, echo: bool) -> tuple[CompletionLogProbs, int]:
        """Logprobs of generated tokens from `start` on (and of the prompt first when echoing)."""
        result = CompletionLogProbs()
        if echo:
            offset = self._append_logprobs(result, body, out.prompt_token_ids, out.prompt_logprobs, offset)
            offset = max(offset, len(prompt_text))
        offset = self._append_logprobs(result, body, comp.token_ids[start:],
                                       (comp.logprobs or [])[start:], offset)
        return result, offset

    def _append_logprobs(self, result: CompletionLogProbs, body: CompletionRequest, token_ids: list[int],
                         steps: Optional[SampleLogprobs | PromptLogprobs], offset: int) -> int:
        tokenizer = self.engine.tokenizer
        top_n = body.logprobs or 0
        as_ids = body.return_tokens_as_token_ids
        for i, token_id in enumerate(token_ids):
            step = steps[i] if steps is not None and i < len(steps) else None
            sampled = step.get(token_id) if step else None
            text = token_text(tokenizer, token_id, sampled, as_ids)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            if step is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(safe_logprob(sampled.logprob) if sampled else None)
            top: dict[str, float] = {}
            for other_id, lp in sorted(step.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0)):
                if other_id == token_id or lp.rank is None or lp.rank <= top_n:
                    top[token_text(tokenizer, other_id, lp, as_ids)] = safe_logprob(lp.logprob)
            result.top_logprobs.append(top)
        return offset


def _best(completions: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """The n completions to return, in index order; with best_of > n, the n of highest cumulative
    logprob, best first (usage still counts every candidate's tokens, as OpenAI bills them)."""
    ordered = sorted(completions, key=lambda c: c.index)
    if len(ordered) <= n:
        return ordered
    return sorted(ordered, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]


def _prompt_logprobs(out: RequestOutput) -> Optional[list[Optional[dict[str, PromptLogprobEntry]]]]:
    if out.prompt_logprobs is None:
        return None
    def entry(lp: Logprob) -> PromptLogprobEntry:
        return PromptLogprobEntry(logprob=safe_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)

    return [None if step is None else {str(token_id): entry(lp) for token_id, lp in step.items()}
            for step in out.prompt_logprobs]
