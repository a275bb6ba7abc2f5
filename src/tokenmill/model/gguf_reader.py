"""gguf-py's GGUFReader with the metadata arrays parsed in bulk.

gguf-py builds one numpy view per array element while it walks the header, so a file's vocabulary
(tokenizer.ggml.tokens, .scores, .token_type, .merges: one entry per token) costs ~10 µs per element:
2.3-2.4 s for SmolLM2's 49k-token vocabulary, 10.8 s for Gemma 3's 262k, on every load. Here an array of
numbers is one view of the whole array, and an array of strings is walked with `struct` over the
mapped bytes (the views per string stay, as `ReaderField.contents()` needs them), which brings those
loads to a fraction of a second. Fields, tensors and `contents()` come out as gguf-py's do; the one
difference is that a numeric array's values sit in one part, not one part per element, so index them
through `contents()` (which returns the same list), not through `parts`.
"""
from __future__ import annotations

import struct
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType


class FastGGUFReader(gguf.GGUFReader):
    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[GGUFValueType]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        offs = orig_offs
        raw_item_type = self._get(offs, np.uint32)
        offs += int(raw_item_type.nbytes)
        length = self._get(offs, np.uint64)
        offs += int(length.nbytes)
        item_type, count = GGUFValueType(int(raw_item_type[0])), int(length[0])
        parts: list[Any] = [raw_item_type, length]
        types = [GGUFValueType.ARRAY] + ([item_type] if count else [])
        scalar = self.gguf_scalar_to_np.get(item_type)
        if scalar is not None:
            if count:
                values = self._get(offs, scalar, count)
                parts.append(values)
                offs += int(values.nbytes)
            return offs - orig_offs, parts, [2] if count else [], types
        if item_type != GGUFValueType.STRING:  # nested arrays: rare, small, left to gguf-py
            return super()._get_field_parts(orig_offs, raw_type)
        data = self.data.view(np.ndarray)  # slices of a plain array are cheaper than np.memmap's
        unpack_length = struct.Struct("=Q").unpack_from  # byte_order "I": the host's order
        data_indices = []
        for _ in range(count):
            (string_length,) = unpack_length(data, offs)
            parts.append(data[offs:offs + 8].view(np.uint64))
            data_indices.append(len(parts))
            parts.append(data[offs + 8:offs + 8 + string_length])
            offs += 8 + string_length
        if offs > len(data):
            raise ValueError("a string array runs past the end of the file")
        return offs - orig_offs, parts, data_indices, types
