"""Chat templates tokenmill ships for models whose files carry none.

A GGUF converted from a base (pretrained) checkpoint, or from a repository whose tokenizer_config
lacked one, has no `tokenizer.chat_template`; without a template the server refuses chat requests.
The loader falls back to the family's own template here, keyed by HF architecture, so
`tokenmill serve --model gemma-3-270m-q4_k_m.gguf` chats in the format the model was trained on.
The templates are part of the package: loading a model never fetches anything.
"""
from __future__ import annotations

from typing import Any

# Gemma 3's template as its instruction-tuned checkpoints ship it (tokenizer_config.json /
# chat_template.jinja): <bos>, turns framed by <start_of_turn>{user|model}\n ... <end_of_turn>\n,
# "assistant" renamed "model", a system message folded into the first user turn followed by a blank
# line, text trimmed, images as <start_of_image>, roles made to alternate.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# HF architecture -> the template its checkpoints use.
KNOWN_CHAT_TEMPLATES: dict[str, str] = {
    "Gemma3ForCausalLM": GEMMA3_CHAT_TEMPLATE,
}


def known_chat_template(architecture: str) -> str | None:
    """The shipped template for `architecture`, or None when tokenmill knows none."""
    return KNOWN_CHAT_TEMPLATES.get(architecture)


def ensure_chat_template(tokenizer: Any, architecture: str) -> bool:
    """Gives `tokenizer` the family's known template when it has none; True when one was added.

    A template the model's files carry always wins."""
    if getattr(tokenizer, "chat_template", None):
        return False
    template = known_chat_template(architecture)
    if template is None:
        return False
    tokenizer.chat_template = template
    return True
