"""Turns user prompts into validated token ids: tokenization, chat templates, length checks.

Everything here runs before a request reaches the engine core, so bad input is refused before any
compute and never disturbs other requests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from tokenmill.engine.text_checks import check_text
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass(slots=True)
class ProcessedPrompt:
    prompt: Optional[str]
    prompt_token_ids: list[int]


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 max_prompt_tokens: Optional[int] = None, structured_backend: Any = None,
                 max_logprobs: int = MAX_LOGPROBS) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_prompt_tokens = max_prompt_tokens
        # --max-logprobs: the most logprobs (or prompt logprobs) per token a request may ask for, as in vLLM.
        self.max_logprobs = min(max_logprobs, vocab_size)
        # Compiles structured-output constraints to check them (the engine core compiles its own).
        self.structured_backend = structured_backend

    # ---- prompts -------------------------------------------------------------------------
    def process_prompt(self, prompt: Any, param: str = "prompt") -> ProcessedPrompt:
        """A string, a list of token ids, or a dict {"prompt": ...} / {"prompt_token_ids": [...]}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = self.check_token_ids(prompt["prompt_token_ids"], param)
                return ProcessedPrompt(prompt.get("prompt"), ids)
            if "prompt" in prompt:
                return self.process_prompt(prompt["prompt"], param)
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt must not be empty", param)
            return ProcessedPrompt(check_text(prompt, param), self.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            return ProcessedPrompt(None, self.check_token_ids(prompt, param))
        raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                  param)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_token_ids(self, ids: Sequence[Any], param: str = "prompt") -> list[int]:
        if len(ids) == 0:
            raise InvalidRequestError("the prompt must not be empty", param)
        out: list[int] = []
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int):
                raise InvalidRequestError("token ids must be integers", param)
            if not 0 <= token < self.vocab_size:
                raise InvalidRequestError(
                    f"token id {token} is outside the vocabulary (0..{self.vocab_size - 1})", param)
            out.append(token)
        return out

    # ---- chat ----------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None, tools: Optional[list] = None,
                            **template_kwargs: Any) -> ProcessedPrompt:
        """Renders the conversation. A template given with the request is checked first (not empty,
        parses); a template that raises, or renders nothing, is the caller's error: 400 naming
        `chat_template` when the request brought it, else `messages`."""
        if not messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        if chat_template is not None:
            check_chat_template(chat_template)
        elif not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; use the completions API", "messages")
        blame = "chat_template" if chat_template is not None else "messages"
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, tools=tools, **template_kwargs)
        except Exception as exc:  # jinja errors from malformed messages or templates are user errors
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", blame) from None
        if not isinstance(text, str) or not text:
            raise InvalidRequestError("the chat template rendered an empty prompt", blame, "empty_prompt")
        # The template already holds the BOS text where the model wants it.
        return ProcessedPrompt(check_text(text, blame), self.encode(text, add_special_tokens=False))

    # ---- validation ----------------------------------------------------------------------
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> SamplingParams:
        """Everything a request is checked for before it reaches the engine core (the one place):
        lengths, and a structured-output constraint that must compile. Returns the parameters to run
        with (max_tokens filled in)."""
        if len(prompt_token_ids) == 0:
            # The scheduler never schedules a request with nothing to compute: it would wait forever.
            raise InvalidRequestError("the prompt has no tokens", "prompt", "empty_prompt")
        params = self.validate_lengths(prompt_token_ids, params)
        self.check_logprobs(params.logprobs, "logprobs")
        self.check_logprobs(params.prompt_logprobs, "prompt_logprobs")
        if params.structured_outputs is not None and self.structured_backend is not None:
            self.structured_backend.validate(params.structured_outputs)
        return params

    def check_logprobs(self, value: Optional[int], param: str) -> None:
        """At most --max-logprobs logprobs per token; `param` names the request field that asked."""
        if value is not None and value > self.max_logprobs:
            raise InvalidRequestError(f"{param} asks for {value} logprobs per token, more than this server's "
                                      f"maximum of {self.max_logprobs} (--max-logprobs)", param)

    def validate_lengths(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> SamplingParams:
        """Refuse prompts that cannot fit; fill in max_tokens=None as 'up to max_model_len'."""
        num_prompt = len(prompt_token_ids)
        if self.max_prompt_tokens is not None and num_prompt > self.max_prompt_tokens:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens, more than the limit of {self.max_prompt_tokens}",
                "prompt", "prompt_too_long")
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, which leaves no room to generate", "prompt", "context_length_exceeded")
        if params.max_tokens is None:
            return params.clone(max_tokens=self.max_model_len - num_prompt)
        if num_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{num_prompt} tokens and max_tokens asks for {params.max_tokens} more",
                "max_tokens", "context_length_exceeded")
        return params


def check_chat_template(template: str) -> None:
    """A chat template given with a request must hold something and parse (jinja syntax)."""
    check_text(template, "chat_template")
    if not template.strip():
        raise InvalidRequestError("chat_template must not be empty", "chat_template")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as exc:
        raise InvalidRequestError(f"chat_template does not parse: {exc.message} (line {exc.lineno})",
                                  "chat_template") from None


def eos_token_ids(tokenizer: Any, hf_config: Any) -> list[int]:
    """Every id that ends generation like EOS (the tokenizer's and the model config's, deduplicated;
    e.g. Llama 3's <|eot_id|> besides <|end_of_text|>). The first is the model's primary EOS."""
    ids: list[int] = []
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(hf_config, "eos_token_id", None)):
        for token in source if isinstance(source, (list, tuple)) else [source]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return ids
