"""The controller's side of the hot switch (``mindspeed-ha switch --ranks R``): requests, the
pre-commit state machine's effects, events and replies. The decisions are
:mod:`.policy.switch` (pure); this module does what they say, on the controller thread under
the controller's lock (no lock of its own), like :mod:`.operator_desk`.

Entry points:

* :func:`request` (the ``switch`` verb of :data:`.operator_desk.VERBS`, and any internal
  caller such as a sub-health policy, with the ranks as its parameter): refused at once with
  a reason (code REFUSED) or recorded (STARTING); the reply waits for the switch's end.
* :meth:`SwitchDesk.spare_ready` / :meth:`SwitchDesk.spare_gone`: a switched rank's new
  process parked at its rejoin point (READY) / died. What reports them is the spare's side.
* :meth:`SwitchDesk.settle` (after each decision step, from ``OperatorDesk.settle``): runs
  :func:`.policy.switch.step` and acts: PAUSE asks the operator's graceful pause
  (``ClusterState.pause``), ABORT releases a pause this switch asked for (training goes on on
  the old ranks) and answers FAILED with the reason, COMMIT sends the switch plan.

Not built in this version (see docs/ARCHITECTURE.md "Hot switch"): the agent starting the
spare for a live rank, the spare's READY registration, and the commit (rebuild with the
spare in the rank's place, the outgoing rank's state handoff, its clean exit). Until then
an accepted switch ends ABORTED before the commit point (no READY within
``--ha-connect-timeout``; a COMMIT is turned into an ABORT with that reason), which is the
flow's own failure path: training goes on on the old ranks, never a job restart.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from mindspeed_ha.control import job_events, wire
from mindspeed_ha.control.policy import switch as policy
from mindspeed_ha.control.policy.switch import Switch, SwitchAction, SwitchPhase
from mindspeed_ha.control.state import PauseRequest, Phase

if TYPE_CHECKING:
    from mindspeed_ha.control.controller import Controller

log = logging.getLogger("mindspeed_ha.control.controller")

#: reply codes (as :mod:`.operator_desk`'s)
DONE, FAILED, REFUSED = 0, 1, 4
#: ended switches kept for ``status``
KEEP_SWITCHES = 5
#: why a COMMIT cannot be carried out in this version
COMMIT_NOT_BUILT = "the switch plan (rebuild with the spare, state handoff from the outgoing rank) is not built yet"


class SwitchDesk:
    """The hot switches of one controller: the one under way and the last ended ones."""

    def __init__(self) -> None:
        self.current: Optional[Switch] = None
        self.ended: List[Switch] = []
        #: switched rank -> why its spare is gone (cleared with each new switch)
        self.spares_gone: Dict[int, str] = {}
        self._paused_by_switch = False

    # ------------------------------------------------------------------ inputs
    def request(self, ctl: "Controller", now: float, request_id: str, ranks: Sequence[int]
                ) -> Optional[wire.OperatorReply]:
        """A switch of ``ranks``: the refusal (REFUSED, nothing else happens), or None (the
        reply comes with the switch's end, from :meth:`settle`)."""
        ranks = [int(r) for r in ranks]
        switching = list(self.current.ranks) if self.current is not None else []
        why = policy.refuse(ctl.state, ctl.config, ranks, _spares_available(ctl), switching)
        if why is not None:
            log.warning("operator: hot switch of ranks %s refused: %s", ranks, why)
            return wire.OperatorReply(request_id, REFUSED, why)
        self.current = Switch(request_id, tuple(sorted(ranks)), now)
        self.spares_gone = {}
        job_events.note(ctl.recorder, "SwitchRequested", None, ranks=self.current.ranks, reason="operator",
                        request_id=request_id)
        log.warning("operator: hot switch of ranks %s: spares starting (training goes on)", list(self.current.ranks))
        return None

    def spare_ready(self, ctl: "Controller", now: float, rank: int, pid: int) -> bool:
        """The new process of switched ``rank`` is parked at its rejoin point. False when no
        switch of that rank is starting (the caller ends that process)."""
        sw = self.current
        if sw is None or rank not in sw.ranks or sw.phase is not SwitchPhase.STARTING:
            return False
        sw.ready[rank] = int(pid)
        log.warning("hot switch: the spare of rank %d (pid %d) is READY", rank, pid)
        if all(r in sw.ready for r in sw.ranks):
            sw.transition(SwitchPhase.READY, now, "every spare is READY")
            job_events.note(ctl.recorder, "SwitchReady", None, ranks=sw.ranks,
                            phase_seconds=policy.phase_seconds(sw.marks), pids=dict(sw.ready))
        return True

    def spare_gone(self, rank: int, why: str) -> None:
        """The spare of switched ``rank`` died (before the commit point: the switch aborts)."""
        if self.current is not None and rank in self.current.ranks:
            self.spares_gone[rank] = why

    def wanted(self) -> Dict[int, Tuple[str, int]]:
        """Switched rank -> (request id, 0) for each spare to start now (STARTING, not READY)."""
        sw = self.current
        if sw is None or sw.phase is not SwitchPhase.STARTING:
            return {}
        return {r: (sw.request_id, 0) for r in sw.ranks if r not in sw.ready and r not in self.spares_gone}

    # ------------------------------------------------------------------ the controller's turn
    def settle(self, ctl: "Controller", now: float) -> List[Tuple[str, wire.OperatorReply]]:
        """After the decision step: act on :func:`.policy.switch.step`; returns the replies of
        switches that ended (request id, reply)."""
        sw = self.current
        if sw is None:
            return []
        st = ctl.state
        if sw.phase is SwitchPhase.PAUSING and st.phase is Phase.PAUSED:
            sw.iteration = st.drain_until
            sw.mark("paused", now)
        decision = policy.step(now, sw, st, ctl.config, self.spares_gone)
        if decision.action is SwitchAction.PAUSE:
            if sw.phase is SwitchPhase.STARTING:
                sw.transition(SwitchPhase.READY, now, "every spare is READY")
            st.pause = PauseRequest(now, 0.0, False)
            self._paused_by_switch = True
            ctl.operators.pause_asked(now)
            sw.transition(SwitchPhase.PAUSING, now, decision.reason)
            job_events.note(ctl.recorder, "PauseRequested", None, reason="hot switch", max_s=0.0, then_stop=False)
            return []
        if decision.action is SwitchAction.COMMIT:
            # the commit point: the switch plan would go out here (not built: see the module doc)
            return self._abort(ctl, now, f"{COMMIT_NOT_BUILT}: training goes on on the old ranks")
        if decision.action is SwitchAction.ABORT:
            return self._abort(ctl, now, decision.reason)
        return []

    def _abort(self, ctl: "Controller", now: float, why: str) -> List[Tuple[str, wire.OperatorReply]]:
        sw = self.current
        assert sw is not None
        st = ctl.state
        if self._paused_by_switch and st.pause is not None and st.phase in (Phase.PAUSING, Phase.PAUSED):
            st.pause.resume_at = now  # the pause plan releases every rank: training goes on
        self._paused_by_switch = False
        sw.transition(SwitchPhase.ABORTED, now, why)
        return [self._end(ctl, sw, FAILED, f"hot switch of ranks {list(sw.ranks)} abandoned: {why}",
                          "SwitchAborted")]

    def _end(self, ctl: "Controller", sw: Switch, code: int, detail: str, event: str
             ) -> Tuple[str, wire.OperatorReply]:
        seconds = policy.phase_seconds(sw.marks)
        job_events.note(ctl.recorder, event, sw.iteration, ranks=sw.ranks, reason=sw.reason, phase_seconds=seconds,
                        outcome=sw.phase.value, request_id=sw.request_id)
        self.ended.append(sw)
        del self.ended[:-KEEP_SWITCHES]
        self.current = None
        return sw.request_id, wire.OperatorReply(sw.request_id, code, detail, describe(sw))

    # ------------------------------------------------------------------ status
    def status(self) -> List[Dict[str, Any]]:
        """The switch under way and the last ended ones (``mindspeed-ha status``)."""
        rows = [describe(s) for s in self.ended]
        if self.current is not None:
            rows.append(describe(self.current))
        return rows


def describe(sw: Switch) -> Dict[str, Any]:
    """One switch as ``status`` and the operator's reply show it (JSON-able)."""
    return {"ranks": list(sw.ranks), "phase": sw.phase.value, "iteration": sw.iteration, "reason": sw.reason,
            "spares": {str(r): p for r, p in sorted(sw.ready.items())}, "phase_seconds": policy.phase_seconds(sw.marks)}


def _spares_available(ctl: "Controller") -> Optional[int]:
    """How many spares a switch can start from: the warm spares the hosting launcher reported
    (None: nothing reported)."""
    spares = getattr(ctl, "spares", None)
    return None if spares is None else len(spares)


def request(ctl: "Controller", now: float, body: wire.OperatorRequest) -> Optional[wire.OperatorReply]:
    """The ``switch`` verb (:data:`.operator_desk.VERBS`): ``body.ranks`` to new processes."""
    return ctl.operators.switches.request(ctl, now, body.request_id, body.ranks)


__all__ = ["COMMIT_NOT_BUILT", "SwitchDesk", "describe", "request"]
