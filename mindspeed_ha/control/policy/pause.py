"""Graceful pause (the operator's ``mindspeed-ha pause``): PAUSING and PAUSED. Pure.

The pause is the graceful stop's agreement without the save: RUNNING with a pause request
(:func:`~.detect.running`) -> round 1, DRAIN(-1, hold)
and every rank says after which iteration it will pause; K = :func:`~.drain.agree_pause`
(one past the furthest rank's completed iteration: no rank undoes anything; when no rank
has started one in this process, e.g. just after ``--load`` of iteration L, every rank
holds at its first pause point, L, and K is L + 1) -> DRAIN(K, hold) to all; round 2,
every rank paused after K (STOPPED pause_at=K) -> PAUSED. Paused
ranks sit in their pause point between two iterations: communicators, device memory and
the optimizer state stay as they are, heartbeats go on.

What ends it:

* ``resume`` (``PauseRequest.resume_at``), or ``--max`` seconds in PAUSED -> RELEASE to
  every rank, RUNNING (the next iteration runs as if nothing happened: losses bitwise);
  both wait while a pause task runs (``PauseRequest.task``: ``check``, ``relink``);
* ``stop`` (or ``--max`` with ``--then-stop``) -> DRAINING with the ranks already holding
  at K: the graceful stop's save of K, exit 75 (:func:`~.drain.draining`);
* a fault -> STOP_ALL, STOPPING: the dying checkpoint, as a fault during a graceful stop;
* PAUSING only: ranks that do not say where or do not reach K within ``stop_timeout_s``
  -> RELEASE, RUNNING (the pause failed; the operator is told why); every rank finished
  training meanwhile -> DONE.
"""

from __future__ import annotations

from typing import Mapping

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.policy.decision import ActionKind, Decision, DrainPlan, live_targets, noop
from mindspeed_ha.control.policy.detect import detect_fault, every_rank_finished, stop_for_fault
from mindspeed_ha.control.policy.drain import agree_pause
from mindspeed_ha.control.state import ClusterState, Phase, summarise_ranks

#: reasons of the decisions that end a pause without RUNNING (the operator's reply quotes them)
PAUSE_FAILED = "graceful pause failed"


def _release(state: ClusterState, gone: Mapping[int, str], why: str) -> Decision:
    return Decision(ActionKind.RELEASE, why, None, live_targets(state, gone), Phase.RUNNING)


def _common(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]):
    """What PAUSING and PAUSED share: a fault, a stop, a resume (None: none of them)."""
    fault = detect_fault(now, state, config)
    if fault is not None:
        return stop_for_fault(state, gone, fault, "; during a graceful pause: stopping all ranks for a dying "
                              "checkpoint")
    if state.stop_request is not None:
        return noop(f"graceful stop requested during a graceful pause ({state.stop_request.reason})",
                    Phase.DRAINING)
    req = state.pause
    if req is not None and req.task:
        return noop(f"graceful pause: the ranks run the pause task {req.task!r}")
    if req is not None and req.resume_at is not None:
        return _release(state, gone, "graceful pause ended by the operator (resume)")
    return None


def pausing(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]) -> Decision:
    """PAUSING: the two rounds (see the module docstring)."""
    if every_rank_finished(state):
        return noop("every rank finished training during the graceful pause (GOODBYE 0)", Phase.DONE)
    common = _common(now, state, config, gone)
    if common is not None:
        return common
    req = state.pause
    elapsed = now - (req.at if req is not None else state.phase_since)
    budget = config.stop_timeout_s
    live = list(live_targets(state, gone))
    if state.drain_until is None:
        waiting = [r for r in live if state.ranks[r].pause_at is None]
        if waiting and elapsed < budget:
            return noop(f"graceful pause: waiting for ranks {summarise_ranks(waiting)} to say where they pause")
        if waiting:
            return _release(state, gone, f"{PAUSE_FAILED}: ranks {summarise_ranks(waiting)} did not answer "
                            f"within {budget:g} s")
        k = agree_pause({r: state.ranks[r].pause_at for r in live})
        if k is None:
            # no rank started an iteration in this process (a job just started, or just
            # loaded a checkpoint of iteration L: its first is L + 1, unknown here): every rank
            # holds at its first pause point (limit 0: the training loop's start, after L or 0)
            # and says where (STOPPED); K is the next iteration, as for a fresh job's 1
            first = {r: state.ranks[r].paused_after for r in live}
            behind = [r for r, k_r in first.items() if k_r is None]
            if behind and elapsed < budget:
                return noop(f"graceful pause: waiting for ranks {summarise_ranks(behind)} to hold at their first "
                            "pause point")
            if behind:
                return _release(state, gone, f"{PAUSE_FAILED}: ranks {summarise_ranks(behind)} did not reach "
                                f"their first pause point within {budget:g} s")
            k = max(first.values()) + 1
        return Decision(ActionKind.PAUSE, f"graceful pause: every rank finishes iteration {k} and holds after it",
                        DrainPlan(k, hold=True), tuple(live))
    k = state.drain_until
    waiting = [r for r in live if not state.ranks[r].stopped]
    if waiting and elapsed < budget:
        return noop(f"graceful pause: waiting for ranks {summarise_ranks(waiting)} to pause after iteration {k}")
    if waiting:
        return _release(state, gone, f"{PAUSE_FAILED}: ranks {summarise_ranks(waiting)} did not reach "
                        f"iteration {k} within {budget:g} s")
    return noop(f"graceful pause: every rank holds after iteration {k}", Phase.PAUSED)


def paused(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]) -> Decision:
    """PAUSED: hold until resume, ``--max``, a stop or a fault."""
    common = _common(now, state, config, gone)
    if common is not None:
        return common
    req = state.pause
    if req is not None and req.max_s > 0 and now - state.phase_since >= req.max_s:
        if req.then_stop:
            return noop(f"graceful pause: --max {req.max_s:g} s passed, stopping (checkpoint of iteration "
                        f"{state.drain_until})", Phase.DRAINING)
        return _release(state, gone, f"graceful pause: --max {req.max_s:g} s passed, resuming")
    return noop(f"paused after iteration {state.drain_until}")


__all__ = ["PAUSE_FAILED", "paused", "pausing"]
