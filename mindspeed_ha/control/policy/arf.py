"""ARF (worker restart, ``--enable-worker-reboot``): when a dead worker is restarted, and
the plan that lets the restarted process rejoin the survivors. Pure.

A process fault with every gone rank being restarted by its node agent starts a
recovery round (:func:`worker_restart`); the survivors park as for an in-place
recovery, the restarted process parks at its rejoin point (:func:`parked_to_rejoin`),
then :func:`plan_rejoin` decides (the rules are in :mod:`.recovery`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence, Union

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.policy.recovery import (REJOIN, NoRecovery, RecoveryMode, RecoveryPlan, absent,
                                                  in_place_possible, outside_step, retry_limit, situation, sources)
from mindspeed_ha.control.state import ClusterState, RankInfo
from mindspeed_ha.faults import FaultKind


def worker_restart(state: ClusterState, kind: FaultKind, config: HAConfig, gone: Mapping[int, str]) -> bool:
    """Whether a fault starts an ARF round: a process fault (a rank died, or a survivor saw
    its peer crash) with ``--enable-worker-reboot``, every gone rank being restarted by its
    agent (``rejoin_wait``; a survivor's report may come before the death's, the recovery
    round then waits for it)."""
    return (config.worker_reboot and kind is FaultKind.PROCESS and bool(gone or state.rejoin_wait)
            and all(r in state.rejoin_wait for r in gone))


def parked_to_rejoin(state: ClusterState, rank: int, gone: Mapping[int, str]) -> bool:
    """The restarted process of ``rank`` registered and waits at its rejoin point."""
    info = state.ranks.get(rank)
    return (rank not in gone and info is not None and info.incarnation > 0 and info.stopped
            and info.fault_where == REJOIN)


def plan_rejoin(ranks: Mapping[int, RankInfo], rejoining: Mapping[int, RankInfo], fault_rank: int,
                config: HAConfig, history: Sequence[Mapping[str, Any]]) -> Union[RecoveryPlan, NoRecovery]:
    """Restarted processes wait at their rejoin point; the survivors must be in the rollback
    or the roll-forward situation; each restarted rank gets its whole state from a survivor
    with the same (tp, pp, shard) (none has it: every rank reloads the periodic checkpoint)."""
    survivors = {r: i for r, i in ranks.items() if r not in rejoining}
    why = _survivors_unfit(ranks, rejoining, survivors, config)
    if why is not None:
        return why
    found = situation(survivors)  # in the update: every survivor is held inside it (commit barrier)
    if isinstance(found, NoRecovery):
        return found
    mode, k, damaged = found
    _, _, over = retry_limit(history, mode, k, config)
    if over is not None:
        return over
    restarted = tuple(sorted(rejoining))
    first = fault_rank if fault_rank in rejoining else min(rejoining)
    plan = RecoveryPlan(iteration=k, generation=len(history) + 1, kind=FaultKind.PROCESS, fault_rank=first,
                        mode=mode, rejoin=restarted)
    repairs, orphans = sources(ranks, set(rejoining) | set(damaged), survivors)
    if orphans:
        return _reload(plan, ranks, orphans[0], min(survivors))
    if mode is RecoveryMode.FORWARD:
        reason = (f"ranks {list(restarted)} were restarted inside the optimizer update of iteration {k}: they "
                  f"rejoin and receive the finished update of {k} from {[repairs[d] for d in restarted]} and "
                  f"catch up with the rest of step {k}; every rank continues iteration {k} after its update")
    else:
        reason = (f"ranks {list(restarted)} were restarted: they rejoin and receive the state of iteration {k} "
                  f"from {[repairs[d] for d in restarted]}; every rank re-runs iteration {k + 1}")
    return RecoveryPlan(iteration=k, generation=plan.generation, kind=FaultKind.PROCESS, fault_rank=first,
                        repairs=repairs, mode=RecoveryMode.FORWARD if mode is RecoveryMode.FORWARD
                        else RecoveryMode.REJOIN, rejoin=restarted, reason=reason)


def _survivors_unfit(ranks: Mapping[int, RankInfo], rejoining: Mapping[int, RankInfo],
                     survivors: Mapping[int, RankInfo], config: HAConfig) -> Union[NoRecovery, None]:
    """NoRecovery when the flags, the restarted ranks or the survivors rule a rejoin out."""
    why = in_place_possible(FaultKind.PROCESS, config)
    if why is not None:
        return NoRecovery(why)
    fresh = sorted(r for r, i in rejoining.items() if i.incarnation < 1)
    if fresh:
        return NoRecovery(f"ranks {fresh} wait to rejoin but were never restarted (incarnation 0)")
    if not survivors:
        return NoRecovery("every rank was restarted: no survivor holds the state (the dying checkpoint cannot "
                          "either; restart from the latest periodic checkpoint)")
    gone = absent(ranks, survivors)
    if gone is not None:
        return gone
    for r, i in sorted(survivors.items()):
        if i.fault not in (None, FaultKind.ABORTED, FaultKind.NETWORK):
            why = in_place_possible(i.fault, config)
            if why is not None:
                return NoRecovery(f"rank {r}: {why}")
    outside = outside_step(survivors)
    if outside is not None:
        r, where = outside
        return NoRecovery(f"rank {r} was stopped at {where}, not in train_step: a restarted process rejoins only "
                          "a step that every survivor can re-run or finish")
    return None


def _reload(plan: RecoveryPlan, ranks: Mapping[int, RankInfo], orphan: int,
            counters_from: int) -> Union[RecoveryPlan, NoRecovery]:
    """No survivor holds ``orphan``'s state: every rank (the restarted ones too) reloads the
    latest periodic checkpoint in place and re-runs the iterations after it; ``repairs``
    names the survivor that sends each restarted rank its counters."""
    key = ranks[orphan].layout.shard_key
    what = "finished the update of that iteration" if plan.mode is RecoveryMode.FORWARD else "holds it"
    why = (f"rank {orphan} has no survivor with its state (tp={key[0]}, pp={key[1]}, shard={key[2]}): "
           f"no replica {what}")
    last = plan.iteration - 1 if plan.mode is RecoveryMode.FORWARD else plan.iteration  # last one completed
    if last < 0:
        return NoRecovery(why + "; no iteration completed yet")
    restarted = list(plan.rejoin)
    return RecoveryPlan(iteration=last, generation=plan.generation, kind=FaultKind.PROCESS,
                        fault_rank=plan.fault_rank, repairs={r: counters_from for r in restarted},
                        mode=RecoveryMode.RELOAD, rejoin=plan.rejoin,
                        reason=f"ranks {restarted} were restarted; {why}: every rank (the restarted ones too) "
                               f"reloads the latest periodic checkpoint in place and re-runs the iterations "
                               f"after it up to {last}, then {last + 1}")


__all__ = ["parked_to_rejoin", "plan_rejoin", "worker_restart"]
