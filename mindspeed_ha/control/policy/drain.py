"""Graceful stop (SIGTERM/SIGINT to the launcher or a rank): DRAINING and its deadline. Pure.

Round 1: every rank says after which iteration it will pause; K = :func:`agree_pause`
-> DRAIN(K) to all. Round 2: every rank paused after K (STOPPED) -> the dying
checkpoint's choice (as after a stop round, with no dead rank). A fault -> STOP_ALL,
STOPPING. Half the preemption deadline passed (:func:`drain_budget_s`) -> STOP_ALL
(freeze now: the iteration in progress is abandoned), STOPPING. Every rank said
GOODBYE(0) (training ended meanwhile) -> DONE. The whole preemption deadline passed
before a commit -> EXIT(77) (:func:`past_preemption_deadline`).
"""

from __future__ import annotations

from typing import List, Mapping, Optional

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.policy.decision import (ActionKind, Decision, DrainPlan, StopPlan, exit_all,
                                                  live_targets, noop)
from mindspeed_ha.control.policy.detect import detect_fault, every_rank_finished, stop_for_fault
from mindspeed_ha.control.policy.save import after_stop
from mindspeed_ha.control.state import ClusterState, Phase, summarise_ranks
from mindspeed_ha.faults import EXIT_FAULT_UNRECOVERABLE, EXIT_NO_COMPLETE_DATA

_NOTHING_TRAINED = ("graceful stop before any rank started its first iteration{}: nothing to save (a checkpoint "
                    "it loaded is untouched); nothing written")


def drain_budget_s(config: HAConfig) -> float:
    """How long a graceful stop waits for every rank to finish its iteration, seconds:
    half the preemption deadline (the other half is for the save)."""
    return config.preemption_deadline_s / 2


def agree_pause(pause_at: Mapping[int, int]) -> Optional[int]:
    """The iteration every rank pauses after in a graceful stop: the highest announced.

    Each rank announces the iteration it is computing (or, between iterations, the next
    one), -1 before its first. The highest one is the only choice that needs no rank to
    undo anything: a rank cannot be made to stop before an iteration it already entered,
    because its peers in that iteration's collectives would wait for it forever; every
    rank behind can finish the iterations up to it, since their peers still have them to
    do too (they all exchange with each other in every iteration, so ranks are at most an
    iteration or so apart). Pure; used by the controller and, when it is lost, by every
    rank on the statuses all ranks exchanged.

    Args:
        pause_at: rank -> announced iteration (-1: not started).

    Returns:
        The iteration K (>= 1), or None when no rank has started an iteration (nothing
        was trained since the start: nothing to save).
    """
    started = [k for k in pause_at.values() if k >= 1]
    return max(started) if started else None


def draining(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]) -> Decision:
    """DRAINING: the graceful stop's two rounds (see the module docstring).

    A rank that exits 0 meanwhile finished training (its pause would have come after the
    last iteration): when every rank did, the job is DONE like any finished run.
    """
    if every_rank_finished(state):
        return noop("every rank finished training during the graceful stop (GOODBYE 0)", Phase.DONE)
    fault = detect_fault(now, state, config)
    if fault is not None:
        return stop_for_fault(state, gone, fault, "; during the graceful stop: stopping all ranks for a dying "
                              "checkpoint")
    req = state.stop_request
    elapsed = now - req.at if req is not None else now - state.phase_since
    live = list(live_targets(state, gone))
    if state.drain_until is None:
        return _announce_round(state, config, gone, live, elapsed)
    k = state.drain_until
    waiting = [r for r in live if not state.ranks[r].stopped]
    budget = drain_budget_s(config)
    if waiting and elapsed < budget:
        return noop(f"graceful stop: waiting for ranks {summarise_ranks(waiting)} to pause after iteration {k}")
    if waiting:
        return _abandon(state, gone, f"ranks {summarise_ranks(waiting)} did not finish iteration {k} "
                        f"within {budget:g} s")
    return after_stop(state, config, gone, dict(gone), elapsed)


def _announce_round(state: ClusterState, config: HAConfig, gone: Mapping[int, str], live: List[int],
                    elapsed: float) -> Decision:
    """Round 1: wait for every rank to say where it pauses, then DRAIN(K) to all."""
    budget = drain_budget_s(config)
    waiting = [r for r in live if state.ranks[r].pause_at is None]
    unregistered = state.world_size - len(state.ranks)
    if (waiting or unregistered > 0) and elapsed < budget:
        return noop(f"graceful stop: waiting for ranks {summarise_ranks(waiting)} to say where they pause"
                    + (f" and for {unregistered} ranks to register" if unregistered > 0 else ""))
    if waiting or unregistered > 0:
        if not any((state.ranks[r].pause_at or -1) >= 1 for r in live):
            return exit_all(state, EXIT_NO_COMPLETE_DATA, _NOTHING_TRAINED.format(" (ranks still starting)"))
        return _abandon(state, gone, f"ranks {summarise_ranks(waiting)} did not answer DRAIN within {budget:g} s")
    k = agree_pause({r: state.ranks[r].pause_at for r in live})
    if k is None:
        return exit_all(state, EXIT_NO_COMPLETE_DATA, _NOTHING_TRAINED.format(""))
    return Decision(ActionKind.DRAIN, f"graceful stop: every rank finishes iteration {k} and pauses after it",
                    DrainPlan(k), tuple(live))


def _abandon(state: ClusterState, gone: Mapping[int, str], why: str) -> Decision:
    """Graceful stop past its drain budget: freeze now; the iteration in progress is abandoned
    and the last one every shard holds completely is saved (a classic stop round)."""
    return Decision(ActionKind.STOP_ALL, f"graceful stop: {why}; abandoning the iteration in progress "
                    "(freeze now, save the last completed one)", StopPlan(graceful=True), live_targets(state, gone),
                    Phase.STOPPING)


def past_preemption_deadline(now: float, state: ClusterState, config: HAConfig) -> Optional[Decision]:
    """EXIT(77) once a graceful stop's checkpoint is not committed within the deadline.

    What the deadline protects: the scheduler SIGKILLs everything after its grace period;
    a save cut there leaves a staging directory behind and no exit status. Ending first
    gives a clean 77 (staging removed by the savers, tracker untouched, so the latest
    regular checkpoint stays the resume point). A fault round (no request) has no deadline
    beyond ``action_timeout_s``.
    """
    req = state.stop_request
    # Not in COMMITTING: the commit (validate, rename, tracker) is short and once started
    # may publish the checkpoint; an EXIT(77) racing it would misreport a saved one.
    if req is None or state.phase not in (Phase.STOPPING, Phase.VERIFYING, Phase.DUMPING, Phase.ASSEMBLING):
        return None
    if now - req.at <= config.preemption_deadline_s:
        return None
    return exit_all(state, EXIT_FAULT_UNRECOVERABLE,
                    f"graceful stop ({req.reason}): no checkpoint committed within the preemption deadline "
                    f"of {config.preemption_deadline_s:g} s (--ha-preemption-deadline); nothing committed, "
                    "the latest checkpoint is unchanged")


__all__ = ["agree_pause", "drain_budget_s", "draining", "past_preemption_deadline"]
