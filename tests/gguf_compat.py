"""HF transformers' GGUF loading with the metadata read fast: the reference models and tokenizers of the
parity tests come from transformers' own GGUF loader, which reads a file's header with gguf-py's
GGUFReader twice (config, then weights) at ~10 µs per array element: 17 s per read for Gemma 3's
262k-token vocabulary. `GGUFPartsReader` reads the same parts (one per array element, as gguf-py lays
them out and transformers indexes them) from one plain array per field, so the header costs a fraction of
a second; tests/model/test_gguf_reader.py checks its fields part for part against gguf-py's.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import gguf
import numpy as np
from gguf import GGUFValueType

from tokenmill.model.gguf_reader import FastGGUFReader


class GGUFPartsReader(FastGGUFReader):
    """tokenmill's fast reader, with every numeric array element in a part of its own (gguf-py's layout)."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        size, parts, data_indices, types = super()._get_field_parts(orig_offs, raw_type)
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or len(types) < 2 or types[1] == GGUFValueType.STRING \
                or types[1] == GGUFValueType.ARRAY or data_indices != [2]:
            return size, parts, data_indices, types
        values = parts[2].view(np.ndarray)  # slices of a plain array are cheaper than np.memmap's
        return size, parts[:2] + [values[i:i + 1] for i in range(len(values))], list(range(2, 2 + len(values))), types


@contextlib.contextmanager
def fast_gguf_headers() -> Iterator[None]:
    """Within: gguf.GGUFReader (which transformers imports when it loads a GGUF) is GGUFPartsReader."""
    original = gguf.GGUFReader
    gguf.GGUFReader = GGUFPartsReader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def hf_model_from_gguf(path, **kwargs: Any):
    from transformers import AutoModelForCausalLM

    with fast_gguf_headers():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)


def hf_tokenizer_from_gguf(path):
    from transformers import AutoTokenizer

    with fast_gguf_headers():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
