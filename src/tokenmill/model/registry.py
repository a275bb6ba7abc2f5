"""Model classes keyed by the Hugging Face architecture name, so new families plug in here."""
from __future__ import annotations

from tokenmill.errors import ModelLoadError

_LLAMA = ("tokenmill.model.llama", "LlamaForCausalLM")

MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,  # same layers; sliding window is refused by the loader check
}


def get_model_class(architecture: str):
    try:
        module_name, class_name = MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ModelLoadError(f"unsupported architecture {architecture!r} (supported: {supported})") from None
    import importlib

    return getattr(importlib.import_module(module_name), class_name)


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)
