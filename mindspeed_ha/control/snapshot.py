"""A read-only view of a running job: what ``/status``, the status page and the metrics show.

:func:`snapshot` is a pure function of the controller's state at ``now`` (a JSON-able
dict, copies only); ``Controller.status()`` calls it under the controller's lock, so a
reader in another thread (the HTTP thread of :mod:`.http_status`) never sees a state
half-changed by a turn.

Rank states (:data:`RANK_STATES`, a bounded label set): ``healthy`` (alive, heard from
within half the heartbeat timeout, no fault reported), ``suspect`` (alive, but silent
longer than that or its fault reported and not yet recovered), ``restarting`` (its process
died and its restarted process is awaited: ARF), ``dead``, ``unregistered`` (not
registered yet).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

from mindspeed_ha.control.job_events import TYPES, recovery_seconds, to_line
from mindspeed_ha.control.state import ClusterState, Phase, RankInfo

if TYPE_CHECKING:
    from mindspeed_ha.control.controller import Controller

RANK_STATES = ("healthy", "suspect", "restarting", "dead", "unregistered")
#: how many recoveries and events a snapshot carries (newest)
KEEP_RECOVERIES = 10
KEEP_EVENTS = 20


def rank_state(info: RankInfo, st: ClusterState, now: float, heartbeat_timeout_s: float) -> str:
    """One of :data:`RANK_STATES` for a registered rank."""
    if not info.alive:
        return "restarting" if info.rank in st.rejoin_wait else "dead"
    if info.fault is not None or now - info.last_heartbeat > heartbeat_timeout_s / 2:
        return "suspect"
    return "healthy"


def rank_state_of(st: ClusterState, rank: int, now: float, heartbeat_timeout_s: float) -> str:
    """One of :data:`RANK_STATES` for any rank of the job, registered or not (a rank that
    died before registering is ``dead``)."""
    info = st.ranks.get(rank)
    if info is not None:
        return rank_state(info, st, now, heartbeat_timeout_s)
    if rank in st.rejoin_wait:
        return "restarting"
    return "dead" if rank in st.unregistered_exits else "unregistered"


def term_of(ctl: "Controller") -> int:
    """The controller's failover term (0 without failover)."""
    lead = ctl.leadership
    return int(lead.term.term) if lead is not None else 0


def ready(st: ClusterState, stepped_down: Any) -> bool:
    """Every rank registered, all healthy enough to train, the job running (``/readyz``)."""
    return (stepped_down is None and st.phase is Phase.RUNNING and len(st.ranks) == st.world_size
            and all(i.alive for i in st.ranks.values()))


def snapshot(ctl: "Controller", now: float, job: str = "") -> Dict[str, Any]:
    """The job as the controller sees it at ``now`` (caller holds the controller's lock).

    Times: ``heartbeat_age_s`` and ``phase_age_s`` in seconds on the controller's clock;
    ``step_seconds``: a rank's last step time (between its last two completed updates).
    """
    st, cfg = ctl.state, ctl.config
    ranks: List[Dict[str, Any]] = []
    by_state = dict.fromkeys(RANK_STATES, 0)
    for r in range(st.world_size):
        info = st.ranks.get(r)
        if info is None:
            by_state["unregistered"] += 1
            ranks.append({"rank": r, "state": "unregistered"})
            continue
        state = rank_state(info, st, now, cfg.heartbeat_timeout_s)
        by_state[state] += 1
        ranks.append({"rank": r, "state": state, "status": info.status.value, "iteration": info.iteration,
                      "step": info.step, "heartbeat_age_s": round(max(0.0, now - info.last_heartbeat), 3),
                      "step_seconds": None if info.step_seconds is None else round(info.step_seconds, 6),
                      "pid": info.pid, "host": info.host, "incarnation": info.incarnation,
                      "fault": info.fault.value if info.fault is not None else None})
    alive_its = [i.iteration for i in st.ranks.values() if i.alive and i.iteration >= 0]
    term = term_of(ctl)
    recoveries = [{"iteration": r["iteration"], "kind": r["kind"], "mode": r.get("mode"), "rank": r["rank"],
                   "generation": r["generation"], "done": r.get("done_at") is not None or bool(r.get("inherited")),
                   "phase_seconds": {k: round(v, 6) for k, v in recovery_seconds(r).items()}}
                  for r in st.recoveries[-KEEP_RECOVERIES:]]
    typed = [e for e in ctl.recorder.events() if e.name in TYPES][-KEEP_EVENTS:]
    fault = st.fault
    return {
        "job": job, "phase": st.phase.value, "phase_age_s": round(max(0.0, now - st.phase_since), 3),
        "term": term, "world_size": st.world_size, "registered": len(st.ranks),
        "ready": ready(st, ctl.stepped_down), "stepped_down": ctl.stepped_down,
        "iteration": min(alive_its) if alive_its else None, "exit_code": st.exit_code,
        "fault": None if fault is None else {"rank": fault.rank, "kind": fault.kind.value, "reason": fault.reason},
        "stop_requested": st.stop_request is not None,
        "ranks": ranks, "ranks_by_state": by_state, "recoveries": recoveries,
        "frames": {"accepted": int(ctl.codec.accepted), "rejected": {str(k): int(v) for k, v in
                                                                     dict(ctl.codec.rejected).items()}},
        "events": [{k: v for k, v in to_line(e, 0, job, term).items() if k != "seq"} for e in typed],
        "subhealth": ctl.subhealth.snapshot() if ctl.subhealth is not None else None,
    }
