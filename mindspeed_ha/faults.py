"""Exit codes and a table-driven classifier of exceptions into fault kinds.

The kinds and the error tree they label live in :mod:`mindspeed_ha.errors`.

:func:`classify` maps any exception raised inside the training step to a
:class:`FaultKind` by exception type and message text, walking the whole chain
(``__cause__`` / ``__context__``). Device memory errors win over communication
errors (an NCCL failure caused by an ECC error is a UCE), process death wins over a
generic network error. Imports neither torch nor any accelerator library: types are
matched by class name.
"""

from __future__ import annotations

import re
from typing import Iterator, List, Optional, Pattern, Sequence, Tuple

from mindspeed_ha.errors import (  # noqa: F401  (re-exported: the classifier's vocabulary lives in errors)
    CommunicationError, ControllerLostError, ControlPlaneError, DeviceMemoryError, FaultKind, HAError,
    IllegalTransition, ProcessFailure,
)

# --------------------------------------------------------------------------- exit codes
EXIT_OK = 0
"""Normal end of training."""

EXIT_DYING_CHECKPOINT_SAVED = 75
"""A fault stopped the job and a complete dying checkpoint was committed; restart
with ``--load`` resumes at the saved iteration without losing a completed step.
(75 = ``EX_TEMPFAIL``: the failure is temporary, a restart is the cure.)"""

EXIT_NO_COMPLETE_DATA = 76
"""A fault stopped the job but no iteration had every optimizer shard held by a
healthy rank in a consistent state; nothing was written. Restart from the latest
periodic checkpoint."""

EXIT_FAULT_UNRECOVERABLE = 77
"""A fault stopped the job and no dying checkpoint could be written (no ``--save``
directory, a save/assemble/commit step failed or timed out). Nothing was committed."""

EXIT_CONTROLLER_LOST = 78
"""The processor lost its controller while frozen and gave up waiting for an action."""

EXIT_FAILED_BEFORE_TRAINING = 79
"""A rank failed before any rank started its first iteration: during start-up or while
loading the checkpoint named by ``--load`` (a resume error, e.g. a checkpoint that does
not fit the run's flags). Not a training fault: nothing could be saved and nothing was
written; the checkpoint loaded is untouched. The failing rank's own error says why; fix
it before rerunning (a plain rerun fails the same way)."""



# --------------------------------------------------------------------------- table
# Each row: (kind, exception class names matched anywhere in the MRO, message regexes).
# Rows are tried in order over the whole exception chain; the first row that matches
# any link wins, so specific kinds come first.
_ROWS: List[Tuple[FaultKind, Tuple[str, ...], Tuple[Pattern[str], ...]]] = [
    (
        FaultKind.UCE,
        ("DeviceMemoryError",),
        tuple(re.compile(p, re.IGNORECASE) for p in (
            # CUDA runtime, cudaErrorECCUncorrectable: "uncorrectable ECC error encountered"
            # (CUDA Runtime API, cudaGetErrorString; surfaced by torch as "CUDA error: ...").
            r"uncorrectable ECC error",
            # torch_npu (Ascend): "UCE ERROR" raised by the NPU exception checker for
            # ACL_ERROR_RT_DEVICE_MEM_ERROR, which MindSpeed-LLM's TTP decorator matches
            # with `"UCE ERROR" in str(e)`; "HBM MULTI BIT ECC ERROR" / "device memory error"
            # are the CANN runtime texts for the same fault (as recalled; verify on NPU).
            r"\bUCE ERROR\b",
            r"HBM MULTI BIT ECC",
            r"device memory error",
            r"ACL_ERROR_RT_DEVICE_MEM_ERROR",
            # NVIDIA Xid 48/63/64/94/95 text in driver-surfaced errors.
            r"\bXid\s*(48|63|64|94|95)\b",
        )),
    ),
    (
        FaultKind.PROCESS,
        ("ProcessFailure", "ChildFailedError"),
        tuple(re.compile(p, re.IGNORECASE) for p in (
            # gloo tcp/pair.cc (torch 2.13, reproduced in tests/test_faults.py):
            # "Connection closed by peer [127.0.0.1]:1449. This is typically caused by a
            #  remote worker crashing."
            r"remote worker crash",
            # ProcessGroupGloo / c10d when a peer process is gone.
            r"ProcessGroup\w*.*terminated",
            r"\bpeer process\b.*(died|exited|was killed|terminated)",
            r"\bSIGKILL\b|\bSIGSEGV\b|\bSIGABRT\b",
            # HCCL (Ascend): the peer card or process is gone.
            r"SUSPECT REMOTE ERROR",
        )),
    ),
    (
        FaultKind.NETWORK,
        (
            "CommunicationError", "ControlPlaneError", "DistNetworkError", "DistBackendError",
            "DistStoreError", "ConnectionError", "TimeoutError", "BrokenPipeError",
        ),
        tuple(re.compile(p, re.IGNORECASE) for p in (
            # gloo tcp/pair.cc: "Connection closed by peer [addr]:port", "Connection reset by peer",
            # "Read error [addr]:port: Connection reset by peer", "Write error ...".
            r"Connection (closed|reset|refused) by peer",
            r"\b(Read|Write) error\b",
            # gloo tcp/unbound_buffer.cc (reproduced): "Timed out waiting 3000ms for recv operation to complete"
            r"Timed out waiting",
            # NCCL (ProcessGroupNCCL.cpp): "NCCL error in: ...", "ncclRemoteError", "ncclSystemError",
            # watchdog: "Watchdog caught collective operation timeout", "NCCL communicator was aborted".
            r"\bNCCL\b.*(error|timeout|abort)",
            r"nccl(Remote|System|Internal|Unhandled\w*)Error",
            r"Watchdog caught collective operation timeout",
            r"communicator was aborted",
            # HCCL (torch_npu ProcessGroupHCCL / HCCL_CHECK_ERROR): "HCCL error in: ...",
            # "HCCL function error", "HCCL OP RETRY FAILED".
            r"\bHCCL\b",
            # c10d TCPStore / rendezvous.
            r"Socket Timeout|recvBytes failed|sendBytes failed|Broken pipe",
        )),
    ),
]


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """Yield ``exc`` and everything it was raised from, each once."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend((e.__cause__, e.__context__))


def _type_names(exc: BaseException) -> Sequence[str]:
    return [c.__name__ for c in type(exc).__mro__]


def classify(exc: Optional[BaseException]) -> FaultKind:
    """Map an exception (and its chain) to a :class:`FaultKind`.

    Args:
        exc: the exception caught around the training step; None -> UNKNOWN.

    Returns:
        ABORTED when ``exc`` itself was raised by the recovery's abort (it has
        ``aborted = True``); else the kind of the first table row (UCE, then PROCESS,
        then NETWORK) matching any exception of the chain by an ``HAError.kind``, a
        class name in its MRO or its message; otherwise UNKNOWN.
    """
    if exc is None:
        return FaultKind.UNKNOWN
    links = list(_chain(exc))
    if getattr(links[0], "aborted", False) is True:  # recovery.comm.CollectiveAborted, raised by us
        return FaultKind.ABORTED
    found = getattr(links[0], UCE_IN_MEMORY, None)  # accelerator.check_npu_uce's answer, when it asked
    if found in (NPU_UCE_TEMPORARY, NPU_UCE_RESIDENT):
        return FaultKind.UCE
    if found == NPU_UCE_FOREIGN:
        return FaultKind.UNKNOWN  # memory torch_npu does not manage: nothing to repair from a replica
    for kind, names, patterns in _ROWS:
        for e in links:
            if isinstance(e, HAError) and type(e).kind is kind and kind is not FaultKind.UNKNOWN:
                return kind
            if any(n in names for n in _type_names(e)):
                if isinstance(e, HAError) and type(e).kind is not kind:
                    continue
                return kind
            text = str(e)
            if any(p.search(text) for p in patterns):
                return kind
    return FaultKind.UNKNOWN


#: attribute :func:`mindspeed_ha.accelerator.check_npu_uce` sets on the exception: torch_npu's answer (0-3)
UCE_IN_MEMORY = "uce_in_memory"
#: ``torch_npu.npu.check_uce_in_memory(device_id)`` answers (Ascend Extension for PyTorch
#: API reference, "(beta) torch_npu.npu.check_uce_in_memory"): 0 no UCE address; 1 a UCE in
#: memory torch_npu does not manage; 2 in its temporary memory; 3 in its resident memory
NPU_UCE_NONE, NPU_UCE_FOREIGN, NPU_UCE_TEMPORARY, NPU_UCE_RESIDENT = 0, 1, 2, 3


def describe(exc: BaseException, limit: int = 2000) -> str:
    """One-line ``Type: message`` of ``exc`` for fault reports, cut at ``limit`` characters."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
