"""tokenmill's GGUF reader (gguf-py's, with metadata arrays parsed in bulk) reads every field, value
and tensor exactly as gguf-py's own reader does."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from gguf_compat import GGUFPartsReader
from model_factory import finish_gguf
from tokenmill.errors import ModelLoadError
from tokenmill.model.gguf_loader import open_gguf
from tokenmill.model.gguf_reader import FastGGUFReader


def assert_same_reading(path, reference=None) -> None:
    reference, fast = reference or gguf.GGUFReader(path), FastGGUFReader(path)
    assert list(fast.fields) == list(reference.fields)
    for name, expected in reference.fields.items():
        field = fast.fields[name]
        assert field.contents() == expected.contents(), name
        assert field.types == expected.types, name
        assert field.offset == expected.offset, name
    assert fast.data_offset == reference.data_offset
    assert len(fast.tensors) == len(reference.tensors)
    for tensor, expected in zip(fast.tensors, reference.tensors):
        assert (tensor.name, tensor.tensor_type, tensor.data_offset) == (expected.name, expected.tensor_type,
                                                                         expected.data_offset)
        assert np.array_equal(tensor.data, expected.data)


@pytest.fixture
def assorted_gguf(tmp_path):
    path = tmp_path / "assorted.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.uint32", 7)
    writer.add_float32("test.float32", 1e-5)
    writer.add_bool("test.bool", True)
    writer.add_string("test.string", "héllo ✓")
    writer.add_array("test.ints", [3, -1, 2**30])
    writer.add_array("test.floats", [0.5, -2.25, 3.0])
    writer.add_array("test.strings", ["", "a", "ü✓ long " * 20, "<|im_start|>"])
    writer.add_array("test.one_string", ["only"])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_tensor("blk.0.attn_q.weight", np.arange(64, dtype=np.float32).reshape(4, 16))
    writer.add_tensor("token_embd.weight", np.ones((2, 32), dtype=np.float16))
    finish_gguf(writer)
    return path


def test_every_kind_of_field_reads_as_gguf_py_reads_it(assorted_gguf):
    assert_same_reading(assorted_gguf)
    fast = FastGGUFReader(assorted_gguf)
    assert fast.fields["test.strings"].contents() == ["", "a", "ü✓ long " * 20, "<|im_start|>"]
    assert fast.fields["test.ints"].contents() == [3, -1, 2**30]


def assert_same_parts(path, reference=None) -> None:
    """The tests' reader for transformers (gguf_compat.py) lays out every field as gguf-py does, part for part."""
    reference, compat = reference or gguf.GGUFReader(path), GGUFPartsReader(path)
    assert list(compat.fields) == list(reference.fields)
    for name, expected in reference.fields.items():
        field = compat.fields[name]
        assert field.data == expected.data and field.types == expected.types, name
        assert len(field.parts) == len(expected.parts), name
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(field.parts, expected.parts)), name


def test_the_embedded_model_reads_as_gguf_py_reads_it(smollm2_path):
    reference = gguf.GGUFReader(smollm2_path)  # gguf-py's own reader takes seconds over the vocabulary
    assert_same_reading(smollm2_path, reference)
    assert_same_parts(smollm2_path, reference)


def test_the_tests_reader_for_transformers_keeps_gguf_py_parts(assorted_gguf):
    assert_same_parts(assorted_gguf)


def test_a_truncated_file_is_a_load_error(assorted_gguf, tmp_path):
    data = assorted_gguf.read_bytes()
    cut = data.index(b"<|im_start|>") + 4  # inside the string array
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:cut])
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        open_gguf(truncated)
