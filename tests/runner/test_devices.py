"""The device the engine runs on (runner/devices.py): an explicit CUDA device torch cannot use is refused with
its cause before anything loads; the default falls back to the CPU, saying why where an NVIDIA driver is
loaded; the choice is reported with the numerics (/stats)."""
from __future__ import annotations

import pytest
import torch

from tokenmill.errors import ModelLoadError
from tokenmill.runner import devices


def test_an_explicit_cpu_is_taken_as_given():
    assert devices.choose_device("cpu") == (torch.device("cpu"), "--device")


def test_a_cpu_only_torch_refuses_cuda_naming_the_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    with pytest.raises(ModelLoadError, match=r"--device cuda: this torch build .* has no CUDA support"):
        devices.choose_device("cuda")


def test_a_driver_torch_cannot_use_is_named(monkeypatch, tmp_path):
    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.82.01\n")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices, "NVIDIA_DRIVER_VERSION", driver)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ModelLoadError, match=r"cannot use the loaded NVIDIA driver \(NVRM version.*470\.82"):
        devices.choose_device("cuda:0")
    device, reason = devices.choose_device(None)  # the default: the CPU, saying why
    assert device.type == "cpu" and "NVIDIA driver is loaded" in reason and "470.82" in reason
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ModelLoadError, match="CUDA_VISIBLE_DEVICES='' hides every device"):
        devices.choose_device("cuda")


def test_no_driver_no_device(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices, "NVIDIA_DRIVER_VERSION", tmp_path / "absent")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.choose_device(None) == (torch.device("cpu"), "default: no CUDA device")
    with pytest.raises(ModelLoadError, match="no NVIDIA driver is loaded"):
        devices.choose_device("cuda")


def test_the_choice_and_its_reason_reach_the_frontend(tiny_llama_dir):
    from tokenmill import LLM

    llm = LLM(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=16, max_model_len=64)
    ready = llm.llm_engine.core.ready
    assert (ready.device, ready.device_reason) == ("cpu", "--device")
