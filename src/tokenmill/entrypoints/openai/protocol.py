"""Pydantic models of the OpenAI-compatible HTTP API (OpenAI's fields plus vLLM's extras).

The request models carry the range checks that OpenAI documents, so `/openapi.json` shows them and a bad
value is refused with a 400 that names the field before anything reaches the engine. Conversion to
`SamplingParams` lives here too, because it is pure field mapping.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from tokenmill.engine.text_checks import find_bad_text
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import INT64_MAX, INT64_MIN, MAX_CACHE_TTL_S, SamplingParams, StructuredOutputsParams

MAX_N = 128  # OpenAI's limit on choices per prompt

PromptType = Union[str, list[str], list[int], list[list[int]]]


class OpenAIModel(BaseModel):
    # NaN and Infinity are valid Python JSON but would poison the sampler, so floats must be finite.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestModel(OpenAIModel):
    """A request body: every string in it (nested ones and dict keys included) passes the shared text
    check before any field is parsed, so text no encoder accepts is a 400 naming its field."""

    @model_validator(mode="before")
    @classmethod
    def _check_strings(cls, data: Any) -> Any:
        bad = find_bad_text(data) if isinstance(data, dict) else None
        if bad is not None:
            param, problem = bad
            # `param` travels in ctx: the error handler uses it as the OpenAI error's `param`.
            raise PydanticCustomError("invalid_text", "'{param}' {problem}", {"param": param, "problem": problem})
        return _nulls_as_defaults(cls, data) if isinstance(data, dict) else data


def _nulls_as_defaults(cls: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """A top-level null for a field with a non-null default means that default, as OpenAI's API reads
    `"n": null`, `"stream": null` or `"presence_penalty": null` (clients that serialize every field send
    them). Fields whose default is null take the null as it is."""
    fields = cls.model_fields
    nulls = [key for key, value in data.items()
             if value is None and key in fields and fields[key].default is not None and not fields[key].is_required()]
    if not nulls:
        return data
    return {key: value for key, value in data.items() if key not in nulls}


# ---- errors ------------------------------------------------------------------------------------
class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ---- shared pieces -----------------------------------------------------------------------------
class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (memory or the offload tier)


class CompletionTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    completion_tokens_details: Optional[CompletionTokensDetails] = None  # with a reasoning parser

    @model_serializer(mode="wrap")
    def _without_absent_details(self, handler: Any) -> Any:
        # Left out unless a reasoning parser counted something: replies stay as they were without one.
        data = handler(self)
        if isinstance(data, dict) and data.get("completion_tokens_details") is None:
            data.pop("completion_tokens_details", None)
        return data


def _now() -> int:
    return int(time.time())


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("stop must be a string or a list of strings")


class JsonSchemaFormat(OpenAIModel):
    name: Optional[str] = None
    description: Optional[str] = None
    # `schema` would shadow a pydantic BaseModel attribute, hence the alias.
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsField(OpenAIModel):
    """vLLM's `structured_outputs` request extra."""

    json_: Optional[Union[str, dict[str, Any]]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False


class SamplingFields(RequestModel):
    """Fields shared by completions and chat completions."""

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    user: Optional[str] = None
    # vLLM extras
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0)
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    # tokenmill's extension: keep the prompt's prefix cached this long after the request (SamplingParams)
    cache_ttl_s: Optional[float] = Field(None, gt=0.0, le=MAX_CACHE_TTL_S)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsField] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    _check_stop = field_validator("stop", mode="before")(_check_stop)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: Optional[StreamOptions],
                                    info: ValidationInfo) -> Optional[StreamOptions]:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream set to true")
        return value

    def sampling_params(self, *, max_tokens: Optional[int], logprobs: Optional[int],
                        prompt_logprobs: Optional[int], vocab_size: int) -> SamplingParams:
        top_k = self.top_k
        if top_k is not None and top_k >= vocab_size:
            top_k = None  # keeping the whole vocabulary is the same as no top-k
        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop,
            stop_token_ids=_checked_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids"),
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=_checked_logit_bias(self.logit_bias, vocab_size),
            structured_outputs=self.structured_outputs_params(),
            cache_ttl_s=self.cache_ttl_s,
        )

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The one output constraint this request sets, if any (400 when it sets several)."""
        found: list[StructuredOutputsParams] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(StructuredOutputsParams(json_object=True, param="response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.json_schema if fmt.json_schema is not None else None
            if schema is None:
                raise InvalidRequestError("response_format of type json_schema needs json_schema.schema",
                                          "response_format")
            found.append(StructuredOutputsParams(json=schema, param="response_format"))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            found.append(StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                                 json_object=bool(so.json_object),
                                                 disable_any_whitespace=so.disable_any_whitespace,
                                                 param="structured_outputs"))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append(StructuredOutputsParams(**{key: value}, param=name))
        if len(found) > 1:
            raise InvalidRequestError("give at most one of response_format (json_object / json_schema), "
                                      "structured_outputs and guided_*", found[1].param)
        return found[0] if found else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _checked_token_ids(ids: Optional[list[int]], vocab_size: int, param: str) -> Optional[list[int]]:
    if ids is not None and any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"{param} must be token ids in 0..{vocab_size - 1}", param)
    return ids


def _checked_logit_bias(bias: Optional[dict[str, float]], vocab_size: int) -> Optional[dict[int, float]]:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(f"logit_bias token id {token} is outside the vocabulary", "logit_bias")
        out[token] = value
    return out


# ---- completions -------------------------------------------------------------------------------
def _check_prompt_shape(value: Any) -> Any:
    """One clear message instead of pydantic's per-union-member errors; bools are not token ids."""
    def is_id(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if all(isinstance(x, str) for x in value) or all(is_id(x) for x in value):
            return value
        if all(isinstance(x, list) and all(is_id(t) for t in x) for x in value):
            return value
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists")


class CompletionRequest(SamplingFields):
    prompt: PromptType
    max_tokens: Optional[int] = Field(16, ge=1)
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0)  # at most --max-logprobs (checked by the engine)
    suffix: Optional[str] = None
    # OpenAI's legacy completions: generate best_of samples per prompt, return the n with the highest
    # cumulative logprob (vLLM V1 dropped it; older clients still send it).
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    prompt_logprobs: Optional[int] = Field(None, ge=0)
    return_tokens_as_token_ids: bool = False
    # vLLM's beam search extras: n beams are returned, best first.
    use_beam_search: bool = False
    length_penalty: float = 1.0

    _check_prompt = field_validator("prompt", mode="before")(_check_prompt_shape)

    def prompts(self) -> list[Union[str, list[int]]]:
        """The request's prompts, one per engine request."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("the prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class PromptLogprobEntry(OpenAIModel):
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


class CompletionResponseChoice(OpenAIModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    # vLLM's extra for `prompt_logprobs`: per prompt position (the first is null), token id -> entry.
    prompt_logprobs: Optional[list[Optional[dict[str, PromptLogprobEntry]]]] = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class StreamChoice(OpenAIModel):
    """A choice of a stream chunk. Chunks are written without their null fields, except these two:
    OpenAI's and vLLM's chunks carry `logprobs` and `finish_reason` in every choice, null until set,
    and clients test `finish_reason !== null` to see a choice end."""

    @model_serializer(mode="wrap")
    def _with_null_finish(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        data.setdefault("logprobs", None)
        data.setdefault("finish_reason", None)
        return data


class CompletionStreamChoice(StreamChoice):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# ---- chat --------------------------------------------------------------------------------------
class ChatContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ChatContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_content_only(cls, value: Any) -> Any:
        # Checked up front for one clear message instead of an error per union member.
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of content parts")
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"only text content parts ({{'type': 'text', 'text': ...}}) are supported, "
                                 f"got {kind!r}")
        return value

    def to_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text or "" for part in content)
        elif content is None:
            # An assistant turn that only called tools has no content; templates that concatenate
            # message['content'] need a string (vLLM renders it as "" too).
            content = ""
        message: dict[str, Any] = {"role": self.role, "content": content}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                message[key] = value
        return message


class ChatTemplateFields(RequestModel):
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    max_tokens: Optional[int] = Field(None, ge=1, description="deprecated by OpenAI: use max_completion_tokens")
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0)  # at most --max-logprobs (checked by the engine)
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    echo: bool = False
    # vLLM's: with --reasoning-parser, at most this many tokens of reasoning before </think> is forced.
    thinking_token_budget: Optional[int] = Field(None, ge=0)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    @property
    def effective_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_top_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


class ChatLogProb(OpenAIModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(OpenAIModel):
    content: Optional[list[ChatLogProbsContent]] = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(OpenAIModel):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class ChatResponseMessage(OpenAIModel):
    role: str
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    # With --reasoning-parser: the reply's reasoning, under both names vLLM has used for it.
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None

    @model_serializer(mode="wrap")
    def _without_absent_reasoning(self, handler: Any) -> Any:
        data = handler(self)
        if isinstance(data, dict) and data.get("reasoning_content") is None:
            data.pop("reasoning_content", None)
            data.pop("reasoning", None)
        return data


class ChatCompletionResponseChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIModel):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class ChatCompletionStreamChoice(StreamChoice):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# ---- models, tokenizer, server -----------------------------------------------------------------
class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tokenmill"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class LoadLoRAAdapterRequest(OpenAIModel):
    """vLLM's /v1/load_lora_adapter body; base_model_name (as in vLLM's --lora-modules JSON) picks the model on a
    server of several (default: the first)."""

    lora_name: str
    lora_path: str
    base_model_name: Optional[str] = None


class AdminUnloadModelRequest(OpenAIModel):
    """POST /admin/models/unload: the model to drain and stop; timeout: seconds its requests in flight may
    take (default: --shutdown-timeout), after which they end with 503; forget: false keeps the model known
    (a load by its name, or a request with --load-on-demand, brings it back), else requests for it are
    404s."""

    model: str
    timeout: Optional[float] = Field(default=None, ge=0)
    forget: bool = True


class UnloadLoRAAdapterRequest(OpenAIModel):
    """vLLM's /v1/unload_lora_adapter body (its lora_int_id, if sent, is not needed: names are unique)."""

    lora_name: str
    lora_int_id: Optional[int] = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeCompletionRequest(RequestModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    model: Optional[str] = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(RequestModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


class VersionResponse(OpenAIModel):
    version: str
