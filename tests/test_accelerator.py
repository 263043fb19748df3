"""accelerator: backend -> device of its collectives (cuda / npu / cpu)."""

import subprocess
import sys
import textwrap

import pytest
import torch

from mindspeed_ha.accelerator import collective_device, device_for_backend


@pytest.mark.parametrize("backend", ["gloo", "GLOO", "mpi", "ucc", "fake", ""])
def test_cpu_backends(backend):
    assert device_for_backend(backend) == torch.device("cpu")


def test_nccl_is_the_current_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert device_for_backend("nccl") == torch.device("cuda", 3)
    assert device_for_backend("NCCL") == torch.device("cuda", 3)


def test_multi_backend_group_prefers_the_accelerator(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert device_for_backend("cpu:gloo,cuda:nccl") == torch.device("cuda", 1)
    assert device_for_backend("cpu:gloo") == torch.device("cpu")


def test_hccl_without_torch_npu_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    with pytest.raises(RuntimeError, match="torch_npu"):
        device_for_backend("hccl")


def test_hccl_is_the_current_npu_device():
    """What torch_npu does on import (register ``npu`` as torch's PrivateUse1 device and
    add ``torch.npu``), in a child process: the rename is process-wide and irreversible."""
    code = textwrap.dedent("""
        import sys, types
        import torch
        from mindspeed_ha.accelerator import device_for_backend
        torch.utils.rename_privateuse1_backend("npu")
        torch.npu = types.SimpleNamespace(current_device=lambda: 5)
        sys.modules["torch_npu"] = types.ModuleType("torch_npu")
        print(device_for_backend("hccl"), device_for_backend("cpu:gloo,npu:hccl"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["npu:5", "npu:5"]


def test_collective_device_follows_the_default_group(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert collective_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert collective_device() == torch.device("cuda", 0)
