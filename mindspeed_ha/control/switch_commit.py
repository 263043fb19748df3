"""A hot switch after its commit point (controller side): the answers each of its plans waits
for (:class:`Answers`), and the replica fallback (:class:`ReplicaFallback`).

The replica fallback: the outgoing process of a switched rank R died in the middle of its
handoff (after every group was rebuilt with R's new process in its place), and a live staying
rank holds R's (tp, pp, optimizer shard) (:func:`.policy.switch.committed`: FALLBACK). The
switch takes that death, not the job's fault handling: R's new process stands for R in
``ClusterState`` at once (:meth:`ReplicaFallback.claim`; the old RankInfo is kept aside), so
the pause's decision sees no dead rank. Once the new process failed its handoff and waits at
its rejoin point again, a second plan (:meth:`ReplicaFallback.plan`: mode ``switch_repair``,
the switch's generation: every group stays as rebuilt) has the holder send it the state of K
and the progress at the pause, as ARF's rejoin repair does for a restarted process
(recovery/stages.py). A FAIL gives the deaths back (:meth:`ReplicaFallback.restore`): the
job's fault handling follows (the dying checkpoint of K, from the replicas).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from mindspeed_ha.control import job_events
from mindspeed_ha.control.policy.recovery import RecoveryMode, RecoveryPlan
from mindspeed_ha.control.policy.switch import Switch, SwitchStep
from mindspeed_ha.control.state import ClusterState, OptimizerStatus, RankInfo
from mindspeed_ha.faults import FaultKind

if TYPE_CHECKING:
    from mindspeed_ha.control.controller import Controller

log = logging.getLogger("mindspeed_ha.control.controller")

#: who answers: ``("rank", r)`` (a rank's process) or ``("incoming", r)`` (rank r's new process)
Who = Tuple[str, int]
#: (published stage, key of an answer's seconds): the switch's plan (the outgoing process's
#: ``transfer``, its new process's ``repair``: the same handoff), the replica fallback's plan
SWITCH_STAGES = (("rebuild", "rebuild"), ("transfer", "transfer"), ("transfer", "repair"))
FALLBACK_STAGES = (("repair", "repair"),)


class Answers:
    """The answers one plan waits for: who answers which action id, what each answered."""

    def __init__(self, deadline: Optional[float] = None) -> None:
        self.waiting: Dict[Who, int] = {}
        self.answers: Dict[Who, Tuple[bool, str]] = {}
        #: when the answers are due (controller clock, s); None: no plan out
        self.deadline = deadline

    def expect(self, who: Who, action_id: int) -> None:
        self.waiting[who] = int(action_id)

    def note(self, who: Who, action_id: int, ok: bool, detail: str) -> bool:
        """An ACTION_RESULT; False when ``who`` was not asked ``action_id`` (e.g. a late answer
        to an earlier plan)."""
        if self.waiting.get(who) != action_id:
            return False
        self.answers[who] = (bool(ok), str(detail))
        return True

    def failed(self) -> Dict[Who, str]:
        return {who: detail for who, (ok, detail) in self.answers.items() if not ok}

    def late(self) -> List[Who]:
        return [who for who in self.waiting if who not in self.answers]

    def stage_seconds(self, keys: Sequence[Tuple[str, str]], before: Mapping[str, float]) -> Dict[str, float]:
        """``before`` with the slowest ok answer's seconds per published stage (``keys``)."""
        stages = dict(before)
        for ok, detail in self.answers.values():
            try:
                seconds = json.loads(detail) if ok else {}
            except ValueError:
                continue
            for name, key in keys:
                if isinstance(seconds, dict) and isinstance(seconds.get(key), (int, float)):
                    stages[name] = max(stages.get(name, 0.0), float(seconds[key]))
        return stages


class ReplicaFallback:
    """The replica fallback of the switch under way (see the module doc)."""

    def __init__(self) -> None:
        #: switched ranks whose new process, its handoff failed, waits at its rejoin point again
        self.parked_again: Set[int] = set()
        #: switched rank -> the RankInfo of its dead outgoing process, while its new one stands for it
        self.claimed: Dict[int, RankInfo] = {}

    def claim(self, ctl: "Controller", now: float, sw: Switch, decision: SwitchStep,
              infos: Mapping[int, RankInfo]) -> None:
        """FALLBACK: ``sw.fallback`` = the holders; each dead outgoing process's RankInfo is
        kept aside and its new process's (``infos``) stands for the rank, UPDATED at K as the
        others; the old connection (and a close of it already read) no longer carries the
        rank. The new process's frames still go to the switch desk until the switch ends."""
        st, server = ctl.state, ctl.server
        sw.fallback = dict(decision.sources)
        sw.mark("died", now)
        for r in sorted(sw.fallback):
            self.claimed[r] = st.ranks[r]
            info = infos[r]
            info.status, info.iteration = OptimizerStatus.UPDATED, int(sw.iteration if sw.iteration is not None else -1)
            st.ranks[r] = info
            old_ident = server.ident.get(r)
            if old_ident is not None:
                server.rank_of_ident.pop(old_ident, None)
            server.forget_rank(r)
        ctl.failover.roster_dirty = True
        log.warning("hot switch of ranks %s: %s", list(sw.ranks), decision.reason)
        job_events.note(ctl.recorder, "SwitchFallback", sw.iteration, ranks=sorted(sw.fallback),
                        reason=decision.reason, sources={str(r): s for r, s in sorted(sw.fallback.items())},
                        request_id=sw.request_id)

    def restore(self, state: ClusterState) -> None:
        """A FAIL: the dead outgoing processes' RankInfo back in ``state`` (their deaths are
        the job's fault handling's again)."""
        for r, old in sorted(self.claimed.items()):
            state.ranks[r] = old
        self.claimed = {}

    @staticmethod
    def plan(state: ClusterState, sw: Switch, decision: SwitchStep) -> RecoveryPlan:
        """REPAIR: the plan (mode ``switch_repair``, the switch's generation, iteration K,
        ``repairs`` = the new processes to repair -> their holders); the switch's record in
        ``state.recoveries`` notes the repairs."""
        record = state.recoveries[-1]
        repairs = dict(decision.sources)
        plan = RecoveryPlan(iteration=int(sw.iteration if sw.iteration is not None else state.drain_until),
                            generation=int(record["generation"]), kind=FaultKind.PROCESS, fault_rank=min(repairs),
                            repairs=repairs, mode=RecoveryMode.SWITCH_REPAIR, rejoin=tuple(sorted(repairs)),
                            reason=decision.reason)
        record["repairs"] = plan.to_params()["repairs"]
        return plan


def old_pid(state: ClusterState, fallback: ReplicaFallback, rank: int) -> Any:
    """The pid of ``rank``'s outgoing process (the claimed one's after the replica fallback)."""
    return (fallback.claimed[rank] if rank in fallback.claimed else state.ranks[rank]).pid


__all__ = ["Answers", "FALLBACK_STAGES", "ReplicaFallback", "SWITCH_STAGES", "Who", "old_pid"]
