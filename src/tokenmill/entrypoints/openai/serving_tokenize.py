"""POST /tokenize and /detokenize (vLLM's extras): the model's tokenizer and chat template, no compute."""
from __future__ import annotations

from tokenmill.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from tokenmill.entrypoints.openai.serving_base import ServingBase
from tokenmill.entrypoints.openai.serving_chat import render_chat_prompt
from tokenmill.errors import InvalidRequestError


class OpenAIServingTokenization(ServingBase):
    def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_request(body.model)
        processor = self.engine.input_processor
        if isinstance(body, TokenizeChatRequest):
            prompt = render_chat_prompt(processor, body)
            # The template already holds the special tokens it wants, hence add_special_tokens=False by default.
            ids = processor.encode(prompt.prompt or "", add_special_tokens=body.add_special_tokens)
        else:
            ids = processor.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        token_strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids,
                                token_strs=token_strs)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_request(body.model)
        vocab_size = self.engine.input_processor.vocab_size
        if any(not 0 <= t < vocab_size for t in body.tokens):
            raise InvalidRequestError(f"tokens must be token ids in 0..{vocab_size - 1}", "tokens")
        return DetokenizeResponse(prompt=self.engine.tokenizer.decode(body.tokens))
