"""Tool calling for /v1/chat/completions: OpenAI's `tools` / `tool_choice`, with vLLM's behaviour.

- "none": the tools reach the chat template only; the reply is text.
- {"type": "function", "function": {"name": N}}: the reply is forced, through structured outputs, to a
  JSON object matching N's `parameters` schema, and comes back as one call of N.
- "required": the reply is forced to a JSON array of one or more `{"name", "parameters"}` objects (at
  most one with `parallel_tool_calls: false`); each becomes a tool call.
- "auto" (the default when tools are given): with `--enable-auto-tool-choice --tool-call-parser
  hermes` the model decides, and each `<tool_call>{"name": ..., "arguments": ...}</tool_call>` in its
  text becomes a tool call. Without a parser the reply is plain text. (vLLM answers 400 there;
  tokenmill keeps serving, because agent frameworks send their tools with every request.)

Forced calls finish with the generation's own reason ("stop", or "length" when cut short), as in
vLLM; calls the model chose with "auto" finish with "tool_calls".
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)
_HERMES_OPEN = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_TOOL_CHOICE_FORMS = "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_tool_call_id)


@dataclass
class ToolPlan:
    """What one request asks of tools: the mode, the forced function's name, and the output constraint."""

    mode: str = "none"  # "none" | "auto" | "named" | "required"
    name: Optional[str] = None
    constraint: Optional[StructuredOutputsParams] = None
    parser: Optional[str] = None  # "auto" only

    @property
    def buffers_output(self) -> bool:
        """Replies whose tool calls are known only once the text is complete (streamed at the end)."""
        return self.mode == "required" or (self.mode == "auto" and self.parser is not None)


def plan_tool_calls(tools: Optional[list[dict[str, Any]]], tool_choice: Any, parallel_tool_calls: Optional[bool],
                    parser: Optional[str]) -> ToolPlan:
    """Check `tools` and `tool_choice` (400 naming the field) and decide how the reply is produced."""
    functions = _functions(tools)
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(_TOOL_CHOICE_FORMS, "tool_choice")
        if tool_choice == "none":
            return ToolPlan()
        if not functions:
            raise InvalidRequestError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        if tool_choice == "auto":
            return ToolPlan(mode="auto", parser=parser)
        return ToolPlan(mode="required", constraint=StructuredOutputsParams(
            json=_required_schema(functions, parallel_tool_calls), param="tool_choice"))
    name = _named_choice(tool_choice)
    if not functions:
        raise InvalidRequestError("tool_choice names a function, but no tools were given", "tool_choice")
    if name not in functions:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools "
                                  f"({', '.join(functions)})", "tool_choice")
    return ToolPlan(mode="named", name=name,
                    constraint=StructuredOutputsParams(json=functions[name], param="tool_choice"))


def _functions(tools: Optional[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of each function tool."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                      "'parameters': {...}}}}}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}].function.name must be a non-empty string", "tools")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if name in functions:
            raise InvalidRequestError(f"tools name the function {name!r} twice", "tools")
        functions[name] = parameters
    return functions


def _named_choice(tool_choice: Any) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise InvalidRequestError(_TOOL_CHOICE_FORMS, "tool_choice")
    return name


def _required_schema(functions: dict[str, dict[str, Any]], parallel_tool_calls: Optional[bool]) -> dict[str, Any]:
    """A JSON array of calls, each one of the tools with its own parameters schema.

    A call object holds its name and parameters and nothing else (vLLM's schema leaves it open): keys
    beside them would be dropped by the parser anyway, and a small model otherwise spends its tokens
    on them. The tool's own parameters schema is used as given."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in functions.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


@dataclass
class ExtractedToolCalls:
    calls: list[ParsedToolCall]
    content: Optional[str]  # text outside the calls, None when there is none
    content_end: int = 0  # where the calls begin in the reply's text


def extract_tool_calls(plan: ToolPlan, text: str) -> Optional[ExtractedToolCalls]:
    """The calls in a finished reply, or None when it holds none (it is then returned as text)."""
    if plan.mode == "named":
        return ExtractedToolCalls([ParsedToolCall(plan.name or "", text)], None)
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return None  # cut short by max_tokens or a stop string: the text goes back as it is
        calls = [ParsedToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
                 for item in items if isinstance(item, dict) and isinstance(item.get("name"), str)] \
            if isinstance(items, list) else []
        return ExtractedToolCalls(calls, None) if calls else None
    if plan.mode == "auto" and plan.parser == "hermes":
        return _extract_hermes(text)
    return None


def _extract_hermes(text: str) -> Optional[ExtractedToolCalls]:
    start = text.find(_HERMES_OPEN)
    if start == -1:
        return None
    calls = []
    for block in _HERMES_BLOCK.findall(text[start:]):
        try:
            call = json.loads(block)
        except ValueError:
            return None  # a malformed call: the whole reply stays text, nothing is half-parsed
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(ParsedToolCall(call["name"], arguments if isinstance(arguments, str)
                                    else json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return None
    content = text[:start].strip()
    return ExtractedToolCalls(calls, content or None, start)


def streamable_text_len(plan: ToolPlan, text: str) -> int:
    """How much of an unfinished reply can be streamed as content now.

    Forced replies ("required") are all tool calls: nothing. With the hermes parser, the text before
    the first `<tool_call>`, holding back a tail that could be the start of that tag.
    """
    if plan.mode == "required":
        return 0
    if plan.mode == "auto" and plan.parser == "hermes":
        start = text.find(_HERMES_OPEN)
        if start != -1:
            return start
        for keep in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
            if _HERMES_OPEN.startswith(text[-keep:]):
                return len(text) - keep
    return len(text)
