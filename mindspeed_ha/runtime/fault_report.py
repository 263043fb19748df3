"""What the runtime keeps of each fault it reported (instead of attributes set on the
exception objects): a fault is reported once, and an outer guard that sees an exception
again gets the action of its first report.

The ledger refers to an exception weakly where its type allows (a Python-defined
exception class), so nothing here keeps an exception (its traceback's frames hold the
aborted step's locals, old process groups included) alive after the training thread let
go of it. Instances of the built-in exception types cannot be referenced weakly: those
are held until the step in progress completes (:meth:`FaultLedger.step_completed`), when
no guard can see them again.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Dict, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class FaultReport:
    """One fault reported to the controller.

    Attributes:
        error: the exception, ``Type: message`` (:func:`mindspeed_ha.faults.describe`).
        kind: its fault kind (:class:`~mindspeed_ha.faults.FaultKind` value).
        iteration: the iteration it was reported with.
        where: what raised it (``train_step``, ``update``, ``update_done``, ``train``,
            ``save``, ``final_save``, ``eval``, ``rejoin``).
        reported: False while the report is under way (the processor has not answered).
        action: the controller's answer (a ``wire.Action``), or None.
    """

    error: str
    kind: str
    iteration: Optional[int]
    where: str
    reported: bool = False
    action: Any = None


class FaultLedger:
    """The faults this process reported (thread-safe)."""

    def __init__(self) -> None:
        #: id(exception) -> (weak reference or the exception itself, its report)
        self._reports: Dict[int, Tuple[Any, FaultReport]] = {}
        self._lock = threading.Lock()

    def remember(self, exc: BaseException, report: FaultReport) -> None:
        """Keep ``report`` for ``exc`` (replacing an earlier one of the same exception)."""
        try:
            ref: Any = weakref.ref(exc, self._forget)
        except TypeError:  # a built-in exception type: held until the step completes
            ref = exc
        with self._lock:
            self._reports[id(exc)] = (ref, report)

    def _forget(self, ref: weakref.ref) -> None:
        with self._lock:
            for key, (r, _) in list(self._reports.items()):
                if r is ref:
                    del self._reports[key]

    def report_of(self, exc: BaseException) -> Optional[FaultReport]:
        """The report of ``exc`` itself, or None."""
        with self._lock:
            found = self._reports.get(id(exc))
        if found is None:
            return None
        held = found[0]() if isinstance(found[0], weakref.ref) else found[0]
        return found[1] if held is exc else None

    def seen(self, exc: BaseException) -> bool:
        """Whether ``exc`` or an exception it was raised from or during (its ``__cause__``
        / ``__context__`` chain) was reported already."""
        visited = set()
        while exc is not None and id(exc) not in visited:
            if self.report_of(exc) is not None:
                return True
            visited.add(id(exc))
            exc = exc.__cause__ or exc.__context__
        return False

    def step_completed(self) -> None:
        """The step in progress completed: let go of the exceptions held strongly."""
        with self._lock:
            for key, (r, _) in list(self._reports.items()):
                if not isinstance(r, weakref.ref):
                    del self._reports[key]
