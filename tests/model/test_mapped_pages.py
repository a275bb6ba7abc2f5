"""A checkpoint's mapped pages leave the resident set once read (model/mapped_pages.py), and what is read
afterwards is still the file's bytes."""
from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from tokenmill.model.mapped_pages import file_mappings, release_mapped_pages


def _resident_file_kib() -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith("RssFile")).split()[1])


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="madvise and /proc are Linux's")
def test_released_pages_leave_the_resident_set_and_read_back_from_the_file(tmp_path):
    path = tmp_path / "weights.bin"
    values = np.random.default_rng(0).integers(0, 255, size=64 << 20, dtype=np.uint8)  # 64 MiB
    values.tofile(path)
    data = np.memmap(path, mode="r")
    start, end = file_mappings(str(path))[0]
    assert start <= data.ctypes.data and data.ctypes.data + data.nbytes <= end
    before = _resident_file_kib()
    assert int(data.sum(dtype=np.uint64)) == int(values.sum(dtype=np.uint64))  # every page read in
    read_in = _resident_file_kib()
    assert read_in - before > 48 << 10
    release_mapped_pages(data.ctypes.data, data.nbytes)
    assert _resident_file_kib() < read_in - (48 << 10)
    assert np.array_equal(data, values)  # read back from the page cache


def test_file_mappings_name_only_the_file(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"\0" * mmap.PAGESIZE * 4)
    assert file_mappings(str(path)) == []
    data = np.memmap(path, mode="r")
    assert len(file_mappings(str(path))) == 1 and file_mappings(str(tmp_path / "b.bin")) == []
    del data


def test_safetensors_come_as_stored_or_converted_with_the_same_values(tmp_path):
    from safetensors.torch import save_file

    from tokenmill.model.loader import _iter_safetensors

    tensors = {"model.a.weight": torch.randn(64, 4096).to(torch.bfloat16), "model.b.weight": torch.randn(4096)}
    save_file(tensors, tmp_path / "model.safetensors")
    stored = {name: tensor.clone() for name, tensor in _iter_safetensors(tmp_path, None)}
    converted = dict(_iter_safetensors(tmp_path, torch.float32))
    for name, tensor in tensors.items():
        assert stored[name].dtype == tensor.dtype and torch.equal(stored[name], tensor)
        assert converted[name].dtype == torch.float32 and torch.equal(converted[name], tensor.float())
