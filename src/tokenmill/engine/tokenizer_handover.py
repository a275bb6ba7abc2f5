"""The tokenizer as plain data: the engine core, which loads the model source, hands its tokenizer to
the API process in its ready message, so that process never loads the model (no torch import, no
GGUF tokenizer conversion: seconds of startup and hundreds of MiB of resident memory).

The core writes the tokenizer with `save_pretrained` (tokenizer.json, tokenizer_config.json with the
special tokens and added tokens, the chat template) and sends the files' contents; the frontend writes
them to a temporary directory and reads them back as a `PreTrainedTokenizerFast`. That class lives in
transformers' tokenizer modules, which import without torch (AutoTokenizer does not: it reads model
configs, whose module imports torch). A fast tokenizer carries its whole pipeline (normalizer,
pre-tokenizer, model, post-processor, decoder) in tokenizer.json, so the rebuilt one encodes, decodes
and renders chat templates as the model-specific class the core loaded does (tests/engine/
test_tokenizer_handover.py checks it). A tokenizer without tokenizer.json (a slow, Python-only one) is
rebuilt with AutoTokenizer, at the cost of the torch import.
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from tokenmill.model.tokenizer_cache import FAST_TOKENIZER_FILE, save_fast_tokenizer

logger = logging.getLogger("tokenmill")


def tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """The files that rebuild `tokenizer`, name -> content."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-tokenizer-") as directory:
        save_fast_tokenizer(tokenizer, directory)
        return {path.name: path.read_bytes() for path in sorted(Path(directory).iterdir()) if path.is_file()}


def tokenizer_from_files(files: dict[str, bytes]) -> Any:
    """The tokenizer that `tokenizer_files` described."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-tokenizer-") as directory:
        for name, content in files.items():
            (Path(directory) / Path(name).name).write_bytes(content)
        if FAST_TOKENIZER_FILE in files:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)
        logger.info("the model's tokenizer is not a fast one; the API process loads it with AutoTokenizer")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
