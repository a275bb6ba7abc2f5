"""What completions and chat share: model and engine checks, running a request's engine requests
concurrently, noticing a client that went away, and the one log line per finished request.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Optional

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokenmill.entrypoints.openai.errors import error_body
from tokenmill.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo
from tokenmill.entrypoints.openai.rate_limit import REASON, request_key
from tokenmill.errors import EngineDeadError, ModelNotFoundError, RateLimitExceededError, TokenmillError
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.engine.input_processor import ProcessedPrompt
    from tokenmill.entrypoints.openai.serving_models import OpenAIServingModels
    from tokenmill.sampling_params import SamplingParams

request_logger = logging.getLogger("tokenmill.requests")
logger = logging.getLogger(__name__)

# JSON has no -inf; vLLM's clients are used to this stand-in for "impossible".
MIN_LOGPROB = -9999.0
_engine_ids = itertools.count()
# Aborts are fire-and-forget tasks; holding them here keeps them from being garbage-collected mid-flight.
_background: set[asyncio.Task] = set()
# Turns one batch {prompt index: newest output} into SSE events.
Renderer = Callable[[dict[int, RequestOutput]], Iterable[str]]


class ClientDisconnected(Exception):
    """The HTTP client went away; its engine requests have been aborted."""


def spawn(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)


def safe_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def token_text(tokenizer: Any, token_id: int, logprob: Optional[Logprob], as_ids: bool = False) -> str:
    if as_ids:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id])


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499  # nobody reads it: the client is gone


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(out.prompt_token_ids) for out in outputs)
    completion = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    cached = sum(out.num_cached_tokens or 0 for out in outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def sse_error(message: str, error_type: str, param: Any = None, code: Any = None) -> str:
    return f"data: {json.dumps(error_body(message, error_type, param, code))}\n\n"


def base_request_id(raw: Request) -> str:
    return getattr(raw.state, "request_id", None) or uuid.uuid4().hex


def engine_request_id(base: str, index: int) -> str:
    # A client may reuse an X-Request-Id; the counter keeps engine ids unique anyway.
    return f"{base}-{index}-{next(_engine_ids)}"


@dataclass(slots=True)
class GenerationJob:
    request_id: str  # the engine's id
    prompt: "ProcessedPrompt"
    params: "SamplingParams"


@dataclass
class RequestLog:
    """Timing and token counts of one HTTP request, written once as a JSON line when it ends."""

    request_id: str
    endpoint: str
    arrival: float = field(default_factory=time.monotonic)
    first_token: Optional[float] = None
    emitted: bool = False
    tenant: Optional[str] = None

    def emit(self, status: str, outputs: list[RequestOutput]) -> None:
        if self.emitted:
            return
        self.emitted = True
        reasons = [c.finish_reason for out in outputs for c in out.outputs]
        record = {
            "event": "request_finished",
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "tenant": self.tenant,
            "status": status,
            "prompt_tokens": sum(len(out.prompt_token_ids) for out in outputs),
            "output_tokens": sum(len(c.token_ids) for out in outputs for c in out.outputs),
            "ttft_s": None if self.first_token is None else round(self.first_token - self.arrival, 4),
            "total_s": round(time.monotonic() - self.arrival, 4),
            "finish_reason": reasons[0] if len(set(reasons)) == 1 else reasons,
            "spec_accepted_tokens": sum(out.metrics.num_spec_accepted_tokens for out in outputs
                                        if out.metrics is not None),
        }
        request_logger.info(json.dumps(record))


class ServingBase:
    def __init__(self, engine: "AsyncLLM", model_name: str, models: Optional["OpenAIServingModels"] = None) -> None:
        """models: the server's models and LoRA adapters, which a request's `model` may name."""
        self.engine = engine
        self.model_name = model_name
        self.models = models

    def check_request(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The LoRA adapter the request's `model` names (None: the base model); 404 for an unknown name."""
        if self.engine.errored:
            raise EngineDeadError("the engine has stopped and cannot serve requests", code="engine_dead")
        if self.models is not None:
            return self.models.resolve(model)
        if model not in (None, "", self.model_name):
            raise ModelNotFoundError(f"The model `{model}` does not exist.", "model", "model_not_found")
        return None

    def response_model(self, lora: Optional[LoRARequest]) -> str:
        """The `model` a response names: the adapter the request asked for, else the served model."""
        return lora.lora_name if lora is not None else self.model_name

    @staticmethod
    async def collect(group: "GenerationGroup") -> bool:
        """Waits for every engine request to end; False when the client went away first."""
        try:
            async for _ in group.updates():
                pass
        except ClientDisconnected:
            return False
        finally:
            group.close()
        return True

    async def stream(self, group: "GenerationGroup", render: Renderer, tail: Callable[[], Iterable[str]]) -> Response:
        """An SSE response: `render` turns each batch of outputs into events, `tail` adds the last ones."""
        updates = group.updates()
        try:
            # Waiting for the first output lets errors such as admission rejections keep their status code.
            first = await updates.__anext__()
        except StopAsyncIteration:
            first = {}
        except ClientDisconnected:
            group.close()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BaseException:
            group.close()
            raise
        return StreamingResponse(self._events(group, updates, first, render, tail), media_type="text/event-stream")

    @staticmethod
    async def _events(group: "GenerationGroup", updates: AsyncIterator[dict[int, RequestOutput]],
                      first: dict[int, RequestOutput], render: Renderer,
                      tail: Callable[[], Iterable[str]]) -> AsyncIterator[str]:
        batch = first
        try:
            while True:
                for event in render(batch):
                    yield event
                batch = await updates.__anext__()
        except StopAsyncIteration:
            pass
        except ClientDisconnected:
            return
        except TokenmillError as exc:  # the status line is already sent: the error goes in-band
            yield sse_error(exc.message, exc.error_type, exc.param, exc.code)
        except Exception:
            logger.exception("streaming a response failed")
            yield sse_error("internal server error", "internal_error")
        finally:
            group.close()
        for event in tail():
            yield event
        yield SSE_DONE


def _limiter(request: Optional[Request]) -> Any:
    app = getattr(request, "app", None) if request is not None else None
    return getattr(getattr(app, "state", None), "rate_limiter", None)


def merge_delta(into: Optional[RequestOutput], delta: RequestOutput, keep_text: bool) -> RequestOutput:
    """Fold a DELTA output into an earlier one (per sample: tokens and logprobs appended, text too when
    keep_text, the newest finish reason). Costs what the delta holds, not what came before."""
    if into is None:
        into = dataclasses.replace(delta, outputs=[])
    else:
        into.finished = delta.finished
        into.prompt_logprobs = delta.prompt_logprobs if delta.prompt_logprobs is not None else into.prompt_logprobs
        into.num_cached_tokens = delta.num_cached_tokens
    by_index = {c.index: c for c in into.outputs}
    for comp in delta.outputs:
        have = by_index.get(comp.index)
        if have is None:
            have = CompletionOutput(comp.index, "", [], logprobs=[] if comp.logprobs is not None else None)
            into.outputs.append(have)
            by_index[comp.index] = have
        if keep_text:
            have.text += comp.text
        have.token_ids.extend(comp.token_ids)
        if comp.logprobs is not None and have.logprobs is not None:
            have.logprobs.extend(comp.logprobs)
        have.cumulative_logprob = comp.cumulative_logprob
        have.finish_reason, have.stop_reason = comp.finish_reason, comp.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    return into


class _JobSink:
    """Where the engine puts one prompt's outputs: straight into its group, from the step's callback."""

    __slots__ = ("group", "index")

    def __init__(self, group: "GenerationGroup", index: int) -> None:
        self.group = group
        self.index = index

    def put_nowait(self, item: Any) -> None:
        self.group._deliver(self.index, item)


class GenerationGroup:
    """Runs one engine request per prompt concurrently and merges their outputs.

    Streaming, the engine sends deltas (only what is new); deltas a slow reader has not taken yet are
    merged into one, so it catches up in a single event. Otherwise the engine sends each request's
    final output once. The engine hands every output to the group as the step's outputs arrive (no
    task per prompt in between), so a stream's token costs the event loop one wake-up: the response
    task that renders and writes it. A watcher on the HTTP connection aborts every engine request the
    moment the client disconnects, whether or not anyone is reading the outputs.
    """

    def __init__(self, engine: "AsyncLLM", jobs: list[GenerationJob], log: RequestLog, *,
                 request: Optional[Request] = None, priority: int = 0, user: Optional[str] = None,
                 stream: bool = False, lora: Optional[LoRARequest] = None) -> None:
        self.engine = engine
        self.lora = lora
        self.jobs = jobs
        self.stream = stream
        self.log = log
        self.latest: dict[int, RequestOutput] = {}
        self._request = request
        self._priority = priority
        # An API key's tenant (--api-keys-file) stands for the request's user: the fair policy's tenant.
        limiter = _limiter(request)
        self._user = (limiter.tenant(request_key(request)) if limiter is not None else None) or user
        log.tenant = self._user
        self._pending: dict[int, RequestOutput] = {}
        self._ended = [False] * len(jobs)
        self._num_submitted = 0  # jobs sent to the engine (in order; one refused stops the rest)
        self._error: Optional[BaseException] = None
        self._disconnected = False
        self._closed = False
        self._changed = asyncio.Event()
        self._watcher: Optional[asyncio.Task] = None

    def start(self) -> None:
        """Validates every prompt (so none starts computing if one cannot run), then starts them all."""
        kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        for job in self.jobs:
            params = self.engine.input_processor.validate(job.prompt.prompt_token_ids, job.params)
            job.params = params.clone(output_kind=kind)
        self._charge_tokens()
        for index, job in enumerate(self.jobs):
            try:
                self.engine.submit(job.prompt, job.params, job.request_id, _JobSink(self, index),
                                   priority=self._priority, user=self._user, validated=True, lora=self.lora)
            except Exception as exc:  # handed to the reader, which maps it to an error response
                self._error = exc
                break
            self._num_submitted += 1
        if self._request is not None:
            self._watcher = asyncio.ensure_future(self._watch_disconnect(self._request))

    def _charge_tokens(self) -> None:
        """The API key's tokens-per-minute limit, charged with the most this request may use."""
        limiter = _limiter(self._request)
        if limiter is None:
            return
        cost = sum(len(job.prompt.prompt_token_ids) + job.params.n * (job.params.max_tokens or 0) for job in self.jobs)
        try:
            limiter.charge_tokens(request_key(self._request), cost)
        except RateLimitExceededError:
            self.engine.num_rejected[REASON] = self.engine.num_rejected.get(REASON, 0) + 1
            raise

    def _deliver(self, index: int, item: Any) -> None:
        """One output (or the exception that ends the prompt's request) from the engine."""
        if self._ended[index]:
            return
        if isinstance(item, BaseException):
            self._ended[index] = True
            if self._error is None:
                self._error = item
        else:
            if self.log.first_token is None and any(c.token_ids for c in item.outputs):
                self.log.first_token = time.monotonic()
            if self.stream:
                self.latest[index] = merge_delta(self.latest.get(index), item, keep_text=False)
                self._pending[index] = merge_delta(self._pending.get(index), item, keep_text=True)
            else:
                self.latest[index] = item
                self._pending[index] = item
            self._ended[index] = item.finished
        self._changed.set()

    async def _watch_disconnect(self, request: Request) -> None:
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the connection is already finished: nothing to watch
            return
        self._disconnected = True
        self._changed.set()
        self.close()

    async def updates(self) -> AsyncIterator[dict[int, RequestOutput]]:
        """Yields {prompt index: newest output} until every engine request has ended."""
        while True:
            if self._disconnected:
                raise ClientDisconnected()
            if self._error is not None:
                raise self._error
            if self._pending:
                batch, self._pending = self._pending, {}
                yield batch
                continue
            if all(self._ended):
                return
            self._changed.clear()
            await self._changed.wait()

    def final_outputs(self) -> list[RequestOutput]:
        return [self.latest[i] for i in sorted(self.latest)]

    def close(self) -> None:
        """Aborts whatever is still running and writes the log line; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        current = asyncio.current_task()
        if self._watcher is not None and self._watcher is not current:
            self._watcher.cancel()
        for index, job in enumerate(self.jobs[:self._num_submitted]):
            out = self.latest.get(index)
            if out is None or not out.finished:
                spawn(self._abort(job.request_id))
        self.log.emit(self._status(), self.final_outputs())

    def _status(self) -> str:
        if self._disconnected:
            return "client_disconnected"
        if self._error is not None:
            return "error"
        if len(self.latest) == len(self.jobs) and all(out.finished for out in self.latest.values()):
            return "finished"
        return "aborted"

    async def _abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception:  # the request may already be gone; nothing left to free
            logger.debug("abort of %s failed", request_id, exc_info=True)
