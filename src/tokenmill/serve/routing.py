"""What the Ray Serve front deployment routes on: the prompt tokens of an OpenAI request body.

The front renders and tokenizes the prompt the way the engine replica will (the same chat template and
tokenizer, through the same `InputProcessor`), hashes its full blocks as the prefix cache does, and
the request router (`prefix_router`) sends it to the replica believed to hold the longest run of those
blocks. A body that does not parse, or an endpoint without a prompt, routes on load alone: the replica
then validates the request and answers any error itself, so routing never changes an answer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from tokenmill.engine.dp_router import prompt_block_hashes
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.entrypoints.openai.serving_chat import render_chat_prompt
from tokenmill.serve.http_bridge import HttpRequest

logger = logging.getLogger("tokenmill.serve")


@dataclass(slots=True)
class RoutedRequest:
    """An HTTP request on its way to an engine replica, with what the router places it by."""

    http: HttpRequest
    block_hashes: list[bytes] = field(default_factory=list)
    # The replicas' KV cache size in blocks: the router remembers no more than that per replica.
    capacity_blocks: Optional[int] = None
    num_prompt_tokens: int = 0  # 0 when unknown: routed as a short prompt


def prompt_token_ids(processor: InputProcessor, path: str, body: bytes) -> Optional[list[int]]:
    """The (first) prompt's token ids of a chat or completion request; None for anything else."""
    try:
        if path.endswith("/chat/completions"):
            return render_chat_prompt(processor, ChatCompletionRequest.model_validate_json(body)).prompt_token_ids
        if path.endswith("/completions"):
            # A batch of prompts is served by one replica; its first prompt places it.
            first = CompletionRequest.model_validate_json(body).prompts()[0]
            return processor.process_prompt(first).prompt_token_ids
    except Exception as exc:  # the replica gives the real answer for a bad body
        logger.debug("routing %s on load only: %s", path, exc)
    return None


def routed_request(http: HttpRequest, processor: InputProcessor, block_size: int, capacity_blocks: Optional[int],
                   max_body_bytes: Optional[int] = None) -> RoutedRequest:
    """`http` with the block hashes of its prompt (none for a body over the server's size limit, which
    the replica refuses without the front tokenizing it first)."""
    hashes: list[bytes] = []
    ids: Optional[list[int]] = None
    if http.method.upper() == "POST" and (max_body_bytes is None or len(http.body) <= max_body_bytes):
        ids = prompt_token_ids(processor, http.path, http.body)
        if ids:
            hashes = prompt_block_hashes(ids, block_size)
    return RoutedRequest(http, hashes, capacity_blocks, len(ids or ()))
