"""In-place recovery plan: pure policy, no I/O, no clocks, no torch.

When a rank reports a device memory error (UCE, with ``--enable-hbmfault-repair``) or a
network error (with the master switch, ``--ha-network-retries`` > 0), the controller
aborts every rank's step (STOP with ``recover``), waits until every rank is parked in
its fault handler, then calls :func:`plan_recovery` on what they reported. The plan
says which iteration every rank returns to and who repairs whom; the ranks carry it
out in stages (clean, rebuild groups, repair, roll back, re-run the step; see
:meth:`mindspeed_ha.runtime.HARuntime.recover`). Anything the plan cannot cover falls
back to the dying checkpoint (:class:`NoRecovery` says why), so nothing loops.

Rules (in order; the first that fails gives :class:`NoRecovery`):

1. Every fault is a UCE (needs ``hbm_repair``), a network error (needs
   ``network_retries`` > 0) or an abort caused by the recovery itself. A dead process,
   an unknown error: the dying checkpoint (worker restart is ARF's job).
2. Every rank of the job is alive and parked inside ``train_step`` (a fault raised
   between iterations, in a save or in evaluation cannot re-run or finish a step).
3. The ranks are in one of two consistent situations (anything else: the dying
   checkpoint keeps every completed iteration):

   * **rollback** (mode ``"rollback"``): every rank's optimizer status is UPDATED at the
     same iteration k and every rank was stopped in step k+1 before its update
     (``where == "train_step"``). Every rank returns to the end of k and re-runs k+1.
   * **roll forward** (mode ``"forward"``): every rank was stopped inside the optimizer
     update of the same iteration j (``where`` ``"update"``: its update did not finish,
     status UPDATING(j); or ``"update_done"``: it finished, status UPDATED(j), and waits
     in the update's commit barrier, see :mod:`patches.optimizer`). The commit barrier
     keeps every rank inside the update of j until all finished it, so no rank is
     further. Every rank whose update did not finish (or whose memory is damaged)
     receives the finished state of j from a rank that finished it; then every rank
     continues step j after its update.

4. Every rank that needs a repair has a source: a healthy rank with the same (tp, pp,
   distributed-optimizer shard), i.e. the same model parameters and optimizer shard
   (rollback: any rank without a UCE; roll forward: a rank whose update finished). The
   lowest such rank is the source. Where one has none (``--distributed-optimizer-no-replica``,
   a distributed optimizer with one instance, every replica damaged) the plan is mode
   ``"reload"`` (only for a UCE with ``hbm_repair``): every rank reloads the latest
   periodic checkpoint in place and re-runs the iterations after it (k = the last
   iteration every rank completed).
5. The step was not already recovered ``network_retries`` times in a row (any kind): a
   fault that comes back every time ends in the dying checkpoint.

Worker restart (ARF, ``--enable-worker-reboot``): the restarted processes wait at their
rejoin point (``fault_where == "rejoin"``) and the rules apply to the survivors:

* every survivor in the rollback situation: mode ``"rejoin"``; each restarted rank gets
  the state of k and the progress of k from a survivor with its (tp, pp, shard), every
  rank re-runs k+1;
* every survivor inside the optimizer update of j (the death hit that update; the commit
  barrier, on with worker reboot too, holds every survivor there): mode ``"forward"``
  with ``rejoin`` set. A survivor's pre-update state of j is gone once its update ran
  (the update mutates in place), so rolling back is never exact here; rolling forward
  is: each restarted rank (and each survivor whose update did not finish) gets the
  finished state of j from a survivor with its (tp, pp, shard) that finished it, plus
  (restarted ranks) the progress as at the entry of j's update; the restarted process
  then runs a catch-up step j (the script's own ``train_step`` and loop, with the
  forward-backward and the optimizer step answered from the source's results of j:
  :meth:`mindspeed_ha.runtime.HARuntime.enter_iteration`), so it takes part in every
  collective the survivors run in the rest of step j;
* no survivor holds a restarted rank's state (``--distributed-optimizer-no-replica``, one
  optimizer instance, or no replica finished the update): mode ``"reload"`` with
  ``rejoin`` set (k = the last iteration every survivor completed): every survivor
  reloads the latest periodic checkpoint in place (:mod:`mindspeed_ha.recovery.reload`),
  the restarted process loads the same checkpoint at its rejoin point and receives the
  counters of k from ``repairs[rank]``; everyone re-runs the iterations after the
  checkpoint silently, then k+1. No checkpoint, or not replayable: the ranks find out
  before touching their state and the job takes the dying checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.state import OptimizerStatus, RankInfo
from mindspeed_ha.faults import FaultKind

#: fault kinds that can be recovered in place (the others: the dying checkpoint)
IN_PLACE_KINDS = frozenset({FaultKind.UCE, FaultKind.NETWORK})
#: where a rank may be stopped for an in-place recovery: in its step before the optimizer
#: update, inside the update (not finished), or in the update's commit barrier (finished)
IN_STEP = frozenset({"", "train_step", "update", "update_done"})
#: what the ranks do (see the module docstring)
MODES = ("rollback", "forward", "reload", "rejoin")
#: fault_where of a restarted process (ARF) parked at its rejoin point, after it built its
#: model and optimizer (fresh, no checkpoint) and before its data iterators
REJOIN = "rejoin"


@dataclasses.dataclass(frozen=True)
class RecoveryPlan:
    """What every rank does to recover in place.

    Attributes:
        iteration: the iteration every rank's state is at after recovery. ``rollback``:
            k, and k+1 re-runs; ``forward``: j, whose update every rank then has finished
            (the step goes on after its update); ``reload``: k, the last iteration every
            rank completed (the iterations after the periodic checkpoint up to k re-run
            silently, then k+1 re-runs).
        generation: the process-group generation the ranks build (1 for the first recovery).
        kind: the fault kind that started it (UCE or NETWORK; UCE if any rank had one).
        fault_rank: the first rank that reported the fault.
        repairs: damaged rank -> source rank (same tp, pp, shard) that sends it its state.
        reason: one human-readable sentence.
        mode: ``rollback``, ``forward``, ``reload`` or ``rejoin`` (the module docstring
            says which when).
        rejoin: ranks whose process the launcher restarted (``rejoin`` mode, or ``forward``
            when the death hit the optimizer update): they join
            the new group generation and receive their whole state (``repairs``).
    """

    iteration: int
    generation: int
    kind: FaultKind
    fault_rank: int
    repairs: Dict[int, int] = dataclasses.field(default_factory=dict)
    reason: str = ""
    mode: str = "rollback"
    rejoin: Tuple[int, ...] = ()

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"RecoveryPlan.mode must be one of {MODES}, got {self.mode!r}")

    def to_params(self) -> Dict[str, Any]:
        """msgpack-able form (the RETRY action's params)."""
        return {"iteration": self.iteration, "generation": self.generation, "kind": self.kind.value,
                "fault_rank": self.fault_rank, "repairs": [[d, s] for d, s in sorted(self.repairs.items())],
                "reason": self.reason, "mode": self.mode,
                "rejoin": list(self.rejoin)}

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "RecoveryPlan":
        return cls(iteration=int(params["iteration"]), generation=int(params["generation"]),
                   kind=FaultKind(params["kind"]), fault_rank=int(params["fault_rank"]),
                   repairs={int(d): int(s) for d, s in params.get("repairs", ())},
                   reason=str(params.get("reason", "")), mode=str(params.get("mode", "rollback")),
                   rejoin=tuple(int(r) for r in params.get("rejoin", ())))


@dataclasses.dataclass(frozen=True)
class NoRecovery:
    """The fault cannot be recovered in place; ``reason`` says why (the dying checkpoint follows)."""

    reason: str


def in_place_possible(kind: FaultKind, config: HAConfig) -> Optional[str]:
    """None when a fault of ``kind`` may be recovered in place under ``config``, else why not."""
    if kind is FaultKind.UCE:
        return None if config.hbm_repair else "UCE repair needs --enable-hbmfault-repair"
    if kind is FaultKind.NETWORK:
        return None if config.network_retries > 0 else "network retry is off (--ha-network-retries 0)"
    if kind is FaultKind.PROCESS:
        return None if config.worker_reboot else "restarting a worker needs --enable-worker-reboot"
    return f"a {kind.value} fault is not recovered in place"


def consecutive_retries(history: Sequence[Mapping[str, Any]], iteration: int) -> int:
    """How many of the latest recoveries (newest backwards) re-ran iteration ``iteration + 1``."""
    n = 0
    for entry in reversed(history):
        if int(entry.get("iteration", -1)) != iteration:
            break
        n += 1
    return n


def plan_recovery(ranks: Mapping[int, RankInfo], world_size: int, fault_rank: int, config: HAConfig,
                  history: Sequence[Mapping[str, Any]] = ()) -> Union[RecoveryPlan, NoRecovery]:
    """Decide the in-place recovery (see the module docstring for the rules).

    Args:
        ranks: rank -> RankInfo; each parked rank has ``fault`` set (ABORTED for ranks
            whose step the recovery interrupted), ``fault_where`` (``train_step``,
            ``update``, ``update_done``), ``fault_iteration``, and its authoritative
            ``status`` / ``iteration`` from STOPPED.
        world_size: ranks in the job.
        fault_rank: the first rank that reported the fault.
        config: the job's HAConfig (``hbm_repair``, ``network_retries``).
        history: earlier recoveries of this job, oldest first (dicts with ``iteration``).

    Returns:
        RecoveryPlan, or NoRecovery naming the first rule that failed.
    """
    missing = sorted(set(range(world_size)) - set(ranks))
    if missing:
        return NoRecovery(f"ranks {missing} never registered")
    rejoining = {r: i for r, i in ranks.items() if i.fault_where == REJOIN}
    if rejoining:
        return _plan_rejoin(ranks, rejoining, fault_rank, config, history)
    faults = {r: i.fault for r, i in ranks.items() if i.fault not in (None, FaultKind.ABORTED)}
    if not faults:
        return NoRecovery("no rank reported a fault of its own")
    for r, kind in sorted(faults.items()):
        why = in_place_possible(kind, config)
        if why is not None:
            return NoRecovery(f"rank {r}: {why}")
    absent = _absent(ranks, ranks, " (restarting a worker is --enable-worker-reboot's job)")
    if absent is not None:
        return absent
    outside = {r: i.fault_where for r, i in sorted(ranks.items()) if i.fault_where not in IN_STEP}
    if outside:
        r, where = next(iter(outside.items()))
        return NoRecovery(f"rank {r} was stopped outside train_step ({where}): the step cannot be re-run there")
    in_update = {r for r, i in ranks.items() if i.fault_where in ("update", "update_done")}
    if in_update:
        situation = _forward_situation(ranks, in_update)
    else:
        situation = _rollback_situation(ranks)
    if isinstance(situation, NoRecovery):
        return situation
    mode, k, needs = situation  # k: the state every rank is at after recovery
    done = consecutive_retries(history, k)
    limit = max(1, config.network_retries)
    if done >= limit:
        return NoRecovery(f"iteration {k + 1 if mode == 'rollback' else k} was already recovered {done} times in "
                          f"a row (limit {limit}, --ha-network-retries)")
    damaged = sorted(r for r, kind in faults.items() if kind is FaultKind.UCE)
    repairs: Dict[int, int] = {}
    orphans: List[int] = []
    for d in sorted(needs):
        key = ranks[d].layout.shard_key
        sources = [r for r, i in sorted(ranks.items()) if r not in needs and i.layout.shard_key == key
                   and i.fault is not FaultKind.UCE]
        if sources:
            repairs[d] = sources[0]
        else:
            orphans.append(d)
    kind = FaultKind.UCE if damaged else FaultKind.NETWORK
    named = [r for r, k in faults.items() if k is kind]  # the rank the reason names has that kind
    first = fault_rank if fault_rank in named else min(named)
    generation = len(history) + 1
    if orphans:
        d = orphans[0]
        key = ranks[d].layout.shard_key
        what = (f"rank {d} has no healthy copy of its state (tp={key[0]}, pp={key[1]}, shard={key[2]}): no replica "
                "holds it")
        if not (config.hbm_repair and damaged):
            return NoRecovery(what + "; reloading the latest periodic checkpoint in place is only done for a UCE "
                              "with --enable-hbmfault-repair")
        last = k - 1 if mode == "forward" else k  # the last iteration every rank completed
        return RecoveryPlan(iteration=last, generation=generation, kind=kind, fault_rank=first, mode="reload",
                            reason=f"{kind.value} fault on rank {first}: {what}; every rank reloads the latest "
                                   f"periodic checkpoint in place and re-runs the iterations after it up to "
                                   f"{last + 1}")
    if mode == "forward":
        what = (f"ranks {sorted(repairs)} receive the finished update from {[repairs[d] for d in sorted(repairs)]}"
                if repairs else "rebuild communication")
        return RecoveryPlan(iteration=k, generation=generation, kind=kind, fault_rank=first, repairs=repairs,
                            mode="forward",
                            reason=f"{kind.value} fault on rank {first} inside the optimizer update of iteration "
                                   f"{k}: {what}, and every rank continues iteration {k} after its update "
                                   f"(recovery {done + 1}; at most {limit} in a row)")
    what = (f"repair ranks {sorted(repairs)} from replicas {[repairs[d] for d in sorted(repairs)]}" if repairs
            else "rebuild communication")
    return RecoveryPlan(iteration=k, generation=generation, kind=kind, fault_rank=first, repairs=repairs,
                        reason=f"{kind.value} fault on rank {first}: every rank is at the end of iteration {k}; "
                               f"{what}, roll back and re-run iteration {k + 1} (re-run {done + 1}; at most "
                               f"{limit} in a row)")


def _plan_rejoin(ranks: Mapping[int, RankInfo], rejoining: Mapping[int, RankInfo], fault_rank: int,
                 config: HAConfig, history: Sequence[Mapping[str, Any]]) -> Union[RecoveryPlan, NoRecovery]:
    """ARF: restarted processes wait at their rejoin point; the survivors must be in the
    rollback situation; each restarted rank gets its whole state from a survivor with the
    same (tp, pp, shard)."""
    why = in_place_possible(FaultKind.PROCESS, config)
    if why is not None:
        return NoRecovery(why)
    fresh = sorted(r for r, i in rejoining.items() if i.incarnation < 1)
    if fresh:
        return NoRecovery(f"ranks {fresh} wait to rejoin but were never restarted (incarnation 0)")
    survivors = {r: i for r, i in ranks.items() if r not in rejoining}
    if not survivors:
        return NoRecovery("every rank was restarted: no survivor holds the state (the dying checkpoint cannot "
                          "either; restart from the latest periodic checkpoint)")
    absent = _absent(ranks, survivors)
    if absent is not None:
        return absent
    for r, i in sorted(survivors.items()):
        if i.fault not in (None, FaultKind.ABORTED, FaultKind.NETWORK):
            why = in_place_possible(i.fault, config)
            if why is not None:
                return NoRecovery(f"rank {r}: {why}")
    outside = {r: i.fault_where for r, i in sorted(survivors.items()) if i.fault_where not in IN_STEP}
    if outside:
        r, where = next(iter(outside.items()))
        return NoRecovery(f"rank {r} was stopped at {where}, not in train_step: a restarted process rejoins only "
                          "a step that every survivor can re-run or finish")
    in_update = {r for r, i in survivors.items() if i.fault_where in ("update", "update_done")}
    if in_update:  # the death hit an optimizer update: every survivor is held inside it (commit barrier)
        situation = _forward_situation(survivors, in_update)
    else:
        situation = _rollback_situation(survivors)
    if isinstance(situation, NoRecovery):
        return situation
    mode, k, damaged = situation
    done = consecutive_retries(history, k)
    limit = max(1, config.network_retries)
    if done >= limit:
        return NoRecovery(f"iteration {k + 1 if mode == 'rollback' else k} was already recovered {done} times in a "
                          f"row (limit {limit})")
    needs = set(rejoining) | set(damaged)
    repairs: Dict[int, int] = {}
    first = fault_rank if fault_rank in rejoining else min(rejoining)
    for d in sorted(needs):
        key = ranks[d].layout.shard_key
        sources = [r for r, i in sorted(survivors.items()) if r not in needs and i.layout.shard_key == key
                   and i.fault is not FaultKind.UCE]
        if not sources:
            what = "finished the update of that iteration" if mode == "forward" else "holds it"
            why = (f"rank {d} has no survivor with its state (tp={key[0]}, pp={key[1]}, shard={key[2]}): "
                   f"no replica {what}")
            # nothing in memory holds it: every rank reloads the latest periodic checkpoint
            # (the restarted ones at their rejoin point) and re-runs the iterations after it;
            # ``repairs`` names the survivor that sends each restarted rank its counters
            last = k - 1 if mode == "forward" else k  # the last iteration every survivor completed
            if last < 0:
                return NoRecovery(why + "; no iteration completed yet")
            src = min(survivors)
            return RecoveryPlan(iteration=last, generation=len(history) + 1, kind=FaultKind.PROCESS, fault_rank=first,
                                repairs={r: src for r in sorted(rejoining)}, mode="reload",
                                rejoin=tuple(sorted(rejoining)),
                                reason=f"ranks {sorted(rejoining)} were restarted; {why}: every rank (the restarted "
                                       f"ones too) reloads the latest periodic checkpoint in place and re-runs the "
                                       f"iterations after it up to {last}, then {last + 1}")
        repairs[d] = sources[0]
    if mode == "forward":
        return RecoveryPlan(iteration=k, generation=len(history) + 1, kind=FaultKind.PROCESS, fault_rank=first,
                            repairs=repairs, mode="forward", rejoin=tuple(sorted(rejoining)),
                            reason=f"ranks {sorted(rejoining)} were restarted inside the optimizer update of "
                                   f"iteration {k}: they rejoin and receive the finished update of {k} from "
                                   f"{[repairs[d] for d in sorted(rejoining)]} and catch up with the rest of step "
                                   f"{k}; every rank continues iteration {k} after its update")
    return RecoveryPlan(iteration=k, generation=len(history) + 1, kind=FaultKind.PROCESS, fault_rank=first,
                        repairs=repairs, mode="rejoin", rejoin=tuple(sorted(rejoining)),
                        reason=f"ranks {sorted(rejoining)} were restarted: they rejoin and receive the state of "
                               f"iteration {k} from {[repairs[d] for d in sorted(rejoining)]}; every rank re-runs "
                               f"iteration {k + 1}")


def _absent(ranks: Mapping[int, RankInfo], parked: Mapping[int, RankInfo], why_gone: str = "") -> Optional[NoRecovery]:
    """NoRecovery if a rank of ``ranks`` is gone or one of ``parked`` did not leave its step."""
    gone = [r for r, i in sorted(ranks.items()) if not i.alive or i.exit_code is not None]
    if gone:
        return NoRecovery(f"ranks {gone} are gone{why_gone}")
    not_parked = [r for r, i in sorted(parked.items()) if i.fault is None or not i.stopped]
    if not_parked:
        return NoRecovery(f"ranks {not_parked} did not leave their step")
    return None


def _rollback_situation(ranks: Mapping[int, RankInfo]):
    """("rollback", k, ranks needing a repair) or NoRecovery (rule 3, rollback)."""
    states = {(i.status, i.iteration) for i in ranks.values()}
    if len(states) != 1 or next(iter(states))[0] is not OptimizerStatus.UPDATED:
        hi = max(i.iteration for i in ranks.values())  # UPDATING@j: inside update j; UPDATED@j: j done
        return NoRecovery(
            f"the fault hit the optimizer update of iteration {hi} (optimizer states "
            f"{sorted({f'{s.value}@{k}' for s, k in states})}) while some ranks were outside it: in-place "
            "recovery needs every rank at the end of the same iteration, or every rank inside the same update")
    k = next(iter(states))[1]
    if k < 0:
        return NoRecovery("no rank has reached its first optimizer update")
    behind = sorted(r for r, i in ranks.items() if i.fault_iteration not in (-1, k + 1))
    if behind:
        r = behind[0]
        return NoRecovery(f"rank {r} was stopped in train_step of iteration {ranks[r].fault_iteration}, not "
                          f"{k + 1}: after its update of {k} (a step cannot be re-run after its update)")
    needs = {r for r, i in ranks.items() if i.fault is FaultKind.UCE}
    return "rollback", k, needs


def _forward_situation(ranks: Mapping[int, RankInfo], in_update):
    """("forward", j, ranks needing the finished state) or NoRecovery (rule 3, roll forward)."""
    outside = sorted(set(ranks) - set(in_update))
    if outside:
        r = outside[0]
        return NoRecovery(f"ranks {sorted(in_update)} were stopped inside the optimizer update but rank {r} was "
                          f"not ({ranks[r].fault_where or 'train_step'} of iteration {ranks[r].fault_iteration})")
    its = {i.fault_iteration for i in ranks.values()}
    if len(its) != 1:
        return NoRecovery(f"the ranks were stopped inside the optimizer updates of different iterations {sorted(its)}")
    j = next(iter(its))
    for r, i in sorted(ranks.items()):
        want = OptimizerStatus.UPDATED if i.fault_where == "update_done" else OptimizerStatus.UPDATING
        if (i.status, i.iteration) != (want, j):
            return NoRecovery(f"rank {r} reports {i.status.value}@{i.iteration} while stopped at "
                              f"{i.fault_where} of iteration {j}")
    needs = {r for r, i in ranks.items() if i.fault_where == "update" or i.fault is FaultKind.UCE}
    return "forward", j, needs


__all__ = ["IN_STEP", "MODES", "REJOIN", "RecoveryPlan", "NoRecovery", "plan_recovery", "in_place_possible", "consecutive_retries",
           "IN_PLACE_KINDS"]
