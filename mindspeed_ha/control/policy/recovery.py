"""In-place recovery plans: their types and the rules they follow. Pure: no I/O, no clocks, no torch.

When a rank reports a device memory error (UCE, with ``--enable-hbmfault-repair``) or a
network error (with the master switch, ``--ha-network-retries`` > 0), the controller
aborts every rank's step (STOP with ``recover``), waits until every rank is parked in
its fault handler, then calls :func:`~mindspeed_ha.control.policy.in_place.plan_recovery`
on what they reported. The plan says which iteration every rank returns to and who
repairs whom; the ranks carry it out in stages (clean, rebuild groups, repair, roll
back, re-run the step; the rank runtime runs the stages of ``plan.mode``). Anything
the plan cannot cover falls back to the dying checkpoint (:class:`NoRecovery` says
why), so nothing loops.

Rules (in order; the first that fails gives :class:`NoRecovery`):

1. Every fault is a UCE (needs ``hbm_repair``), a network error (needs
   ``network_retries`` > 0), an abort caused by the recovery itself, or a survivor's
   process fault (a peer crashed; needs ``worker_reboot``). An unknown error: the dying
   checkpoint. A dead process: the worker-restart plan (ARF, below) or the dying checkpoint.
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
rejoin point (``fault_where == "rejoin"``) and the rules apply to the survivors
(:mod:`mindspeed_ha.control.policy.arf`):

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
  the rank runtime's catch-up step), so it takes part in every
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
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.state import (IN_STEP, IN_UPDATE, OptimizerStatus, RankInfo, StepPosition, WireEnum,
                                        summarise_ranks)
from mindspeed_ha.faults import FaultKind

#: fault_where of a restarted process (ARF) parked at its rejoin point
REJOIN = StepPosition.REJOIN.value


class RecoveryMode(WireEnum):
    """What the ranks do (the module docstring says which when); the value is the wire string."""

    ROLLBACK = "rollback"
    FORWARD = "forward"
    RELOAD = "reload"
    REJOIN = "rejoin"
    SWITCH = "switch"  # a hot switch's new process (its rejoin; control/policy/switch.py)
    #: a hot switch's replica fallback: its outgoing process died in its handoff, its new
    #: process is repaired from a replica holder on the switch's groups (no rebuild)
    SWITCH_REPAIR = "switch_repair"


#: every mode's wire string
MODES = tuple(m.value for m in RecoveryMode)


@dataclasses.dataclass(frozen=True)
class RecoveryPlan:
    """What every rank does to recover in place (the RETRY action's plan).

    Attributes:
        iteration: the iteration every rank's state is at after recovery. ``rollback``
            and ``rejoin``: k, and k+1 re-runs; ``forward``: j, whose update every rank
            then has finished (the step goes on after its update); ``reload``: k, the
            last iteration every rank completed (the iterations after the periodic
            checkpoint up to k re-run silently, then k+1 re-runs).
        generation: the process-group generation the ranks build (1 for the first recovery).
        kind: the fault kind that started it: UCE (if any rank had one) or NETWORK for a
            recovery of live ranks, PROCESS when a restarted worker rejoins (ARF).
        fault_rank: the first rank that reported the fault.
        repairs: damaged (or restarted) rank -> source rank (same tp, pp, shard) that sends
            it its state (``reload`` with ``rejoin``: its counters).
        reason: one human-readable sentence.
        mode: a :class:`RecoveryMode` (a plain string of :data:`MODES` is converted;
            anything else raises ValueError).
        rejoin: ranks whose process the launcher restarted (``rejoin`` mode, or
            ``forward`` / ``reload`` with ARF): they join the new group generation and
            receive their whole state (``repairs``).
    """

    iteration: int
    generation: int
    kind: FaultKind
    fault_rank: int
    repairs: Dict[int, int] = dataclasses.field(default_factory=dict)
    reason: str = ""
    mode: RecoveryMode = RecoveryMode.ROLLBACK
    rejoin: Tuple[int, ...] = ()

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"RecoveryPlan.mode must be one of {MODES}, got {self.mode!r}")
        object.__setattr__(self, "mode", RecoveryMode(self.mode))

    def to_params(self) -> Dict[str, Any]:
        """msgpack-able form (the RETRY action's params; ``mode`` as a plain string)."""
        return {"iteration": self.iteration, "generation": self.generation, "kind": self.kind.value,
                "fault_rank": self.fault_rank, "repairs": [[d, s] for d, s in sorted(self.repairs.items())],
                "reason": self.reason, "mode": self.mode.value,
                "rejoin": list(self.rejoin)}

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "RecoveryPlan":
        """Inverse of :meth:`to_params` (used by the rank runtime)."""
        return cls(iteration=int(params["iteration"]), generation=int(params["generation"]),
                   kind=FaultKind(params["kind"]), fault_rank=int(params["fault_rank"]),
                   repairs={int(d): int(s) for d, s in params.get("repairs", ())},
                   reason=str(params.get("reason", "")), mode=str(params.get("mode", "rollback")),
                   rejoin=tuple(int(r) for r in params.get("rejoin", ())))


@dataclasses.dataclass(frozen=True)
class NoRecovery:
    """The fault cannot be recovered in place; ``reason`` says why (the dying checkpoint follows)."""

    reason: str


#: (mode, k, ranks that need a state from a source): the situation the ranks are in
Situation = Tuple[RecoveryMode, int, Set[int]]


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
    """How many of the latest recoveries (newest backwards) left the ranks at ``iteration``
    (a hot switch's record, mode ``switch``, is no retry: skipped)."""
    n = 0
    for entry in reversed(history):
        if entry.get("mode") == RecoveryMode.SWITCH.value:
            continue
        if int(entry.get("iteration", -1)) != iteration:
            break
        n += 1
    return n


def retry_limit(history: Sequence[Mapping[str, Any]], mode: RecoveryMode, k: int, config: HAConfig,
                flag: str = "") -> Tuple[int, int, Optional[NoRecovery]]:
    """Rule 5: (recoveries of this step in a row, the limit, NoRecovery once it is reached)."""
    done = consecutive_retries(history, k)
    limit = max(1, config.network_retries)
    if done < limit:
        return done, limit, None
    step = k + 1 if mode is RecoveryMode.ROLLBACK else k
    return done, limit, NoRecovery(f"iteration {step} was already recovered {done} times in a row "
                                   f"(limit {limit}{flag})")


def absent(ranks: Mapping[int, RankInfo], parked: Mapping[int, RankInfo], why_gone: str = "") -> Optional[NoRecovery]:
    """NoRecovery if a rank of ``ranks`` is gone or one of ``parked`` did not leave its step."""
    gone = sorted(r for r, i in ranks.items() if not i.alive or i.exit_code is not None)  # O(N): few are
    if gone:
        return NoRecovery(f"ranks {summarise_ranks(gone)} are gone{why_gone}")
    not_parked = sorted(r for r, i in parked.items() if i.fault is None or not i.stopped)
    if not_parked:
        return NoRecovery(f"ranks {summarise_ranks(not_parked)} did not leave their step")
    return None


def outside_step(ranks: Mapping[int, RankInfo]) -> Optional[Tuple[int, str]]:
    """(rank, where) of the first rank stopped outside ``train_step`` (rule 2), or None."""
    return min(((r, i.fault_where) for r, i in ranks.items() if i.fault_where not in IN_STEP), default=None)


def situation(ranks: Mapping[int, RankInfo]) -> Union[Situation, NoRecovery]:
    """Rule 3: roll forward when some rank was stopped inside the optimizer update, else roll back."""
    in_update = {r for r, i in ranks.items() if i.fault_where in IN_UPDATE}
    if in_update:
        return _forward_situation(ranks, in_update)
    return _rollback_situation(ranks)


def update_split(hi: int, states) -> NoRecovery:
    """Rule 3's NoRecovery when the ranks' optimizer states differ (``states``: the distinct
    (status, iteration) pairs; ``hi``: the highest iteration among them)."""
    return NoRecovery(
        f"the fault hit the optimizer update of iteration {hi} (optimizer states "
        f"{sorted({f'{s.value}@{k}' for s, k in states})}) while some ranks were outside it: in-place "
        "recovery needs every rank at the end of the same iteration, or every rank inside the same update")


def _rollback_situation(ranks: Mapping[int, RankInfo]) -> Union[Situation, NoRecovery]:
    """(ROLLBACK, k, ranks needing a repair) or NoRecovery (rule 3, rollback)."""
    states = {(i.status, i.iteration) for i in ranks.values()}
    if len(states) != 1 or next(iter(states))[0] is not OptimizerStatus.UPDATED:
        hi = max(i.iteration for i in ranks.values())  # UPDATING@j: inside update j; UPDATED@j: j done
        return update_split(hi, states)
    k = next(iter(states))[1]
    if k < 0:
        return NoRecovery("no rank has reached its first optimizer update")
    behind = sorted(r for r, i in ranks.items() if i.fault_iteration not in (-1, k + 1))
    if behind:
        r = behind[0]
        return NoRecovery(f"rank {r} was stopped in train_step of iteration {ranks[r].fault_iteration}, not "
                          f"{k + 1}: after its update of {k} (a step cannot be re-run after its update)")
    needs = {r for r, i in ranks.items() if i.fault is FaultKind.UCE}
    return RecoveryMode.ROLLBACK, k, needs


def _forward_situation(ranks: Mapping[int, RankInfo], in_update: Set[int]) -> Union[Situation, NoRecovery]:
    """(FORWARD, j, ranks needing the finished state) or NoRecovery (rule 3, roll forward)."""
    outside = sorted(set(ranks) - set(in_update))
    if outside:
        r = outside[0]
        return NoRecovery(f"ranks {summarise_ranks(sorted(in_update))} were stopped inside the optimizer update "
                          f"but rank {r} was not ({ranks[r].fault_where or 'train_step'} of iteration {ranks[r].fault_iteration})")
    its = {i.fault_iteration for i in ranks.values()}
    if len(its) != 1:
        return NoRecovery(f"the ranks were stopped inside the optimizer updates of different iterations {sorted(its)}")
    j = next(iter(its))
    for r, i in sorted(ranks.items()):
        want = OptimizerStatus.UPDATED if i.fault_where == StepPosition.UPDATE_DONE else OptimizerStatus.UPDATING
        if (i.status, i.iteration) != (want, j):
            return NoRecovery(f"rank {r} reports {i.status.value}@{i.iteration} while stopped at "
                              f"{i.fault_where} of iteration {j}")
    needs = {r for r, i in ranks.items() if i.fault_where == StepPosition.UPDATE or i.fault is FaultKind.UCE}
    return RecoveryMode.FORWARD, j, needs


def sources(ranks: Mapping[int, RankInfo], needs: Set[int], donors: Mapping[int, RankInfo]
            ) -> Tuple[Dict[int, int], List[int]]:
    """Rule 4: (rank -> its source, ranks without one). A source is the lowest rank of
    ``donors`` that needs nothing itself, has no UCE and holds the same (tp, pp, shard).
    O(needs x holders of a part) when ``donors`` is ``ranks`` and a
    :class:`~mindspeed_ha.control.holders.RankTable` (the controller's), else O(needs x donors)."""
    repairs: Dict[int, int] = {}
    orphans: List[int] = []
    table = getattr(ranks, "holders", None)  # a RankTable keeps each part's holders by rank (control/holders.py)
    if donors is ranks and table is not None and len(table) == len(ranks):
        for d in sorted(needs):  # the part's holders in rank order: the first that qualifies is the lowest
            found = next((r for r, i in table.holders_of(ranks[d].layout.shard_key)
                          if r not in needs and i.fault is not FaultKind.UCE), None)
            if found is not None:
                repairs[d] = found
            else:
                orphans.append(d)
        return repairs, orphans
    for d in sorted(needs):
        key = ranks[d].layout.shard_key
        found = min((r for r, i in donors.items() if r not in needs and i.layout.shard_key == key
                     and i.fault is not FaultKind.UCE), default=None)  # no sort of all N per rank
        if found is not None:
            repairs[d] = found
        else:
            orphans.append(d)
    return repairs, orphans


__all__ = ["IN_STEP", "MODES", "REJOIN", "NoRecovery", "RecoveryMode", "RecoveryPlan", "Situation", "absent",
           "consecutive_retries", "in_place_possible", "outside_step", "retry_limit", "situation", "sources",
           "update_split"]
