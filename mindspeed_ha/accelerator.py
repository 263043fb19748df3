"""The one place that maps a communication backend to the device its tensors live on.

A collective on a process group needs its tensors on the group's device: NCCL works on
CUDA tensors, HCCL (Ascend, through ``torch_npu``) on NPU tensors, gloo on CPU tensors.
Every piece of code that allocates a tensor for a collective asks here instead of
writing ``"cuda" if backend == "nccl" else "cpu"`` (which is wrong for HCCL).
"""

from __future__ import annotations

import torch

#: preference when a group has several backends (``"cpu:gloo,cuda:nccl"``): the accelerator's
_ORDER = ("nccl", "hccl")


def _backend_names(backend: str) -> list:
    """``"nccl"`` -> ``["nccl"]``; ``"cpu:gloo,cuda:nccl"`` -> ``["gloo", "nccl"]`` (lower case)."""
    names = []
    for part in str(backend).lower().split(","):
        name = part.rpartition(":")[2].strip()
        if name:
            names.append(name)
    return names


def _npu_device() -> torch.device:
    """The current Ascend NPU; ``torch_npu`` registers the ``npu`` device type with torch."""
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("backend 'hccl' needs torch_npu (pip install mindspeed-ha[npu])") from exc
    return torch.device("npu", torch.npu.current_device())


def device_for_backend(backend: str) -> torch.device:
    """The device a collective of ``backend`` works on.

    Args:
        backend: a ``torch.distributed`` backend name (``"nccl"``, ``"hccl"``, ``"gloo"``,
            ...), any case, or a multi-backend string such as ``"cpu:gloo,cuda:nccl"``
            (then the accelerator wins).

    Returns:
        ``cuda:<current device>`` for nccl, ``npu:<current device>`` for hccl, ``cpu``
        for gloo and anything else.

    Raises:
        RuntimeError: ``hccl`` without ``torch_npu`` installed.
    """
    names = _backend_names(backend)
    for name in _ORDER:
        if name in names:
            if name == "nccl":
                return torch.device("cuda", torch.cuda.current_device())
            return _npu_device()
    return torch.device("cpu")


def collective_device(group=None) -> torch.device:
    """The device for tensors of a collective on ``group`` (default: the default process group)."""
    import torch.distributed as dist

    return device_for_backend(dist.get_backend(group))


__all__ = ["device_for_backend", "collective_device"]
