"""tokenmill: an LLM inference serving engine."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "LoRARequest", "RequestOutput", "CompletionOutput", "EngineConfig",
           "__version__"]


def __getattr__(name: str):
    # Lazy imports keep `import tokenmill` (and the CLI's --help) fast; torch loads only when needed.
    if name == "LLM":
        from tokenmill.entrypoints.llm import LLM
        return LLM
    if name == "SamplingParams":
        from tokenmill.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        import tokenmill.outputs as outputs
        return getattr(outputs, name)
    if name == "LoRARequest":
        from tokenmill.lora_request import LoRARequest
        return LoRARequest
    if name == "EngineConfig":
        from tokenmill.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
