"""RUNNING: who is gone, which fault came first, and which path it takes. Pure.

A fault goes to one of three paths: in place (a UCE or network error the flags allow,
reported by a live rank: RECOVERING), worker restart (ARF: RECOVERING, waiting for the
restarted process to rejoin), or the dying checkpoint (STOPPING). A graceful-stop
request with no fault starts DRAINING.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.policy.arf import worker_restart
from mindspeed_ha.control.policy.decision import ActionKind, Decision, DrainPlan, StopPlan, live_targets, noop
from mindspeed_ha.control.policy.recovery import in_place_possible
from mindspeed_ha.control.state import ClusterState, Phase, summarise_ranks
from mindspeed_ha.faults import FaultKind

#: (rank, kind, reason, evidence time on the controller's monotonic clock)
FaultEvidence = Tuple[int, FaultKind, str, float]


def in_ordered_recovery(now: float, state: ClusterState, config: HAConfig, rank: int) -> bool:
    """Whether ``rank`` is inside a recovery action the controller ordered: a target of the
    pending RETRY (in-place recovery, process-group rebuild, rejoin) that has not answered
    it, sent at most ``action_timeout_s`` ago.

    Such a rank's heartbeat silence is no evidence: its training thread may hold the GIL
    for seconds (a gc pass, a C call) and a process starved of CPU runs its I/O thread
    late, while the controller knows why it is quiet. It is judged by its control
    connection (a death closes it, or its agent reports the exit: ``RankInfo.alive``) and
    by the action's own deadline (:func:`~.recovering.recovering` falls back past it, and
    its silence counts again). docs/ARCHITECTURE.md, "Liveness of a rank".
    """
    pending = state.pending
    return (pending is not None and pending.kind == ActionKind.RETRY.value
            and now - pending.sent_at <= config.action_timeout_s and pending.is_target(rank)
            and rank not in pending.results)


def silent(now: float, state: ClusterState, config: HAConfig, rank: int, limit: float) -> bool:
    """``rank``'s heartbeat silence is evidence now: longer than ``limit`` (s) and the rank
    not :func:`in_ordered_recovery`."""
    return now - state.ranks[rank].last_heartbeat > limit and not in_ordered_recovery(now, state, config, rank)


def gone_ranks(now: float, state: ClusterState, config: HAConfig) -> Dict[int, str]:
    """Ranks that cannot take part any more, with the reason (dead, goodbye, silent: see
    :func:`silent`)."""
    out: Dict[int, str] = {}
    limit = config.heartbeat_timeout_s if state.silence_counts(now) else float("inf")
    for r, info in state.ranks.items():  # O(N), no sort: this runs at every decision step
        if info.alive and info.exit_code is None and now - info.last_heartbeat <= limit:
            continue
        if not info.alive:
            out[r] = info.dead_reason or f"exited with {info.exit_code}"
        elif info.exit_code is not None:
            out[r] = f"said goodbye ({info.exit_code})"
        elif silent(now, state, config, r, limit):
            out[r] = f"no heartbeat for {now - info.last_heartbeat:.3f} s > {config.heartbeat_timeout_s} s"
    return dict(sorted(out.items()))


def detect_fault(now: float, state: ClusterState, config: HAConfig) -> Optional[FaultEvidence]:
    """The earliest fault evidence: (rank, kind, reason, evidence time) or None."""
    found: List[Tuple[float, int, FaultKind, str]] = []
    limit = config.heartbeat_timeout_s if state.silence_counts(now) else float("inf")
    for r, info in state.ranks.items():  # O(N), no sort: min() below picks the earliest
        if info.fault is None and info.alive and info.exit_code is None and now - info.last_heartbeat <= limit:
            continue  # the common case: a healthy rank
        at = info.failed_at if info.failed_at is not None else info.last_heartbeat
        if info.fault is not None:
            found.append((at, r, info.fault, f"rank {r} reported {info.fault.value} fault in iteration "
                          f"{info.fault_iteration if info.fault_iteration >= 0 else info.iteration + 1}: "
                          f"{info.fault_message}"))
        elif not info.alive and info.exit_code != 0:
            found.append((at, r, FaultKind.PROCESS, f"rank {r} died: {info.dead_reason}"))
        elif info.alive and info.exit_code not in (None, 0):
            found.append((at, r, FaultKind.PROCESS, f"rank {r} exits with {info.exit_code}"))
        elif info.alive and info.exit_code is None and silent(now, state, config, r, limit):
            found.append((info.last_heartbeat, r, FaultKind.PROCESS,
                          f"rank {r} missed heartbeats for {now - info.last_heartbeat:.3f} s "
                          f"(> {config.heartbeat_timeout_s} s)"))
    for r, (code, why, at) in sorted(state.unregistered_exits.items()):
        if code != 0:
            found.append((at, r, FaultKind.PROCESS, f"rank {r} died before registering: {why}"))
    if not found:
        return None
    at, r, kind, reason = min(found)
    if len(found) > 1:
        others = summarise_ranks(sorted(f[1] for f in found if f[1] != r))
        reason += f" (+{len(found) - 1} more failed ranks: {others})"
    return r, kind, reason, at


def every_rank_finished(state: ClusterState) -> bool:
    """Every rank of the job registered and said GOODBYE(0)."""
    return bool(state.ranks) and len(state.ranks) >= state.world_size and all(
        i.exit_code == 0 for i in state.ranks.values())


def recover_in_place(state: ClusterState, rank: int, kind: FaultKind, config: HAConfig) -> bool:
    """Whether a fault reported by ``rank`` starts an in-place recovery (see
    :mod:`.recovery`): a UCE or network error the flags allow, reported by a rank that
    is still alive. The full rules are checked once every rank is parked."""
    info = state.ranks.get(rank)
    return (info is not None and info.alive and info.exit_code is None and info.fault is kind
            and in_place_possible(kind, config) is None)


def stop_for_fault(state: ClusterState, gone: Mapping[int, str], fault: FaultEvidence, why: str) -> Decision:
    """STOP_ALL for the dying checkpoint: every live rank freezes (STOPPING)."""
    rank, kind, reason, at = fault
    return Decision(ActionKind.STOP_ALL, reason + why, StopPlan(rank, kind, at), live_targets(state, gone),
                    Phase.STOPPING)


def running(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]) -> Decision:
    """RUNNING: done, a graceful stop, or a fault and its path (see the module docstring)."""
    if every_rank_finished(state):
        return noop("every rank finished (GOODBYE 0)", Phase.DONE)
    fault = detect_fault(now, state, config)
    if fault is None and state.stop_request is not None:
        return Decision(ActionKind.DRAIN, f"graceful stop requested ({state.stop_request.reason}): every rank "
                        "finishes the iteration in progress, then the checkpoint of the last one is written",
                        DrainPlan(-1), live_targets(state, gone), Phase.DRAINING)
    if fault is None and state.pause is not None:  # the operator's graceful pause (see .pause)
        return Decision(ActionKind.PAUSE, "graceful pause requested by the operator: every rank says where it "
                        "pauses", DrainPlan(-1, hold=True), live_targets(state, gone), Phase.PAUSING)
    if fault is None:
        return noop("running")
    rank, kind, reason, at = fault
    targets = tuple(r for r in live_targets(state, gone) if r not in state.rejoin_wait)
    observe = StopPlan(rank, kind, at, in_place=True)
    if recover_in_place(state, rank, kind, config) and not gone:
        return Decision(ActionKind.STOP_ALL, reason + "; recovering in place: every rank reports its state",
                        observe, targets, Phase.RECOVERING)
    if worker_restart(state, kind, config, gone):
        return Decision(ActionKind.STOP_ALL, reason + "; the dead worker is restarted (--enable-worker-reboot): "
                        "the others report their state and wait for it to rejoin", observe, targets,
                        Phase.RECOVERING)
    return Decision(ActionKind.STOP_ALL, reason + "; stopping all ranks for a dying checkpoint",
                    StopPlan(rank, kind, at), targets, Phase.STOPPING)


__all__ = ["FaultEvidence", "detect_fault", "every_rank_finished", "gone_ranks", "in_ordered_recovery",
           "recover_in_place", "running", "silent", "stop_for_fault"]
