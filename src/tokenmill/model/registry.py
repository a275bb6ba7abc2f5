"""Model classes keyed by the Hugging Face architecture name, so new families plug in here."""
from __future__ import annotations

from tokenmill.errors import ModelLoadError

_LLAMA = ("tokenmill.model.llama", "LlamaForCausalLM")

MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,  # the same layers, every one with the config's sliding window
    "Qwen2ForCausalLM": ("tokenmill.model.qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("tokenmill.model.qwen", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("tokenmill.model.qwen", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("tokenmill.model.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("tokenmill.model.gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("tokenmill.model.phi3", "Phi3ForCausalLM"),
}

# Every registered family attends through its sliding windows (layers.decoder.layer_windows), so a
# config's `sliding_window` does not cap the context for them.
SLIDING_WINDOW_ARCHITECTURES: frozenset[str] = frozenset(MODEL_REGISTRY)


def get_model_class(architecture: str):
    try:
        module_name, class_name = MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ModelLoadError(f"unsupported architecture {architecture!r} (supported: {supported})") from None
    import importlib

    return getattr(importlib.import_module(module_name), class_name)
