"""GGUF tokenizers converted once per file: transformers rebuilds a GGUF's tokenizer from its metadata on
every load (about 8 s for SmolLM2's 49k tokens and 20-30 s for Gemma 3's 262k on 2 cores), so the
converted tokenizer is saved with `save_pretrained` and read back from there (0.24 s and 2.7 s) when the
same file is opened again.

Key: the file's resolved path, size and modification time, and the transformers version (its
conversion may change between releases). Location: `$TOKENMILL_CACHE_ROOT/gguf-tokenizers`, by default
`$XDG_CACHE_HOME/tokenmill` or `~/.cache/tokenmill` (vLLM's VLLM_CACHE_ROOT works the same way);
`TOKENMILL_DISABLE_TOKENIZER_CACHE=1` turns it off. An entry is written to a temporary directory and
renamed into place, so concurrent engines never read half of one; a cache that cannot be written or
read is skipped with a debug log line, never an error.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger("tokenmill")

# Bump when what is stored, or how it is read back, changes.
_FORMAT = "1"
FAST_TOKENIZER_FILE = "tokenizer.json"


def save_fast_tokenizer(tokenizer: Any, directory: str | Path) -> None:
    """The files that rebuild a tokenizer (also what the engine core hands the API process)."""
    # legacy_format=False: tokenizer.json and its config only, not also the slow tokenizer's vocabulary files.
    tokenizer.save_pretrained(str(directory), legacy_format=False)


def cache_root() -> Path:
    root = os.environ.get("TOKENMILL_CACHE_ROOT")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tokenmill"


def enabled() -> bool:
    return not os.environ.get("TOKENMILL_DISABLE_TOKENIZER_CACHE")


def entry_dir(gguf_path: Path) -> Path:
    """Where the tokenizer converted from this file (as it is now) is kept."""
    import transformers

    resolved = gguf_path.resolve()
    stat = resolved.stat()
    identity = f"{_FORMAT}|{resolved}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:24]
    return cache_root() / "gguf-tokenizers" / f"{resolved.stem}-{key}"


def load(gguf_path: Path) -> Optional[Any]:
    """The cached tokenizer of this GGUF, or None (not cached yet, cache off or unreadable)."""
    if not enabled():
        return None
    try:
        directory = entry_dir(gguf_path)
        if not (directory / FAST_TOKENIZER_FILE).is_file():
            return None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # a damaged entry: convert again (and overwrite nothing)
        logger.debug("tokenizer cache: cannot read the entry for %s (%s)", gguf_path.name, exc)
        return None
    logger.debug("tokenizer of %s read from %s", gguf_path.name, directory)
    return tokenizer


def store(gguf_path: Path, tokenizer: Any) -> None:
    """Keep a fast tokenizer converted from this GGUF (a slow one has no tokenizer.json to keep)."""
    if not enabled() or not getattr(tokenizer, "is_fast", False):
        return
    staging = None
    try:
        directory = entry_dir(gguf_path)
        if directory.exists():
            return
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".staging-", dir=directory.parent)
        save_fast_tokenizer(tokenizer, staging)
        os.rename(staging, directory)  # atomic; fails if another engine stored it first, which is fine
        staging = None
    except Exception as exc:  # an unwritable cache, or a tokenizer save_pretrained cannot write
        logger.debug("tokenizer cache: cannot store the tokenizer of %s (%s)", gguf_path.name, exc)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
