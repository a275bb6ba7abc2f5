"""POST /v1/chat/completions: the model's chat template turns messages into one prompt with n samples."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from starlette.requests import Request
from starlette.responses import Response

from tokenmill.engine.input_processor import ProcessedPrompt
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbs,
    ChatLogProbsContent,
    ChatResponseMessage,
    ChatTemplateFields,
    CompletionTokensDetails,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
)
from tokenmill.entrypoints.openai.reasoning import (
    ReasoningParser,
    make_reasoning_parser,
    prompt_closed_reasoning,
    reasoning_token_count,
    think_tag_ids,
)
from tokenmill.entrypoints.openai.serving_base import (
    CLIENT_CLOSED_REQUEST,
    MIN_LOGPROB,
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
from tokenmill.entrypoints.openai.tool_calls import (
    ParsedToolCall,
    ToolPlan,
    extract_tool_calls,
    new_tool_call_id,
    plan_tool_calls,
    streamable_text_len,
)
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput

# Arguments the server itself passes to apply_chat_template; chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message", "chat_template",
    "tools", "documents", "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "return_assistant_tokens_mask",
})


def render_chat_prompt(processor: Any, fields: ChatTemplateFields) -> ProcessedPrompt:
    kwargs = {k: v for k, v in (fields.chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
    if fields.continue_final_message:
        if fields.add_generation_prompt:
            raise InvalidRequestError("continue_final_message needs add_generation_prompt set to false",
                                      "continue_final_message")
        if fields.messages[-1].role != "assistant":
            raise InvalidRequestError("continue_final_message needs a final assistant message", "messages")
        kwargs["continue_final_message"] = True
    messages = [m.to_template_dict() for m in fields.messages]
    return processor.apply_chat_template(messages, add_generation_prompt=fields.add_generation_prompt,
                                         chat_template=fields.chat_template, tools=fields.tools, **kwargs)


@dataclass
class _ChoiceState:
    """How much of one choice the client has already received."""

    text_len: int = 0
    num_tokens: int = 0
    # The reply so far, kept only while tool calls must be parsed out of it (auto tool choice).
    text: str = ""
    started: bool = False
    finished: bool = False
    tool_call_id: Optional[str] = None  # a forced (named) call, once its first delta went out
    reasoning: Optional[ReasoningParser] = None  # with --reasoning-parser: splits the stream
    reasoning_text: Optional[str] = None  # the reasoning streamed so far (None: none yet)
    token_ids: list[int] = field(default_factory=list)  # the reply's tokens, for the reasoning token count


class OpenAIServingChat(ServingBase):
    def __init__(self, engine: Any, model_name: str, tool_call_parser: Optional[str] = None,
                 models: Any = None, reasoning_parser: Optional[str] = None) -> None:
        super().__init__(engine, model_name, models)
        # Set with --enable-auto-tool-choice --tool-call-parser NAME: "auto" replies are parsed for calls.
        self.tool_call_parser = tool_call_parser
        # Set with --reasoning-parser NAME: replies are split into reasoning and content.
        self.reasoning_parser = reasoning_parser

    def _reasoning(self, reasons: bool) -> Optional[ReasoningParser]:
        """A parser for one reply, of a request `_with_reasoning` kept reasoning for (`reasons`)."""
        return make_reasoning_parser(self.reasoning_parser) if reasons and self.reasoning_parser else None

    def _with_reasoning(self, params: Any, prompt: ProcessedPrompt) -> tuple[Any, bool]:
        """(the request's sampling params, whether its replies are parsed for reasoning). A grammar (a
        response_format, a named or required tool call) starts after `</think>`, and a thinking_token_budget
        forces `</think>` once spent, as in vLLM, where the tokenizer has the tag as one token; where it does
        not, a grammar shapes the reply from its first token and the reply is not parsed. A prompt that
        closed the think block itself (Qwen3 with enable_thinking false) is answered without reasoning."""
        budget = params.thinking_token_budget
        if self.reasoning_parser is None:
            if budget is not None:
                raise InvalidRequestError("thinking_token_budget needs a server started with --reasoning-parser",
                                          "thinking_token_budget")
            return params, False
        tags = think_tag_ids(self.engine.tokenizer)
        if budget is not None and tags is None:
            raise InvalidRequestError("thinking_token_budget needs a tokenizer with </think> as one token",
                                      "thinking_token_budget")
        if prompt_closed_reasoning(prompt.prompt_token_ids, tags):
            return dataclasses.replace(params, thinking_token_budget=None), False
        if params.structured_outputs is None and budget is None:
            return params, True
        if tags is None:
            return params, False
        return dataclasses.replace(params, reasoning_end_token_id=tags[1]), True

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request) -> Response:
        lora = self.check_request(body.model)
        processor = self.engine.input_processor
        plan = plan_tool_calls(body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_call_parser)
        prompt = render_chat_prompt(processor, body)
        processor.check_logprobs(body.num_top_logprobs, "top_logprobs")
        params = body.sampling_params(max_tokens=body.effective_max_tokens, logprobs=body.num_top_logprobs,
                                      prompt_logprobs=None, vocab_size=processor.vocab_size)
        if plan.constraint is not None:
            if params.structured_outputs is not None:
                raise InvalidRequestError("tool_choice 'required' or a named function fixes the reply's format; "
                                          f"it cannot be combined with {params.structured_outputs.param}",
                                          "tool_choice")
            params = dataclasses.replace(params, structured_outputs=plan.constraint)
        if body.thinking_token_budget is not None:
            params = dataclasses.replace(params, thinking_token_budget=body.thinking_token_budget)
        params, reasons = self._with_reasoning(params, prompt)
        request_id = base_request_id(raw)
        response_id = f"chatcmpl-{request_id}"
        jobs = [GenerationJob(engine_request_id(response_id, 0), prompt, params)]
        group = GenerationGroup(self.engine, jobs, RequestLog(request_id, "/v1/chat/completions"), request=raw,
                                priority=body.priority, user=body.user, stream=body.stream, lora=lora)
        group.start()
        role = "assistant" if body.add_generation_prompt else body.messages[-1].role
        echo = self._echo_text(body, role)
        if body.stream:
            return await self._stream(body, group, response_id, role, echo, plan, reasons)
        if not await self.collect(group):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        outputs = group.final_outputs()
        choices = []
        reasoning_tokens = 0
        for comp in (outputs[0].outputs if outputs else []):
            logprobs = self._logprobs(comp, 0, body.num_top_logprobs) if body.logprobs else None
            parser = self._reasoning(reasons)
            split = parser.split(comp.text) if parser is not None else None
            text = split.content if split is not None else comp.text
            reasoning = split.reasoning if split is not None else None
            if split is not None:
                reasoning_tokens += reasoning_token_count(self.engine.tokenizer, list(comp.token_ids), reasoning)
            message = ChatResponseMessage(role=role, content=echo + text, reasoning_content=reasoning,
                                          reasoning=reasoning)
            finish_reason = comp.finish_reason
            extracted = extract_tool_calls(plan, text)
            if extracted is not None:
                message = ChatResponseMessage(role=role, content=extracted.content,
                                              tool_calls=[_tool_call(call) for call in extracted.calls],
                                              reasoning_content=reasoning, reasoning=reasoning)
                finish_reason = _tool_finish_reason(plan, finish_reason)
            choices.append(ChatCompletionResponseChoice(
                index=comp.index, message=message, logprobs=logprobs, finish_reason=finish_reason,
                stop_reason=comp.stop_reason))
        choices.sort(key=lambda c: c.index)
        usage = usage_of(outputs)
        if reasons:
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        response = ChatCompletionResponse(id=response_id, model=self.response_model(lora), choices=choices,
                                          usage=usage)
        # OpenAI leaves tool_calls out of replies that made none.
        exclude = None if any(c.message.tool_calls for c in choices) else \
            {"choices": {"__all__": {"message": {"tool_calls"}}}}
        return Response(response.model_dump_json(exclude=exclude), media_type="application/json")

    @staticmethod
    def _echo_text(body: ChatCompletionRequest, role: str) -> str:
        """With echo, the reply repeats the last message when it has the reply's role (vLLM's rule)."""
        last = body.messages[-1]
        if not body.echo or last.role != role or last.content is None:
            return ""
        content = last.to_template_dict()["content"]
        return content if isinstance(content, str) else ""

    async def _stream(self, body: ChatCompletionRequest, group: GenerationGroup, response_id: str, role: str,
                      echo: str, plan: ToolPlan, reasons: bool = False) -> Response:
        states: dict[int, _ChoiceState] = {}
        model = self.response_model(group.lora)

        def usage() -> UsageInfo:
            info = usage_of(group.final_outputs())
            if reasons:
                info.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=sum(
                    reasoning_token_count(self.engine.tokenizer, state.token_ids, state.reasoning_text)
                    for state in states.values()))
            return info

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            return sse(ChatCompletionStreamResponse(id=response_id, model=model, choices=[choice],
                                                   usage=usage() if body.continuous_usage else None))

        def render(batch: dict[int, RequestOutput]) -> Iterator[str]:
            out = batch.get(0)
            for comp in (out.outputs if out is not None else []):
                state = states.setdefault(comp.index, _ChoiceState(
                    reasoning=self._reasoning(reasons)))
                if state.finished:
                    continue
                prefix = ""
                if not state.started:  # OpenAI's first delta of a choice names the role
                    state.started = True
                    prefix = echo
                    yield chunk(ChatCompletionStreamChoice(index=comp.index, delta=DeltaMessage(role=role, content="")))
                choice = self._delta(body, state, comp, prefix, plan)
                if choice is not None:
                    yield chunk(choice)

        def tail() -> Iterator[str]:
            if body.include_usage:
                yield sse(ChatCompletionStreamResponse(id=response_id, model=model, choices=[], usage=usage()))

        return await self.stream(group, render, tail)

    def _delta(self, body: ChatCompletionRequest, state: _ChoiceState, comp: CompletionOutput,
               prefix: str, plan: ToolPlan) -> Optional[ChatCompletionStreamChoice]:
        # comp is a delta: its text, token ids and logprobs are the new ones only.
        new, finish = comp.text, comp.finish_reason
        reasoning = ""
        if state.reasoning is not None:  # the reasoning part leaves the text: tool calls are parsed from the rest
            state.token_ids.extend(comp.token_ids)
            reasoning, new = state.reasoning.feed(new, final=finish is not None)
            if reasoning or state.reasoning.in_reasoning:
                state.reasoning_text = (state.reasoning_text or "") + reasoning
        content: Optional[str] = prefix + new
        tool_calls: Optional[list[DeltaToolCall]] = None
        end = state.text_len + len(new)
        if plan.mode == "named":
            # The forced call streams as it is generated: its id and name first, then argument text.
            if new or state.tool_call_id is None:
                first = state.tool_call_id is None
                if first:
                    state.tool_call_id = new_tool_call_id()
                tool_calls = [DeltaToolCall(index=0, id=state.tool_call_id if first else None,
                                            type="function" if first else None,
                                            function=DeltaFunctionCall(name=plan.name if first else None,
                                                                       arguments=new))]
            content = None
            finish = _tool_finish_reason(plan, finish) if finish else None
        elif plan.buffers_output:
            # Calls are known once the reply is complete; text before them streams as content.
            state.text += new
            text = state.text
            end = len(text)
            extracted = extract_tool_calls(plan, text) if finish else None
            if extracted is not None:
                end = extracted.content_end
                tool_calls = [DeltaToolCall(index=i, id=call.id, type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=call.arguments))
                              for i, call in enumerate(extracted.calls)]
                finish = _tool_finish_reason(plan, finish)
            elif not finish:
                end = streamable_text_len(plan, text)
            content = prefix + text[state.text_len:end]
        num_new = len(comp.token_ids)
        if not (content or reasoning or tool_calls or finish or (body.logprobs and num_new > 0)):
            return None
        logprobs = self._logprobs(comp, 0, body.num_top_logprobs) if body.logprobs else None
        state.text_len = max(state.text_len, end)
        state.num_tokens += num_new
        state.finished = finish is not None
        delta = DeltaMessage(content=content if content or (tool_calls is None and not reasoning) else None,
                             tool_calls=tool_calls, reasoning_content=reasoning or None, reasoning=reasoning or None)
        return ChatCompletionStreamChoice(index=comp.index, delta=delta, logprobs=logprobs,
                                          finish_reason=finish, stop_reason=comp.stop_reason if finish else None)

    def _logprobs(self, comp: CompletionOutput, start: int, top_n: Optional[int]) -> ChatLogProbs:
        tokenizer = self.engine.tokenizer
        steps = comp.logprobs or []
        content = []
        for i in range(start, len(comp.token_ids)):
            token_id = comp.token_ids[i]
            step = steps[i] if i < len(steps) else {}
            sampled = step.get(token_id)
            content.append(ChatLogProbsContent(
                **_entry(token_text(tokenizer, token_id, sampled), sampled),
                top_logprobs=[ChatLogProb(**_entry(token_text(tokenizer, tid, lp), lp))
                              for tid, lp in _top(step, top_n or 0)]))
        return ChatLogProbs(content=content)


def _tool_call(call: ParsedToolCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _tool_finish_reason(plan: ToolPlan, finish_reason: Optional[str]) -> Optional[str]:
    """OpenAI's: calls made under "auto", and under "required" when the reply completed, finish with
    "tool_calls"; a named function's call keeps the generation's reason ("stop", or "length")."""
    if plan.mode == "auto" or (plan.mode == "required" and finish_reason == "stop"):
        return "tool_calls"
    return finish_reason


def _entry(text: str, logprob: Optional[Logprob]) -> dict[str, Any]:
    value = safe_logprob(logprob.logprob) if logprob is not None else MIN_LOGPROB
    return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8", errors="replace"))}


def _top(step: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
    """The top_n most likely tokens by rank; the sampled token appears only if it is among them."""
    if top_n <= 0:
        return []
    ranked = sorted(step.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))
    return [(tid, lp) for tid, lp in ranked if lp.rank is None or lp.rank <= top_n][:top_n]
