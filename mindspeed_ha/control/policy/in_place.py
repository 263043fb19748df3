"""The in-place recovery planner: :func:`plan_recovery`. Pure.

Live ranks (a UCE with ``--enable-hbmfault-repair``, a network error with
``--ha-network-retries`` > 0): :func:`plan_in_place`. Restarted workers waiting at
their rejoin point (ARF, ``--enable-worker-reboot``): :func:`~.arf.plan_rejoin`. The
rules are in :mod:`mindspeed_ha.control.policy.recovery`.

:func:`plan_in_place` reads every rank once (issue 19): the ranks are grouped by the
fields the rules read (:func:`parked_states`; at a parked job's RETRY nearly all ranks
share one group, the faulty ones another), and each rule is checked once per group, not
once per rank; the sources of the repairs are read from the parts' holder table
(:func:`~.recovery.sources`). :func:`plan_in_place_by_rules` is the rules applied rank by
rank, as they are written: kept as the reference the tests compare it with, on random
layouts and faults (tests/test_recovery_one_pass.py). At 16,384 ranks the plan takes
about a tenth of the rules' time (docs/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.policy.arf import plan_rejoin
from mindspeed_ha.control.policy.recovery import (REJOIN, NoRecovery, RecoveryMode, RecoveryPlan, absent,
                                                  in_place_possible, outside_step, retry_limit, situation, sources,
                                                  update_split)
from mindspeed_ha.control.state import IN_STEP, IN_UPDATE, OptimizerStatus, RankInfo, StepPosition, summarise_ranks
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
    if len(ranks) != world_size or (ranks and (min(ranks) != 0 or max(ranks) != world_size - 1)):
        missing = sorted(set(range(world_size)) - set(ranks))  # (distinct ints 0..N-1, N of them: none missing)
        if missing:
            return NoRecovery(f"ranks {summarise_ranks(missing)} never registered")
    groups = parked_states(ranks)
    if any(state[_WHERE] == REJOIN for state in groups):
        rejoining = {r: i for r, i in ranks.items() if i.fault_where == REJOIN}
        return plan_rejoin(ranks, rejoining, fault_rank, config, history)
    return plan_in_place(ranks, fault_rank, config, history, groups)


#: what the in-place rules read of a rank (:func:`parked_states`), and the index of each field
_STATE = operator.attrgetter("alive", "exit_code", "stopped", "fault", "fault_where", "status", "iteration",
                             "fault_iteration")
_ALIVE, _EXIT, _STOPPED, _FAULT, _WHERE, _STATUS, _ITERATION, _FAULT_IT = range(8)
#: a rank's fields as :data:`_STATE` reads them -> the ranks with exactly those (registration order)
ParkedStates = Dict[Tuple[Any, ...], List[int]]


def parked_states(ranks: Mapping[int, RankInfo]) -> ParkedStates:
    """The ranks grouped by what the in-place rules read of them (alive, exit code, stopped,
    fault, where, optimizer status and iteration, fault iteration). One pass; a rank whose
    fields equal the previous rank's joins its group without a hash (at a parked job's RETRY
    nearly every rank has the same fields)."""
    groups: ParkedStates = {}
    last: Any = None
    members: List[int] = []
    for r, state in zip(ranks, map(_STATE, ranks.values())):
        if state == last:
            members.append(r)
            continue
        members = groups.get(state)  # type: ignore[assignment]
        if members is None:
            members = groups[state] = []
        members.append(r)
        last = state
    return groups


def _ranks_of(groups: ParkedStates, pred: Any) -> List[int]:
    """The ranks of every group whose fields satisfy ``pred``, sorted."""
    out: List[int] = []
    for state, members in groups.items():
        if pred(state):
            out += members
    out.sort()
    return out


def plan_in_place(ranks: Mapping[int, RankInfo], fault_rank: int, config: HAConfig,
                  history: Sequence[Mapping[str, Any]] = (),
                  groups: Union[ParkedStates, None] = None) -> Union[RecoveryPlan, NoRecovery]:
    """Every rank is alive and parked: roll back, roll forward, or reload (rules 1-5).

    The same result as :func:`plan_in_place_by_rules` (the same plan, or NoRecovery with the
    same reason), each rule checked once per group of :func:`parked_states` (``groups``: its
    result for ``ranks``, if the caller has it)."""
    if groups is None:
        groups = parked_states(ranks)
    own = lambda s: s[_FAULT] is not None and s[_FAULT] is not FaultKind.ABORTED  # noqa: E731
    fault_ranks = _ranks_of(groups, own)
    if not fault_ranks:
        return NoRecovery("no rank reported a fault of its own")
    fault_of = {r: state[_FAULT] for state, members in groups.items() if own(state) for r in members}
    for r in fault_ranks:
        why = in_place_possible(fault_of[r], config)
        if why is not None:
            return NoRecovery(f"rank {r}: {why}")
    gone = _ranks_of(groups, lambda s: not s[_ALIVE] or s[_EXIT] is not None)
    if gone:
        return NoRecovery(f"ranks {summarise_ranks(gone)} are gone (restarting a worker is "
                          "--enable-worker-reboot's job)")
    not_parked = _ranks_of(groups, lambda s: s[_FAULT] is None or not s[_STOPPED])
    if not_parked:
        return NoRecovery(f"ranks {summarise_ranks(not_parked)} did not leave their step")
    outside = [(min(members), state[_WHERE]) for state, members in groups.items() if state[_WHERE] not in IN_STEP]
    if outside:
        r, where = min(outside)
        return NoRecovery(f"rank {r} was stopped outside train_step ({where}): the step cannot be re-run there")
    found = _situation(ranks, groups)
    if isinstance(found, NoRecovery):
        return found
    mode, k, needs = found
    done, limit, over = retry_limit(history, mode, k, config, ", --ha-network-retries")
    if over is not None:
        return over
    damaged = [r for r in fault_ranks if fault_of[r] is FaultKind.UCE]
    repairs, orphans = sources(ranks, needs, ranks)
    kind = FaultKind.UCE if damaged else FaultKind.NETWORK
    named = [r for r in fault_ranks if fault_of[r] is kind]  # the rank the reason names has that kind
    if not named:
        return _nothing_to_repair(sorted(fault_ranks))
    first = fault_rank if fault_rank in named else min(named)
    return _finish(RecoveryPlan(iteration=k, generation=len(history) + 1, kind=kind, fault_rank=first,
                                repairs=repairs, mode=mode), ranks, orphans, bool(config.hbm_repair and damaged),
                   done, limit)


def _situation(ranks: Mapping[int, RankInfo], groups: ParkedStates):
    """Rule 3 (:func:`~.recovery.situation`) on the groups: the same situation or the same NoRecovery."""
    in_update = _ranks_of(groups, lambda s: s[_WHERE] in IN_UPDATE)
    if in_update:
        outside = _ranks_of(groups, lambda s: s[_WHERE] not in IN_UPDATE)
        if outside:
            r = outside[0]
            return NoRecovery(f"ranks {summarise_ranks(in_update)} were stopped inside the optimizer update "
                              f"but rank {r} was not ({ranks[r].fault_where or 'train_step'} of iteration "
                              f"{ranks[r].fault_iteration})")
        its = {state[_FAULT_IT] for state in groups}
        if len(its) != 1:
            return NoRecovery(f"the ranks were stopped inside the optimizer updates of different iterations "
                              f"{sorted(its)}")
        j = next(iter(its))

        def off(s: Tuple[Any, ...]) -> bool:
            want = OptimizerStatus.UPDATED if s[_WHERE] == StepPosition.UPDATE_DONE else OptimizerStatus.UPDATING
            return (s[_STATUS], s[_ITERATION]) != (want, j)
        wrong = [(min(members), state) for state, members in groups.items() if off(state)]
        if wrong:
            r, state = min(wrong, key=lambda w: w[0])
            return NoRecovery(f"rank {r} reports {state[_STATUS].value}@{state[_ITERATION]} while stopped at "
                              f"{state[_WHERE]} of iteration {j}")
        needs = set(_ranks_of(groups, lambda s: s[_WHERE] == StepPosition.UPDATE or s[_FAULT] is FaultKind.UCE))
        return RecoveryMode.FORWARD, j, needs
    states = {(state[_STATUS], state[_ITERATION]) for state in groups}
    if len(states) != 1 or next(iter(states))[0] is not OptimizerStatus.UPDATED:
        return update_split(max(state[_ITERATION] for state in groups), states)
    k = next(iter(states))[1]
    if k < 0:
        return NoRecovery("no rank has reached its first optimizer update")
    behind = _ranks_of(groups, lambda s: s[_FAULT_IT] not in (-1, k + 1))
    if behind:
        r = behind[0]
        return NoRecovery(f"rank {r} was stopped in train_step of iteration {ranks[r].fault_iteration}, not "
                          f"{k + 1}: after its update of {k} (a step cannot be re-run after its update)")
    return RecoveryMode.ROLLBACK, k, set(_ranks_of(groups, lambda s: s[_FAULT] is FaultKind.UCE))


def plan_in_place_by_rules(ranks: Mapping[int, RankInfo], fault_rank: int, config: HAConfig,
                           history: Sequence[Mapping[str, Any]] = ()) -> Union[RecoveryPlan, NoRecovery]:
    """:func:`plan_in_place` as the rules of :mod:`.recovery` are written, rank by rank (about a
    dozen passes over every rank): the reference the tests compare :func:`plan_in_place` with."""
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
    if not named:
        return _nothing_to_repair(sorted(faults))
    first = fault_rank if fault_rank in named else min(named)
    return _finish(RecoveryPlan(iteration=k, generation=len(history) + 1, kind=kind, fault_rank=first,
                                repairs=repairs, mode=mode), ranks, orphans, bool(config.hbm_repair and damaged),
                   done, limit)


def _nothing_to_repair(fault_ranks: Sequence[int]) -> NoRecovery:
    """Rule 1 when the only faults of their own are process faults of live ranks (a rank saw a
    peer's process die, ``--enable-worker-reboot`` is on, yet every rank is alive and parked
    and none is being restarted): nothing in place repairs that; the fall-back saves."""
    return NoRecovery(f"ranks {summarise_ranks(list(fault_ranks))} reported a process fault but every rank is "
                      "alive and none is being restarted: nothing to repair in place")


def _finish(plan: RecoveryPlan, ranks: Mapping[int, RankInfo], orphans: List[int], reload_allowed: bool,
            done: int, limit: int) -> Union[RecoveryPlan, NoRecovery]:
    """The plan with its reason (rule 4 without a source: :func:`_reload`)."""
    if orphans:
        return _reload(plan, ranks, orphans[0], reload_allowed)
    k, kind, first, repairs = plan.iteration, plan.kind, plan.fault_rank, plan.repairs
    if plan.mode is RecoveryMode.FORWARD:
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


__all__ = ["parked_states", "plan_in_place", "plan_in_place_by_rules", "plan_recovery"]
