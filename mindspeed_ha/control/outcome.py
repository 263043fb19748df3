"""How the job ended, as the controller saw it, and the controller's phase events.

The controller records its phases in one :class:`~mindspeed_ha.events.EventRecorder`
(``source="controller"``): a mark (``seconds`` 0) for every STOP / VERIFY / DUMP / EXIT it
sends (``stop_sent``, ``verify_sent``, ``dump_sent``, ``exit_sent``) and one phase event
per phase of a round when the send that ends it goes out (:class:`PhaseTimer`).
:attr:`Outcome.timings` is read from those phase events; nothing here recomputes a
duration from the decision log.

A round is the time since the job started or since its last in-place recovery ended
(RESUME: the fault is forgotten, the next one starts afresh).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional, Tuple

from mindspeed_ha.control.policy import ActionKind, DumpPlan
from mindspeed_ha.control.state import ClusterState, Phase, StopRequest
from mindspeed_ha.events import EventRecorder, PhaseEvent
from mindspeed_ha.faults import FaultKind

#: the sends that open or close a phase, and the name of their mark
MARKS = {ActionKind.STOP_ALL: "stop_sent", ActionKind.VERIFY: "verify_sent", ActionKind.DUMP: "dump_sent",
         ActionKind.EXIT: "exit_sent"}
#: the order of :attr:`Outcome.timings` (the report's ``phase_seconds``)
TIMING_ORDER = ("detect", "decide", "verify", "save", "drain", "total")


@dataclasses.dataclass(frozen=True)
class Event:
    """One applied decision: monotonic time, phase after it, action, reason."""

    t: float
    phase: Phase
    action: ActionKind
    reason: str


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How the job ended, as the controller saw it.

    ``timings`` (seconds, from the controller's phase events of the last round):
    ``detect`` fault evidence -> STOP sent; ``decide`` STOP -> DUMP (stop round +
    selection, integrity round included) or -> EXIT; ``verify`` (only when ranks
    verified) VERIFY -> DUMP or EXIT; ``save`` DUMP -> EXIT (dump + assemble + commit);
    ``total`` evidence -> EXIT sent. A graceful stop (``stop_request``, no fault):
    ``drain`` request -> every rank paused (VERIFY / DUMP sent, or the stop round that
    abandoned the iteration), ``save`` as above, ``total`` request -> EXIT sent.
    """

    phase: Phase
    exit_code: Optional[int]
    reason: str
    iteration: Optional[int]
    plan: Optional[DumpPlan]
    fault_rank: Optional[int]
    fault_kind: Optional[FaultKind]
    timings: Dict[str, float]
    events: Tuple[Event, ...]
    stop_request: Optional[StopRequest] = None
    #: in-place recoveries, oldest first (see ClusterState.recoveries): iteration, kind, rank,
    #: generation, repairs, controller times (evidence_at, stop_at, retry_at, done_at) and each
    #: rank's RETRY result (JSON: its per-phase seconds)
    recoveries: Tuple[Dict[str, Any], ...] = ()
    #: worker restarts (--enable-worker-reboot), oldest first: rank, incarnation, pid, the previous
    #: incarnation's exit_code, at (controller clock); recorded only, no decision reads them yet
    restarts: Tuple[Dict[str, Any], ...] = ()


class PhaseTimer:
    """Turns the controller's sends into phase events, one per phase and round.

    Call :meth:`applied` after every applied decision (the state already changed by
    it, e.g. the fault recorded by its STOP). Times are the controller's clock
    (seconds); an event's ``start_wall`` is that time on the wall clock.

    Args:
        recorder: where the events go (``EventRecorder("controller")``).
    """

    def __init__(self, recorder: EventRecorder):
        self.recorder = recorder
        self._first: Dict[ActionKind, float] = {}  # first send of each kind in this round
        self._phases: List[PhaseEvent] = []  # this round's phase events

    def applied(self, now: float, action: ActionKind, st: ClusterState, iteration: Optional[int] = None) -> None:
        """Note decision ``action`` applied at ``now``; record the phases it ends."""
        if action is ActionKind.RESUME:  # recovered in place: the next fault starts a new round
            self._first.clear()
            self._phases = []
            return
        mark = MARKS.get(action)
        if mark is None:
            return
        self.recorder.mark(mark, iteration)
        fault, req, first = st.fault, st.stop_request, self._first
        if action is ActionKind.STOP_ALL and fault is not None and not self._has("detect"):
            self._span("detect", fault.at, now, iteration)  # the STOP that acts on the fault
        if action in first:
            return
        paused = any(k in first for k in (ActionKind.STOP_ALL, ActionKind.VERIFY, ActionKind.DUMP))
        ended = any(k in first for k in (ActionKind.DUMP, ActionKind.EXIT))
        first[action] = now
        if action is not ActionKind.EXIT and req is not None and not paused:
            self._span("drain", req.at, now, iteration)
        if action in (ActionKind.DUMP, ActionKind.EXIT) and not ended:
            for name, opened_by in (("decide", ActionKind.STOP_ALL), ("verify", ActionKind.VERIFY)):
                if opened_by in first:
                    self._span(name, first[opened_by], now, iteration)
        if action is ActionKind.EXIT:
            if ActionKind.DUMP in first:
                self._span("save", first[ActionKind.DUMP], now, iteration)
            if fault is not None or req is not None:
                self._span("total", fault.at if fault is not None else req.at, now, iteration)

    def _has(self, name: str) -> bool:
        return any(e.name == name for e in self._phases)

    def _span(self, name: str, start: float, end: float, iteration: Optional[int]) -> None:
        seconds = end - start  # exact on the controller's clock (PhaseEvent.span would clip at 0)
        self._phases.append(self.recorder.record(PhaseEvent(name, self.recorder.source, time.time() - seconds,
                                                            seconds, iteration)))

    def timings(self) -> Dict[str, float]:
        """Seconds of each phase of this round, in :data:`TIMING_ORDER`. ``drain`` only
        for a round without a fault (a fault during a graceful stop takes it over)."""
        got = {e.name: e.seconds for e in self._phases}
        if "detect" in got:
            got.pop("drain", None)
        return {name: got[name] for name in TIMING_ORDER if name in got}


def build_outcome(st: ClusterState, events: Tuple[Event, ...], timings: Dict[str, float],
                  restarts: Tuple[Dict[str, Any], ...]) -> Outcome:
    """The :class:`Outcome` of ``st`` (copies of its recoveries)."""
    plan, fault = st.plan, st.fault
    recoveries = tuple(dict(r, ranks=dict(r["ranks"])) for r in st.recoveries)
    return Outcome(st.phase, st.exit_code, st.exit_reason, plan.iteration if plan else None, plan,
                   fault.rank if fault else None, fault.kind if fault else None, timings, events, st.stop_request,
                   recoveries, restarts)
