"""One model's names and LoRA adapters: its cards for GET /v1/models (vLLM's: an adapter's `root` is its path,
its `parent` the base model; aliases as cards of their own), the adapter a request's `model` names, and the
adapters vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove at run time. The server's
ModelPool holds one per loaded model."""
from __future__ import annotations

import itertools
import time
from typing import Callable, Optional

from tokenmill.entrypoints.openai.protocol import ModelCard
from tokenmill.errors import InvalidRequestError, ModelNotFoundError
from tokenmill.lora_request import LoRARequest


class OpenAIServingModels:
    def __init__(self, served_model_name: str, max_model_len: int, root: Optional[str] = None,
                 check_lora: Optional[Callable[[LoRARequest], None]] = None, aliases: tuple[str, ...] = ()) -> None:
        """check_lora: raises for an adapter the engine cannot serve (the frontend's check); None: the engine
        serves no adapters. aliases: other names of the model (vLLM's further --served-model-name values)."""
        self.served_model_name = served_model_name
        self.aliases = aliases
        self.max_model_len = max_model_len
        self.root = root or served_model_name
        self.created = int(time.time())  # fixed, so repeated listings agree
        self.check_lora = check_lora
        self.loras: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def card(self, name: Optional[str] = None) -> ModelCard:
        return ModelCard(id=name or self.served_model_name, created=self.created, root=self.root,
                         max_model_len=self.max_model_len)

    def _lora_card(self, lora: LoRARequest) -> ModelCard:
        return ModelCard(id=lora.lora_name, created=self.created, root=lora.lora_path,
                         parent=self.served_model_name, max_model_len=self.max_model_len)

    def cards(self) -> list[ModelCard]:
        """The model under each of its names, then its adapters."""
        return [*(self.card(name) for name in (self.served_model_name, *self.aliases)),
                *(self._lora_card(lora) for lora in self.loras.values())]

    def find_card(self, model_id: str) -> Optional[ModelCard]:
        if model_id in self.loras:
            return self._lora_card(self.loras[model_id])
        if model_id == self.served_model_name or model_id in self.aliases:
            return self.card(model_id)
        return None

    def resolve(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's `model` names (None: the base model); 404 for a name the server lacks."""
        if model in (None, "", self.served_model_name) or model in self.aliases:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise ModelNotFoundError(f"The model `{model}` does not exist.", "model", "model_not_found")
        return lora

    def load_lora(self, name: str, path: str) -> LoRARequest:
        """Adds an adapter under `name`, its files checked first (400 naming the problem)."""
        if self.check_lora is None:
            raise InvalidRequestError("LoRA adapters need a server started with --enable-lora", "lora_name")
        if not name or not path:
            raise InvalidRequestError("both lora_name and lora_path are required", "lora_name" if not name else
                                      "lora_path")
        if name == self.served_model_name or name in self.aliases or name in self.loras:
            raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        lora = LoRARequest(name, next(self._ids), path)
        self.check_lora(lora)
        self.loras[name] = lora
        return lora

    def unload_lora(self, name: str) -> None:
        """Removes an adapter: new requests for it are 404s; requests already running finish with it."""
        if self.loras.pop(name, None) is None:
            raise ModelNotFoundError(f"The lora adapter '{name}' cannot be found.", "lora_name", "model_not_found")
