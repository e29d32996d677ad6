"""Which devices the matrix runs on: the CUDA path is exercised on any machine by
patching ``torch.cuda.is_available`` (no kernel runs; only the choice is tested)."""

import pytest
import torch

from parity_tests.matrix import harness, run


@pytest.mark.parametrize("cuda, expected", [(True, ["cpu", "cuda"]), (False, ["cpu"])])
def test_available_devices_follows_cuda(cuda, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert harness.available_devices() == expected


def test_device_all_includes_cuda_when_it_is_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert run._devices("all") == ["cpu", "cuda"]                # --device all
    cases = harness.build_cases(devices=harness.available_devices())
    assert {c.device for c in cases} == {"cpu", "cuda"}
