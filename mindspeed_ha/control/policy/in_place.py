"""The in-place recovery planner: :func:`plan_recovery`. Pure.

Live ranks (a UCE with ``--enable-hbmfault-repair``, a network error with
``--ha-network-retries`` > 0): :func:`plan_in_place`. Restarted workers waiting at
their rejoin point (ARF, ``--enable-worker-reboot``): :func:`~.arf.plan_rejoin`. The
rules are in :mod:`mindspeed_ha.control.policy.recovery`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence, Union

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.policy.arf import plan_rejoin
from mindspeed_ha.control.policy.recovery import (REJOIN, NoRecovery, RecoveryMode, RecoveryPlan, absent,
                                                  in_place_possible, outside_step, retry_limit, situation, sources)
from mindspeed_ha.control.state import RankInfo, summarise_ranks
from mindspeed_ha.faults import FaultKind


def plan_recovery(ranks: Mapping[int, RankInfo], world_size: int, fault_rank: int, config: HAConfig,
                  history: Sequence[Mapping[str, Any]] = ()) -> Union[RecoveryPlan, NoRecovery]:
    """Decide the in-place recovery (see :mod:`.recovery` for the rules).

    Args:
        ranks: rank -> RankInfo; each parked rank has ``fault`` set (ABORTED for ranks
            whose step the recovery interrupted), ``fault_where`` (``train_step``,
            ``update``, ``update_done``; ``rejoin`` for a restarted process),
            ``fault_iteration``, and its authoritative ``status`` / ``iteration`` from STOPPED.
        world_size: ranks in the job.
        fault_rank: the first rank that reported the fault.
        config: the job's HAConfig (``hbm_repair``, ``network_retries``, ``worker_reboot``).
        history: earlier recoveries of this job, oldest first (dicts with ``iteration``).

    Returns:
        RecoveryPlan, or NoRecovery naming the first rule that failed.
    """
    missing = sorted(set(range(world_size)) - set(ranks))
    if missing:
        return NoRecovery(f"ranks {summarise_ranks(missing)} never registered")
    rejoining = {r: i for r, i in ranks.items() if i.fault_where == REJOIN}
    if rejoining:
        return plan_rejoin(ranks, rejoining, fault_rank, config, history)
    return plan_in_place(ranks, fault_rank, config, history)


def plan_in_place(ranks: Mapping[int, RankInfo], fault_rank: int, config: HAConfig,
                  history: Sequence[Mapping[str, Any]] = ()) -> Union[RecoveryPlan, NoRecovery]:
    """Every rank is alive and parked: roll back, roll forward, or reload (rules 1-5)."""
    faults = {r: i.fault for r, i in ranks.items() if i.fault not in (None, FaultKind.ABORTED)}
    if not faults:
        return NoRecovery("no rank reported a fault of its own")
    for r, kind in sorted(faults.items()):
        why = in_place_possible(kind, config)
        if why is not None:
            return NoRecovery(f"rank {r}: {why}")
    gone = absent(ranks, ranks, " (restarting a worker is --enable-worker-reboot's job)")
    if gone is not None:
        return gone
    outside = outside_step(ranks)
    if outside is not None:
        r, where = outside
        return NoRecovery(f"rank {r} was stopped outside train_step ({where}): the step cannot be re-run there")
    found = situation(ranks)
    if isinstance(found, NoRecovery):
        return found
    mode, k, needs = found  # k: the state every rank is at after recovery
    done, limit, over = retry_limit(history, mode, k, config, ", --ha-network-retries")
    if over is not None:
        return over
    damaged = sorted(r for r, kind in faults.items() if kind is FaultKind.UCE)
    repairs, orphans = sources(ranks, needs, ranks)
    kind = FaultKind.UCE if damaged else FaultKind.NETWORK
    named = [r for r, f in faults.items() if f is kind]  # the rank the reason names has that kind
    first = fault_rank if fault_rank in named else min(named)
    plan = RecoveryPlan(iteration=k, generation=len(history) + 1, kind=kind, fault_rank=first, repairs=repairs,
                        mode=mode)
    if orphans:
        return _reload(plan, ranks, orphans[0], bool(config.hbm_repair and damaged))
    if mode is RecoveryMode.FORWARD:
        what = (f"ranks {sorted(repairs)} receive the finished update from {[repairs[d] for d in sorted(repairs)]}"
                if repairs else "rebuild communication")
        reason = (f"{kind.value} fault on rank {first} inside the optimizer update of iteration {k}: {what}, "
                  f"and every rank continues iteration {k} after its update (recovery {done + 1}; at most {limit} "
                  "in a row)")
        return dataclasses.replace(plan, reason=reason)
    what = (f"repair ranks {sorted(repairs)} from replicas {[repairs[d] for d in sorted(repairs)]}" if repairs
            else "rebuild communication")
    reason = (f"{kind.value} fault on rank {first}: every rank is at the end of iteration {k}; {what}, roll back "
              f"and re-run iteration {k + 1} (re-run {done + 1}; at most {limit} in a row)")
    return dataclasses.replace(plan, reason=reason)


def _reload(plan: RecoveryPlan, ranks: Mapping[int, RankInfo], orphan: int,
            allowed: bool) -> Union[RecoveryPlan, NoRecovery]:
    """Rule 4 without a source: every rank reloads the latest periodic checkpoint in place
    (only for a UCE with --enable-hbmfault-repair: ``allowed``)."""
    key = ranks[orphan].layout.shard_key
    what = (f"rank {orphan} has no healthy copy of its state (tp={key[0]}, pp={key[1]}, shard={key[2]}): no replica "
            "holds it")
    if not allowed:
        return NoRecovery(what + "; reloading the latest periodic checkpoint in place is only done for a UCE "
                          "with --enable-hbmfault-repair")
    last = plan.iteration - 1 if plan.mode is RecoveryMode.FORWARD else plan.iteration  # the last completed
    return RecoveryPlan(iteration=last, generation=plan.generation, kind=plan.kind, fault_rank=plan.fault_rank,
                        mode=RecoveryMode.RELOAD,
                        reason=f"{plan.kind.value} fault on rank {plan.fault_rank}: {what}; every rank reloads the "
                               f"latest periodic checkpoint in place and re-runs the iterations after it up to "
                               f"{last + 1}")


__all__ = ["plan_in_place", "plan_recovery"]
