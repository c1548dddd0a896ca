"""Choosing the device: ``auto``, ``cpu``, ``cuda``, ``cuda:N``; missing or malformed devices are clear errors."""

from __future__ import annotations

import pytest
import torch

from batchspec.devices import device_name, resolve_device


def test_auto_is_cuda_when_torch_sees_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("auto") == torch.device("cuda")


@pytest.mark.parametrize("spec", ["tpu", "gpu", "cuda:x", ""])
def test_malformed_devices_are_refused(spec):
    with pytest.raises(ValueError, match="expected auto, cpu, cuda or cuda:N"):
        resolve_device(spec)


def test_missing_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'cuda' was asked for, but this torch"):
        resolve_device("cuda")


def test_an_index_past_the_gpus_names_the_ones_there_are(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match=r"sees 1 CUDA device\(s\): cuda:0..0"):
        resolve_device("cuda:1")
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)


def test_cpu_passes_through():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert device_name("cpu") == "cpu"
