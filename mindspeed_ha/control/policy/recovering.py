"""RECOVERING: the in-place recovery and ARF rounds, as the controller drives them. Pure.

Round 1 (observe, no freeze; sent from RUNNING): every rank reports STOPPED and goes on
until the same iteration boundary, or into the same optimizer update. Then the abort
(STOP with ``recover``): every rank leaves its step and parks in its fault handler (a
restarted process parks at its rejoin point). Then RETRY(plan) to all
(:func:`~.in_place.plan_recovery`), and RESUME once every rank answered ok (no message:
the job goes back to RUNNING). No plan, a failure, a lost rank, a new fault or a
timeout: STOP(recover) and the dying checkpoint (STOPPING), so nothing loops.
"""

from __future__ import annotations

from typing import List, Mapping, Sequence

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.policy.arf import parked_to_rejoin
from mindspeed_ha.control.policy.decision import ActionKind, Decision, StopPlan, live_targets, noop
from mindspeed_ha.control.policy.in_place import plan_recovery
from mindspeed_ha.control.policy.recovery import NoRecovery, RecoveryMode, RecoveryPlan
from mindspeed_ha.control.policy.save import update_settle_s
from mindspeed_ha.control.state import (ClusterState, OptimizerStatus, PendingAction, Phase, RankInfo,
                                        summarise_ranks)
from mindspeed_ha.faults import FaultKind


def recovering(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]) -> Decision:
    """RECOVERING: wait until every rank is parked, send RETRY(plan), collect the results.

    RETRY's result comes from each rank's training thread once it has cleaned, rebuilt its
    process groups, been repaired and rolled back (just before it re-runs the step).
    """
    rejoin = state.rejoin_wait  # ARF: rank -> when its death was reported
    others = {r: why for r, why in gone.items() if r not in rejoin}
    if others:
        r = sorted(others)[0]
        return fall_back(state, gone, now, f"rank {r} is gone ({others[r]})")
    late = sorted(r for r, since in rejoin.items() if now - since > config.action_timeout_s
                  and not parked_to_rejoin(state, r, gone))
    if late:
        return fall_back(state, gone, now, f"rank {late[0]} did not rejoin within {config.action_timeout_s} s of "
                         "its death (--enable-worker-reboot)")
    pending = state.pending
    if pending is not None and pending.kind == ActionKind.RETRY.value:
        return _retry_results(now, state, config, gone, pending)
    live = live_targets(state, gone)
    survivors = [r for r in live if r not in rejoin] if rejoin else list(live)
    if state.abort_sent_at is None:
        return _observe_round(now, state, config, survivors)
    return _abort_round(now, state, config, gone, survivors)


def fall_back(state: ClusterState, gone: Mapping[int, str], now: float, why: str) -> Decision:
    """In-place recovery is impossible or failed: abort every step again (a rank may be
    inside a recovery collective) and take the dying-checkpoint path (STOPPING)."""
    fault = state.fault
    plan = StopPlan(fault.rank if fault is not None else -1, fault.kind if fault is not None else FaultKind.UNKNOWN,
                    now, recover=True)
    return Decision(ActionKind.STOP_ALL, f"in-place recovery not possible: {why}; stopping all ranks for a dying "
                    "checkpoint", plan, live_targets(state, gone), Phase.STOPPING)


def _observe_round(now: float, state: ClusterState, config: HAConfig, live: List[int]) -> Decision:
    """Round 1 (observe, no freeze): ranks whose gradients are complete finish their
    optimizer update (it needs no rank that faulted later), so the abort that follows
    finds every rank at the end of the same iteration; a rank that cannot get there
    (blocked before it) ends the wait after update_settle_s and the plan falls back."""
    elapsed = now - state.phase_since
    if not live:  # every rank died and is being restarted (ARF): their rejoin (or its deadline) is next
        return noop(f"recovering: no survivor; waiting for the restarted ranks {summarise_ranks(state.rejoin_wait)}")
    infos = list(map(state.ranks.__getitem__, live))  # (read once: each step reads every rank, 16,384 at scale)
    waiting = [r for r, i in zip(live, infos) if not i.stopped]
    if waiting and elapsed < config.stop_timeout_s:
        return noop(f"recovering: waiting for STOPPED from ranks {summarise_ranks(waiting)}")
    at = {(i.status, i.iteration) for i in infos}
    settled = len(at) == 1 and next(iter(at))[0] is OptimizerStatus.UPDATED
    # ... and every rank out of step k (its tail after the update cannot be re-run),
    # inside step k+1 (steps -1: a processor that does not say)
    k = next(iter(at))[1]
    settled = settled and all(i.step in (-1, k + 1) for i in infos)
    if not settled:
        settled = inside_one_update(state, live, dead=tuple(state.rejoin_wait))
    if not settled and elapsed < update_settle_s(config):
        return noop("recovering: waiting for every rank to finish the same optimizer update and enter the next "
                    f"step (states {sorted(f'{s.value}@{i}' for s, i in at)}, steps "
                    f"{sorted({i.step for i in infos})})")
    fault = state.fault
    plan = StopPlan(fault.rank if fault else -1, fault.kind if fault else FaultKind.UNKNOWN,
                    fault.at if fault else now, recover=True)
    return Decision(ActionKind.STOP_ALL, "recovering in place: every rank reported; aborting every step", plan,
                    tuple(live))


def _abort_round(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str],
                 live: List[int]) -> Decision:
    """After the abort: every survivor parked and every restarted rank at its rejoin point
    -> RETRY(plan) to all, or the fall-back when no plan covers the fault."""
    rejoin = state.rejoin_wait
    waiting = [r for r, i in zip(live, map(state.ranks.__getitem__, live)) if i.fault is None or not i.stopped]
    if waiting and now - state.abort_sent_at < config.stop_timeout_s:
        return noop(f"recovering: waiting for ranks {summarise_ranks(waiting)} to leave their step")
    if waiting:
        return fall_back(state, gone, now, f"ranks {summarise_ranks(waiting)} did not leave their step within "
                         f"{config.stop_timeout_s} s")
    starting = sorted(r for r in rejoin if not parked_to_rejoin(state, r, gone))
    if starting:  # bounded above (action_timeout_s from the death)
        return noop(f"recovering: waiting for the restarted ranks {summarise_ranks(starting)} to rejoin")
    fault_rank = state.fault.rank if state.fault is not None else -1
    plan = plan_recovery(state.ranks, state.world_size, fault_rank, config, state.recoveries)
    if isinstance(plan, NoRecovery):
        return fall_back(state, gone, now, plan.reason)
    return Decision(ActionKind.RETRY, plan.reason, plan, tuple(sorted(live + list(rejoin)) if rejoin else live))


def _retry_results(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str],
                   pending: PendingAction) -> Decision:
    """RETRY sent: every result ok -> RESUME (RUNNING); a failure, a new fault or
    ``action_timeout_s`` -> the fall-back."""
    if pending.failures:
        r, detail = sorted(pending.failures.items())[0]
        return fall_back(state, gone, now, f"rank {r} failed to recover: {detail}")
    again = sorted(r for r, i in state.ranks.items() if i.fault_at is not None and i.fault_at > pending.sent_at
                   and r not in pending.results)
    if again:
        return fall_back(state, gone, now, f"rank {again[0]} reported a fault during recovery: "
                         f"{state.ranks[again[0]].fault_message}")
    missing = [t for t in pending.targets if t not in pending.results]
    if not pending.complete:
        if now - pending.sent_at > config.action_timeout_s:
            return fall_back(state, gone, now, f"ranks {summarise_ranks(missing)} did not recover within "
                             f"{config.action_timeout_s} s")
        return noop(f"recovering: waiting for ranks {summarise_ranks(missing)}")
    plan = RecoveryPlan.from_params(pending.params)
    what = (f"goes on with iteration {plan.iteration} after its optimizer update" if plan.mode is RecoveryMode.FORWARD
            else f"re-runs iteration {plan.iteration + 1}")
    return Decision(ActionKind.RESUME, f"every rank recovered in place and {what}", plan, (), Phase.RUNNING)


def inside_one_update(state: ClusterState, live: Sequence[int], dead: Sequence[int] = ()) -> bool:
    """Every rank is inside the optimizer update of the same iteration j (the commit
    barrier keeps them there, see patches/optimizer.py) and every rank still UPDATING
    reported a fault of its own or is a distributed-optimizer instance peer of a faulty
    one (blocked in that instance's parameter all-gather for good): the others finished
    it (UPDATED j) and wait. Any other rank still UPDATING (computing) may yet finish:
    the caller waits up to update_settle_s for it. ``dead``: ranks being restarted (ARF):
    they count as faulty ranks inside the update (their peers never see them finish)."""
    infos = [state.ranks[r] for r in live]
    its = {i.iteration for i in infos}
    if len(its) != 1:
        return False
    j = next(iter(its))
    faulty = [i for i in infos if i.status is OptimizerStatus.UPDATING and i.fault is not None]
    faulty += [state.ranks[r] for r in dead if r in state.ranks]

    def waits_for_a_faulty_peer(i: RankInfo) -> bool:
        # the distributed optimizer's parameter all-gather runs over one optimizer instance
        # (same tp, pp, instance): a peer of a faulty rank there never finishes its update
        return any(f.layout.replica_count < f.layout.dp_size and (f.layout.tp_rank, f.layout.pp_rank,
                   f.layout.instance_id) == (i.layout.tp_rank, i.layout.pp_rank, i.layout.instance_id)
                   for f in faulty)

    return bool(faulty) and all(
        i.step in (-1, j) and (i.status is OptimizerStatus.UPDATED or any(i is f for f in faulty)
                               or (i.status is OptimizerStatus.UPDATING and waits_for_a_faulty_peer(i)))
        for i in infos)


__all__ = ["fall_back", "inside_one_update", "recovering"]
