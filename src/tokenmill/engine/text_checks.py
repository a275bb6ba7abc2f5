"""The one check every user-supplied string passes before it is tokenized, templated or logged.

JSON may escape a lone UTF-16 surrogate (`"\\ud800"`); Python decodes it into a `str` that no UTF-8
encoder (tokenizers, the request log, the JSON response) accepts, so it must be refused up front
with a 400 that names the field. Control characters are fine in free text (prompts, message content,
templates: `\\n` and `\\t` are ordinary there, and a tokenizer handles the rest), but identifiers
(model and tenant names, tool call ids) and stop strings may not hold NUL; identifiers may not hold
any C0 control character or DEL either (they end up in logs and metric labels).

Used by the HTTP request models (`entrypoints/openai/protocol.py`, for every string in a request
body, dict keys included) and by `InputProcessor` (prompts and chat templates of the offline `LLM`).
"""
from __future__ import annotations

import re
from typing import Any, Iterator, Optional

from tokenmill.errors import InvalidRequestError

_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x1f\x7f]")
# Field names whose values are identifiers, not text.
IDENTIFIER_FIELDS = frozenset({"model", "user", "name", "tool_call_id", "id", "role", "type"})
# Fields whose strings may hold any character but NUL.
NO_NUL_FIELDS = frozenset({"stop"})


def text_problem(value: str, field: Optional[str] = None) -> Optional[str]:
    """Why `value` cannot be accepted for `field` (its last name in the request), or None."""
    if _SURROGATE.search(value):
        return "contains a lone UTF-16 surrogate, which is not valid Unicode text"
    if field in IDENTIFIER_FIELDS and _CONTROL.search(value):
        return "must not contain control characters"
    if field in NO_NUL_FIELDS and "\x00" in value:
        return "must not contain NUL characters"
    return None


def check_text(value: str, param: str, field: Optional[str] = None) -> str:
    """Returns `value`, or raises InvalidRequestError naming `param`."""
    problem = text_problem(value, field if field is not None else param)
    if problem is not None:
        raise InvalidRequestError(f"'{param}' {problem}", param, "invalid_text")
    return value


def find_bad_text(value: Any, path: str = "", field: Optional[str] = None) -> Optional[tuple[str, str]]:
    """The first string in a JSON value (dict keys included) that text_problem refuses, as
    (param path such as "messages[0].content", problem), or None."""
    for where, name, text in _strings(value, path, field):
        problem = text_problem(text, name)
        if problem is not None:
            return where or "body", problem
    return None


def _strings(value: Any, path: str, field: Optional[str]) -> Iterator[tuple[str, Optional[str], str]]:
    if isinstance(value, str):
        yield path, field, value
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                yield path, None, key
                sub = f"{path}.{key}" if path else key
                yield from _strings(item, sub, key)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _strings(item, f"{path}[{i}]", field)
