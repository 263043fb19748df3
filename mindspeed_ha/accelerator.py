"""The one place that maps a communication backend to the device its tensors live on.

A collective on a process group needs its tensors on the group's device: NCCL works on
CUDA tensors, HCCL (Ascend, through ``torch_npu``) on NPU tensors, gloo on CPU tensors.
Every piece of code that allocates a tensor for a collective asks here instead of
writing ``"cuda" if backend == "nccl" else "cpu"`` (which is wrong for HCCL). Also the
device's own answer on a memory error (:func:`check_npu_uce`).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["device_for_backend", "collective_device", "check_npu_uce"]

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


def check_npu_uce(exc: BaseException, device_id: Optional[int] = None) -> Optional[int]:
    """Ask torch_npu whether the device has a UCE (``torch_npu.npu.check_uce_in_memory``),
    when torch_npu imports and an NPU is present, and record the answer on ``exc`` for
    :func:`mindspeed_ha.faults.classify`: 2 or 3 (torch_npu's temporary or resident memory) make the fault a
    UCE whatever its text; 1 (memory torch_npu does not manage: a repair from a replica
    cannot cover it) makes it UNKNOWN (the dying checkpoint); 0 leaves the text rules.

    The API needs the caching allocator (``PYTORCH_NO_NPU_MEMORY_CACHING`` unset; the
    reference's requirement too) and is marked beta / reserved in the torch_npu docs.

    Args:
        exc: the exception caught around the step.
        device_id: the NPU (default: torch_npu's current device).

    Returns:
        The answer (0-3), or None when torch_npu is absent, no NPU is available, the API is
        missing or it raised (the text rules then decide alone).
    """
    from mindspeed_ha import faults

    try:
        import torch_npu  # noqa: F401  (optional extra)
    except Exception:  # not installed, or a broken install: the text rules decide
        return None
    try:
        npu = torch_npu.npu
        if not npu.is_available() or not hasattr(npu, "check_uce_in_memory"):
            return None
        found = int(npu.check_uce_in_memory(npu.current_device() if device_id is None else device_id))
    except Exception:  # the check itself failed (e.g. caching disabled): no answer
        return None
    try:
        setattr(exc, faults.UCE_IN_MEMORY, found)
    except AttributeError:
        pass
    return found
