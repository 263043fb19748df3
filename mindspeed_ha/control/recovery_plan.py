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
2. Every rank of the job is alive and parked inside ``train_step`` of iteration k+1 (a
   fault raised between iterations, in a save, in evaluation, or in the part of step k
   after its optimizer update cannot re-run a step).
3. Every rank's optimizer status is UPDATED at the same iteration k: nobody started the
   update of k+1. A fault inside the update of k+1 (some rank UPDATING(k+1) or already
   UPDATED(k+1)) would need the step rolled forward on some ranks and back on others;
   not done in place: the dying checkpoint keeps every completed iteration.
4. Every damaged rank (UCE) has a healthy replica holder: a rank with the same (tp, pp,
   distributed-optimizer shard), i.e. the same model parameters and optimizer shard. The
   lowest such rank is the source. Without replicas (``--distributed-optimizer-no-replica``,
   or a distributed optimizer with one instance) there is none: the dying checkpoint.
5. Iteration k+1 was not already re-run ``network_retries`` times in a row (any kind):
   a fault that comes back every time ends in the dying checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.state import OptimizerStatus, RankInfo
from mindspeed_ha.faults import FaultKind

#: fault kinds that can be recovered in place (the others: the dying checkpoint)
IN_PLACE_KINDS = frozenset({FaultKind.UCE, FaultKind.NETWORK})


@dataclasses.dataclass(frozen=True)
class RecoveryPlan:
    """What every rank does to recover in place.

    Attributes:
        iteration: k, the iteration every rank's state is at after recovery; k+1 re-runs.
        generation: the process-group generation the ranks build (1 for the first recovery).
        kind: the fault kind that started it (UCE or NETWORK; UCE if any rank had one).
        fault_rank: the first rank that reported the fault.
        repairs: damaged rank -> source rank (same tp, pp, shard) that sends it its state.
        reason: one human-readable sentence.
    """

    iteration: int
    generation: int
    kind: FaultKind
    fault_rank: int
    repairs: Dict[int, int] = dataclasses.field(default_factory=dict)
    reason: str = ""

    def to_params(self) -> Dict[str, Any]:
        """msgpack-able form (the RETRY action's params)."""
        return {"iteration": self.iteration, "generation": self.generation, "kind": self.kind.value,
                "fault_rank": self.fault_rank, "repairs": [[d, s] for d, s in sorted(self.repairs.items())],
                "reason": self.reason}

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "RecoveryPlan":
        return cls(iteration=int(params["iteration"]), generation=int(params["generation"]),
                   kind=FaultKind(params["kind"]), fault_rank=int(params["fault_rank"]),
                   repairs={int(d): int(s) for d, s in params.get("repairs", ())},
                   reason=str(params.get("reason", "")))


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
            whose step the recovery interrupted), ``fault_where``, and its authoritative
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
    faults = {r: i.fault for r, i in ranks.items() if i.fault not in (None, FaultKind.ABORTED)}
    if not faults:
        return NoRecovery("no rank reported a fault of its own")
    for r, kind in sorted(faults.items()):
        why = in_place_possible(kind, config)
        if why is not None:
            return NoRecovery(f"rank {r}: {why}")
    gone = [r for r, i in sorted(ranks.items()) if not i.alive or i.exit_code is not None]
    if gone:
        return NoRecovery(f"ranks {gone} are gone (restarting a worker is --enable-worker-reboot's job)")
    not_parked = [r for r, i in sorted(ranks.items()) if i.fault is None or not i.stopped]
    if not_parked:
        return NoRecovery(f"ranks {not_parked} did not leave their step")
    outside = {r: i.fault_where for r, i in sorted(ranks.items()) if i.fault_where not in ("", "train_step")}
    if outside:
        r, where = next(iter(outside.items()))
        return NoRecovery(f"rank {r} was stopped outside train_step ({where}): the step cannot be re-run there")
    states = {(i.status, i.iteration) for i in ranks.values()}
    if len(states) != 1 or next(iter(states))[0] is not OptimizerStatus.UPDATED:
        hi = max(i.iteration for i in ranks.values())  # UPDATING@j: inside update j; UPDATED@j: j done
        return NoRecovery(
            f"the fault hit the optimizer update of iteration {hi} (optimizer states "
            f"{sorted({f'{s.value}@{k}' for s, k in states})}): in-place recovery needs every rank at the end "
            "of the same iteration, before any rank starts the next update")
    k = next(iter(states))[1]
    if k < 0:
        return NoRecovery("no rank has reached its first optimizer update")
    behind = sorted(r for r, i in ranks.items() if i.fault_iteration not in (-1, k + 1))
    if behind:
        r = behind[0]
        return NoRecovery(f"rank {r} was stopped in train_step of iteration {ranks[r].fault_iteration}, not "
                          f"{k + 1}: after its update of {k} (a step cannot be re-run after its update)")
    done = consecutive_retries(history, k)
    limit = max(1, config.network_retries)
    if done >= limit:
        return NoRecovery(f"iteration {k + 1} was already re-run {done} times in a row (limit {limit}, "
                          "--ha-network-retries)")
    damaged = sorted(r for r, kind in faults.items() if kind is FaultKind.UCE)
    repairs: Dict[int, int] = {}
    for d in damaged:
        key = ranks[d].layout.shard_key
        sources = [r for r, i in sorted(ranks.items()) if r != d and i.layout.shard_key == key
                   and i.fault is not FaultKind.UCE]
        if not sources:
            return NoRecovery(f"rank {d} has a device memory error and no healthy replica holds its state "
                              f"(tp={key[0]}, pp={key[1]}, shard={key[2]}); reloading the latest periodic "
                              "checkpoint in place is not implemented: the dying checkpoint")
        repairs[d] = sources[0]
    kind = FaultKind.UCE if damaged else FaultKind.NETWORK
    first = fault_rank if fault_rank in faults else min(faults)
    what = (f"repair ranks {damaged} from replicas {[repairs[d] for d in damaged]}" if damaged
            else "rebuild communication")
    return RecoveryPlan(iteration=k, generation=len(history) + 1, kind=kind, fault_rank=first, repairs=repairs,
                        reason=f"{kind.value} fault on rank {first}: every rank is at the end of iteration {k}; "
                               f"{what}, roll back and re-run iteration {k + 1} (re-run {done + 1}; at most {limit} in a row)")


__all__ = ["RecoveryPlan", "NoRecovery", "plan_recovery", "in_place_possible", "consecutive_retries",
           "IN_PLACE_KINDS"]
