"""The offline API, shaped like vLLM's: LLM(...).generate(prompts, sampling_params)."""
from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from tokenmill.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import InvalidRequestError
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

PromptType = Union[str, dict[str, Any], list[int]]


class LLM:
    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        """kwargs: any EngineConfig field (dtype, max_model_len, num_kv_blocks, ...); an unknown name is
        refused with InvalidRequestError naming the closest valid one."""
        config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine(config)
        self._counter = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, message_roundtrip: bool = False) -> "LLM":
        """message_roundtrip: every message between frontend, engine core and runner is encoded and
        decoded as a process boundary would (tests)."""
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine(config, message_roundtrip=message_roundtrip)
        llm._counter = itertools.count()
        return llm

    def shutdown(self) -> None:
        """Stops the engine's tensor-parallel worker processes (nothing to stop otherwise)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Optional[list[int]] = None,
                 lora_request: LoRARequest | Sequence[LoRARequest] | None = None) -> list[RequestOutput]:
        """lora_request (vLLM's): the LoRA adapter of every prompt, or one per prompt (None: the base model);
        needs an engine started with enable_lora=True."""
        prompt_list = self._as_list(prompts)
        params_list = self._params_for(sampling_params, len(prompt_list))
        processor = self.llm_engine.input_processor
        processed = [processor.process_prompt(p) for p in prompt_list]  # all validated before any runs
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompt_list))
        if len(loras) != len(prompt_list):
            raise InvalidRequestError("lora_request must be one LoRARequest or one per prompt")
        return self._run([(p, sp) for p, sp in zip(processed, params_list)], use_tqdm, priority, loras)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: Optional[str] = None, add_generation_prompt: bool = True,
             lora_request: Optional[LoRARequest] = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        processor = self.llm_engine.input_processor
        processed = [processor.apply_chat_template(conv, add_generation_prompt, chat_template)
                     for conv in conversations]
        params_list = self._params_for(sampling_params, len(processed))
        return self._run(list(zip(processed, params_list)), use_tqdm, None, [lora_request] * len(processed))

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: one BeamSearchOutput per prompt, sequences best first.
        Beams share KV blocks and fork with copy-on-write (see tokenmill.beam_search)."""
        processor = self.llm_engine.input_processor
        processed = [processor.process_prompt(p) for p in self._as_list(prompts)]
        return run_beam_search(self.llm_engine, processed, params, use_tqdm)

    # ---- internals -----------------------------------------------------------------------
    @staticmethod
    def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)

    @staticmethod
    def _params_for(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise InvalidRequestError("sampling_params must be one SamplingParams or one per prompt")
        return list(sampling_params)

    def _run(self, items, use_tqdm: bool, priority: Optional[list[int]],
             loras: Optional[list[Optional[LoRARequest]]] = None) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, params) in enumerate(items):
                request_id = f"offline-{next(self._counter)}"
                # Only the final outputs are returned, so only they are assembled.
                params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                engine.add_request(request_id, prompt, params, priority=priority[i] if priority else 0,
                                   lora_request=loras[i] if loras else None)
                ids.append(request_id)
        except BaseException:
            engine.abort_request(ids)  # one refused prompt refuses the whole call
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2, leave=False)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]
