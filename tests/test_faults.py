"""Fault classification over exception chains, with real gloo error texts."""

import ast
import pathlib

import pytest

from mindspeed_ha import faults
from mindspeed_ha.faults import FaultKind, classify

# Real texts, produced with torch 2.13.0+cpu, gloo backend, 2 ranks on 127.0.0.1:
# rank 1 os._exit(1) after the first all_reduce -> rank 0's next all_reduce raised:
GLOO_PEER_DIED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                  "peer [127.0.0.1]:1449. This is typically caused by a remote worker crashing. Check the logs of "
                  "the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f")
# rank 1 sleeps past the 3 s process-group timeout -> rank 0 raised:
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                "waiting 3000ms for recv operation to complete")


class DistBackendError(RuntimeError):
    """Stand-in named like torch.distributed.DistBackendError (matched by class name)."""


class DistNetworkError(RuntimeError):
    pass


TABLE = [
    (RuntimeError(GLOO_PEER_DIED), FaultKind.PROCESS),
    (RuntimeError(GLOO_TIMEOUT), FaultKind.NETWORK),
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:4321: Connection reset by peer"),
     FaultKind.NETWORK),
    (RuntimeError("CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors might be asynchronously"),
     FaultKind.UCE),
    (RuntimeError("NPU function error: UCE ERROR, error code is 507053"), FaultKind.UCE),
    (RuntimeError("device memory error"), FaultKind.UCE),
    (DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network "
                      "error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error"),
     FaultKind.NETWORK),
    (RuntimeError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)"),
     FaultKind.NETWORK),
    (RuntimeError("HCCL function error: hcclAllReduce, error code is 7"), FaultKind.NETWORK),
    (DistNetworkError("failed to connect"), FaultKind.NETWORK),
    (ConnectionResetError(104, "reset"), FaultKind.NETWORK),
    (TimeoutError("store get"), FaultKind.NETWORK),
    (RuntimeError("ProcessGroupGloo: peer process 3 terminated"), FaultKind.PROCESS),
    (faults.ProcessFailure("rank 2 is gone"), FaultKind.PROCESS),
    (faults.DeviceMemoryError("injected"), FaultKind.UCE),
    (faults.CommunicationError("injected"), FaultKind.NETWORK),
    (ValueError("shape mismatch (4, 8) vs (8, 4)"), FaultKind.UNKNOWN),
    (KeyError("loss"), FaultKind.UNKNOWN),
]


@pytest.mark.parametrize("exc,kind", TABLE, ids=[f"{type(e).__name__}-{k.value}-{i}" for i, (e, k) in enumerate(TABLE)])
def test_classification_table(exc, kind):
    assert classify(exc) is kind


def test_chain_uce_beats_network():
    try:
        try:
            raise RuntimeError("CUDA error: uncorrectable ECC error encountered")
        except RuntimeError as inner:
            raise faults.CommunicationError("all-reduce failed") from inner
    except faults.CommunicationError as exc:
        assert classify(exc) is FaultKind.UCE


def test_chain_via_context_and_cycles():
    try:
        try:
            raise RuntimeError(GLOO_TIMEOUT)
        except RuntimeError:
            raise ValueError("while handling")  # implicit __context__
    except ValueError as exc:
        assert classify(exc) is FaultKind.NETWORK
    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    assert classify(a) is FaultKind.UNKNOWN
    assert classify(None) is FaultKind.UNKNOWN


def test_exit_codes_distinct_and_nonzero():
    codes = [faults.EXIT_DYING_CHECKPOINT_SAVED, faults.EXIT_NO_COMPLETE_DATA, faults.EXIT_FAULT_UNRECOVERABLE,
             faults.EXIT_CONTROLLER_LOST]
    assert len(set(codes)) == len(codes) and all(0 < c < 126 for c in codes)


def test_hierarchy_and_describe():
    assert issubclass(faults.ControllerLostError, faults.HAError)
    assert classify(faults.ControllerLostError("x")) is FaultKind.NETWORK
    assert faults.describe(RuntimeError("a\nb" * 2000), limit=50).endswith("...")


CONTROL_PLANE = ["config.py", "faults.py", "control/__init__.py", "control/wire.py", "control/state.py",
                 *(f"control/policy/{m}.py" for m in ("__init__", "arf", "decision", "detect", "drain", "dying",
                                                      "in_place", "recovering", "recovery", "save", "table",
                                                      "without_controller")),
                 "control/recovery_plan.py", "control/controller.py", "control/processor.py"]


@pytest.mark.parametrize("rel", CONTROL_PLANE)
def test_control_plane_modules_do_not_import_torch(rel):
    src = pathlib.Path(faults.__file__).parent / rel
    tree = ast.parse(src.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert not names & {"torch", "torch_npu", "megatron"}


def test_torch_npu_uce_check_decides_when_it_answers(monkeypatch):
    """torch_npu.npu.check_uce_in_memory (stand-in module: no NPU here): 2/3 make any error
    a UCE, 1 (memory torch_npu does not manage) UNKNOWN, 0 leaves the text rules; without
    torch_npu, or when the check raises, nothing is recorded."""
    import sys
    import types

    from mindspeed_ha.accelerator import check_npu_uce
    from mindspeed_ha.faults import FaultKind, classify

    answers = []

    def check(device_id):
        answers.append(device_id)
        if answer[0] is None:
            raise RuntimeError("PYTORCH_NO_NPU_MEMORY_CACHING is set")
        return answer[0]

    npu = types.SimpleNamespace(is_available=lambda: True, current_device=lambda: 5, check_uce_in_memory=check)
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu=npu))
    answer = [3]
    exc = RuntimeError("ACL stream synchronize failed, error code 507053")
    assert check_npu_uce(exc) == 3 and answers == [5] and classify(exc) is FaultKind.UCE
    answer[0] = 2
    exc = RuntimeError("an operator failed")
    assert check_npu_uce(exc, device_id=1) == 2 and answers[-1] == 1 and classify(exc) is FaultKind.UCE
    answer[0] = 1
    exc = RuntimeError("UCE ERROR")  # the text says UCE; torch_npu says: not its memory
    assert check_npu_uce(exc) == 1 and classify(exc) is FaultKind.UNKNOWN
    answer[0] = 0
    exc = RuntimeError("Connection reset by peer")
    assert check_npu_uce(exc) == 0 and classify(exc) is FaultKind.NETWORK
    answer[0] = None
    exc = RuntimeError("UCE ERROR")
    assert check_npu_uce(exc) is None and classify(exc) is FaultKind.UCE
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    assert check_npu_uce(RuntimeError("x")) is None
