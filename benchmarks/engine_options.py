"""Engine options of the tooling's command lines: only what the user gave goes to the engine.

The tools never restate an engine default (max_num_batched_tokens, max_num_seqs, block size ...):
an option left unset is left out, so EngineConfig decides (e.g. 1024 tokens a step on CPU, 2048 on
GPU), and the reports record the values the engine actually ran with.
"""
from __future__ import annotations

from typing import Any

# Reported in every tool's settings, read back from the engine after it resolved its defaults.
REPORTED = ("max_num_seqs", "max_num_batched_tokens", "max_mixed_prefill_tokens", "block_size", "enable_prefix_caching")


def given(**options: Any) -> dict[str, Any]:
    """The options that were set (not None)."""
    return {name: value for name, value in options.items() if value is not None}


def effective(llm: Any, names: tuple[str, ...] = REPORTED) -> dict[str, Any]:
    """The engine's resolved values of `names` (None where the engine does not expose one)."""
    engine = getattr(llm, "llm_engine", None)
    # The in-process core holds the config with its device defaults resolved.
    config = getattr(getattr(getattr(engine, "core", None), "core", None), "config", None)
    return {name: getattr(config, name, None) for name in names}
