"""GET /v1/models and /v1/models/{id}: the one model this server serves."""
from __future__ import annotations

import time
from typing import Optional

from tokenmill.entrypoints.openai.protocol import ModelCard, ModelList
from tokenmill.errors import ModelNotFoundError


class OpenAIServingModels:
    def __init__(self, served_model_name: str, max_model_len: int, root: Optional[str] = None) -> None:
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.root = root or served_model_name
        self.created = int(time.time())  # fixed, so repeated listings agree

    def card(self) -> ModelCard:
        return ModelCard(id=self.served_model_name, created=self.created, root=self.root,
                         max_model_len=self.max_model_len)

    def list_models(self) -> ModelList:
        return ModelList(data=[self.card()])

    def get_model(self, model_id: str) -> ModelCard:
        if model_id != self.served_model_name:
            raise ModelNotFoundError(f"The model `{model_id}` does not exist.", "model", "model_not_found")
        return self.card()
