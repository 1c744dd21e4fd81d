"""--device (plumbing/distributed.py): what the machine has (torch.accelerator) decides what runs; faked here, as this machine has
no accelerator."""
import pytest
import torch

from plumbing import distributed as config


def test_device_cpu_only_machine_runs_auto_and_cpu_and_names_what_it_lacks():
    if config.accelerator() is not None:
        pytest.skip("this machine has an accelerator")
    assert config.device_type("auto") == "cpu" and config.device_type("cpu") == "cpu"
    assert config.backend_for(torch.device("cpu")) == "gloo"
    assert config.device_errors("cuda") == ["--device cuda: this machine has no accelerator (torch.accelerator found "
                                            "none); use --device cpu or auto"]
    assert config.device_errors("auto") == config.device_errors("cpu") == []


@pytest.mark.parametrize("found, auto, refused", [
    ("cuda", "cuda", {"xpu": "this machine's accelerator is cuda (torch.accelerator); use --device cuda, cpu or auto"}),
    ("xpu", "xpu", {"cuda": "this machine's accelerator is xpu"}),  # xccl
    # gloo only: auto runs on CPU
    ("mps", "cpu", {"mps": "torch's process group backend for mps is gloo, which moves CPU and CUDA tensors only"}),
    ("npu", "cpu", {"npu": "torch has no process group backend for npu"}),  # no plugin here: no hccl registered
])
def test_device_follows_the_accelerator_found(monkeypatch, found, auto, refused):
    monkeypatch.setattr(config, "accelerator", lambda: found)
    assert config.device_type("auto") == auto and config.device_type("cpu") == "cpu"
    if auto != "cpu":
        assert config.device_type(found) == found and config.device_errors(found) == []
    for choice, text in refused.items():
        [error] = config.device_errors(choice)
        assert error.startswith(f"--device {choice}: ") and text in error
