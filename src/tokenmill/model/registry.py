"""Model classes keyed by the Hugging Face architecture name, so new families plug in here."""
from __future__ import annotations

from tokenmill.errors import ModelLoadError

_LLAMA = ("tokenmill.model.llama", "LlamaForCausalLM")

MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,  # the same layers, every one with the config's sliding window
    "MixtralForCausalLM": ("tokenmill.model.llama", "MixtralForCausalLM"),
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


# Checkpoint tensor names that differ from the layout the models load (transformers renames them on load
# the same way): (pattern, replacement) applied in order to each name as it is read.
CHECKPOINT_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    # Mixtral's checkpoints name its MoE block and experts' matrices as Mistral AI released them.
    "MixtralForCausalLM": ((r"\.block_sparse_moe\.", ".mlp."), (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
                           (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
                           (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj.")),
}


def get_model_class(architecture: str):
    try:
        module_name, class_name = MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ModelLoadError(f"unsupported architecture {architecture!r} (supported: {supported})") from None
    import importlib

    return getattr(importlib.import_module(module_name), class_name)
