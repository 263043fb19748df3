"""What each decision of :func:`policy.decide` does: one table, action kind -> effect.

:func:`apply` runs the effect of a :class:`~mindspeed_ha.control.policy.Decision`
(:data:`EFFECTS`; every other kind but NOOP is an ACTION message to its targets, with
:data:`BEFORE_ACTION` noting what the controller keeps of it), moves the job phase,
appends the decision to the controller's log (``Controller.events``), records the phase
events it ends (:class:`outcome.PhaseTimer`) and the job events it means
(:func:`job_events.on_decision`), and logs one line.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Dict

from mindspeed_ha.control import job_events, wire
from mindspeed_ha.control.outcome import Event
from mindspeed_ha.control.policy import ActionKind, Decision, DumpPlan
from mindspeed_ha.control.state import PendingAction, summarise_ranks
from mindspeed_ha.faults import FaultKind

if TYPE_CHECKING:
    from mindspeed_ha.control.controller import Controller

log = logging.getLogger("mindspeed_ha.control.controller")

Effect = Callable[["Controller", float, Decision], None]


def apply(ctl: "Controller", now: float, d: Decision) -> None:
    """Apply decision ``d`` at ``now`` (I/O thread, under the controller's lock).

    Raises:
        IllegalTransition: ``d.next_phase`` is not a legal move (its messages are sent).
    """
    st = ctl.state
    old, fault_before = st.phase, st.fault
    EFFECTS.get(d.action, _send_action)(ctl, now, d)
    if d.next_phase is not None and d.next_phase is not old:
        st.set_phase(d.next_phase, now)
    ctl.events.append(Event(now, st.phase, d.action, d.reason))
    iteration = d.params.get("iteration", st.plan.iteration if st.plan else None)
    ctl.timer.applied(now, d.action, st, iteration if isinstance(iteration, int) else None)
    job_events.on_decision(ctl, d, old, fault_before)
    fault = st.fault
    log.info("controller: phase %s -> %s, decision %s, targets %s, fault rank %s, iteration %s: %s",
             old.value, st.phase.value, d.action.value, summarise_ranks(d.targets),
             fault.rank if fault else None, iteration, d.reason)


def _nothing(ctl: "Controller", now: float, d: Decision) -> None:
    pass


def _drain(ctl: "Controller", now: float, d: Decision) -> None:
    """DRAIN (graceful stop) and PAUSE (graceful pause: DRAIN with ``hold``): a DRAIN message,
    not an ACTION; ``until`` -1: pause at once."""
    st = ctl.state
    until = int(d.params["until"])
    hold = bool(d.params.get("hold"))
    if until >= 0:
        st.drain_until = until
    for r in d.targets:
        info = st.ranks[r]
        info.stopped = False  # only a STOPPED that answers this round counts
        if until < 0:
            info.pause_at = info.paused_after = None
    ctl.server.send_to_ranks(d.targets, wire.Drain(d.reason, until, hold))


def _release(ctl: "Controller", now: float, d: Decision) -> None:
    """RELEASE (the graceful pause ends): a RELEASE message to every target; the pause's
    agreement is forgotten, so a later pause or stop starts afresh."""
    st = ctl.state
    st.drain_until, st.pause = None, None
    ctl.server.send_to_ranks(d.targets, wire.Release(d.reason))
    for info in st.ranks.values():
        info.pause_at = info.paused_after = None
        info.stopped = False


def _stop_all(ctl: "Controller", now: float, d: Decision) -> None:
    """STOP to every target; a fault's STOP records the fault (the first one is kept)."""
    st = ctl.state
    if not d.params.get("graceful"):
        st.record_fault(d.params.get("at", now), d.params.get("rank", -1),
                        FaultKind(d.params.get("kind", "unknown")), d.reason)
    if d.params.get("recover"):
        st.abort_sent_at = now
    for r in d.targets:
        st.ranks[r].stopped = False
        st.ranks[r].integrity = None  # a report describes the state frozen by this STOP only
    ctl.server.send_to_ranks(d.targets, wire.Stop(d.reason, bool(d.params.get("recover")),
                                                  not d.params.get("in_place")))


def _recovered(ctl: "Controller", now: float, d: Decision) -> None:
    """RESUME (no message): every rank recovered in place. Keep the record (per-rank
    phase seconds from the RETRY results), forget the fault, so the next one starts afresh;
    a fault reported after the RETRY was sent (by a rank that answered it, then failed in
    the re-run step) is kept for the next decision."""
    st = ctl.state
    pending = st.pending
    ctl.failover.roster_dirty = True
    if st.recoveries:
        rec = st.recoveries[-1]
        rec["done_at"] = now
        for r, (_, detail) in sorted((pending.results if pending is not None else {}).items()):
            rec["ranks"][r] = detail
        log.warning("controller: recovered in place from the %s fault of rank %s in %.3f s (evidence -> every "
                    "rank ready to %s iteration %d)", rec["kind"], rec["rank"], now - rec["evidence_at"],
                    *(("go on with", rec["iteration"]) if rec.get("mode") == "forward"
                      else ("re-run", rec["iteration"] + 1)))
    st.fault = None
    st.pending = None
    st.abort_sent_at = None
    st.rejoin_wait.clear()
    answered_at = pending.sent_at if pending is not None else now
    for info in st.ranks.values():
        if info.fault_at is not None and info.fault_at > answered_at:
            # a new fault, reported after the rank answered RETRY (it re-ran the step and
            # failed again): kept, so the next decision starts its round (erasing it left
            # that rank parked and its peers blocked in a collective)
            info.failed_at = info.fault_at  # evidence of the new fault, not of the round just ended
            continue
        info.fault, info.fault_message, info.fault_where = None, "", ""
        info.failed_at = info.fault_at = None
        info.fault_iteration = -1
        info.stopped = False


def _send_action(ctl: "Controller", now: float, d: Decision) -> None:
    """An ACTION message (DUMP, ASSEMBLE, COMMIT, EXIT, VERIFY, RETRY...) to every
    target, awaited as ``ClusterState.pending``."""
    st = ctl.state
    aid = next(ctl.action_ids)
    st.pending = PendingAction(aid, d.action.value, tuple(d.targets), now, dict(d.params))
    before = BEFORE_ACTION.get(d.action)
    if before is not None:
        before(ctl, now, d)
    params = dict(d.params)
    if d.action is ActionKind.RETRY and ctl.rebuild_store:
        params["store"] = ctl.rebuild_store  # the first generation's store died with node 0's agent
    if d.action in PLAN_ACTIONS and st.plan is not None:  # each target gets its own part of the plan
        for r, own in st.plan.params_by_rank(params.get("save_dir"), d.targets).items():
            ctl.server.send_to_rank(r, wire.Action(aid, d.action.value, own))
    else:  # the same params for every target: encoded once
        ctl.server.send_to_ranks(d.targets, wire.Action(aid, d.action.value, params))


def _note_dump(ctl: "Controller", now: float, d: Decision) -> None:
    ctl.state.plan = DumpPlan.from_params(d.params)


def _note_exit(ctl: "Controller", now: float, d: Decision) -> None:
    ctl.state.exit_code = int(d.params["code"])
    ctl.state.exit_reason = d.reason


def _note_retry(ctl: "Controller", now: float, d: Decision) -> None:
    """Open the record of an in-place recovery (``Outcome.recoveries``)."""
    st = ctl.state
    fault = st.fault
    st.recoveries.append({"iteration": int(d.params["iteration"]), "kind": d.params["kind"],
                          "mode": d.params.get("mode", "rollback"),
                          "rank": int(d.params["fault_rank"]), "generation": int(d.params["generation"]),
                          "repairs": d.params.get("repairs", []),
                          "evidence_at": fault.at if fault is not None else now,
                          "stop_at": st.phase_since, "abort_at": st.abort_sent_at, "retry_at": now,
                          "done_at": None, "ranks": {}})
    if ctl.lease is not None:
        ctl.failover.write_roster()  # a successor must count this generation, even if it never completes


#: the dying checkpoint's actions: every target is sent only the entries of the plan that name it
PLAN_ACTIONS = frozenset({ActionKind.DUMP, ActionKind.ASSEMBLE, ActionKind.COMMIT})

#: action kind -> its effect; any other kind is an ACTION message (:func:`_send_action`)
EFFECTS: Dict[ActionKind, Effect] = {
    ActionKind.NOOP: _nothing,
    ActionKind.DRAIN: _drain,
    ActionKind.PAUSE: _drain,
    ActionKind.RELEASE: _release,
    ActionKind.STOP_ALL: _stop_all,
    ActionKind.RESUME: _recovered,
}

#: action kind -> what the controller keeps of an ACTION before it is sent
BEFORE_ACTION: Dict[ActionKind, Effect] = {
    ActionKind.DUMP: _note_dump,
    ActionKind.EXIT: _note_exit,
    ActionKind.RETRY: _note_retry,
}
