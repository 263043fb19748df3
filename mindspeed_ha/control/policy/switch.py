"""Hot switch (the operator's ``mindspeed-ha switch --ranks R | --node HOST``): the pure part. No I/O.

A hot switch moves live ranks to new processes at a step boundary, without a restart of
the job and without losing a step. Its flow (the controller side is
:mod:`mindspeed_ha.control.switch_desk`):

```
 RUNNING + switch request (ranks S)          refuse() first: a reason -> REFUSED, nothing happens
   STARTING   the agent of each rank's node starts its next incarnation (from the warm spare),
              training goes on; the new process replays the start-up (recovery/rejoin.py) and
              parks at its rejoin point: READY
   READY      every spare READY -> the operator's pause plan (policy/pause.py) is asked
   PAUSING    every rank holds after iteration K (PAUSED)
   -------- commit point: the switch plan goes out --------
   COMMITTED  every rank rebuilds its groups with the spare in the switched rank's place; the
              outgoing process sends its own state (parameters, optimizer shard, host state,
              progress, RNG) to the spare, then exits 0; RELEASE: training resumes at K+1
   DONE       (committed(): a failure after the commit point is FAILED: the graceful stop
              of the job, or, when an old process died, its fault handling; but an outgoing
              process that died in its handoff while a replica holder of its state lives
              (the replica fallback): its new process is repaired from that holder, as a
              restarted worker rejoins (ARF) inside the pause, then DONE)
 before the commit point, anything wrong -> ABORTED: training goes on on the old ranks
 (a spare that dies, READY not within --ha-connect-timeout, a pause that fails, the job
 leaving RUNNING for a fault or a stop); the reason goes into the operator's reply
```

:func:`refuse` says whether a request may start; :func:`step` is the decision of one
controller turn for a switch under way (:class:`SwitchStep`); :class:`Switch` is the record
of one switch, an explicit state machine (:data:`SWITCH_MOVES`, :meth:`Switch.transition`)
whose marks give the published phase seconds (:func:`phase_seconds`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import AbstractSet, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.policy.recovery import sources
from mindspeed_ha.control.state import ClusterState, Phase, summarise_ranks

log = logging.getLogger("mindspeed_ha.control.controller")

#: the most ranks one request may switch (a whole node's worth on the largest hosts)
MAX_SWITCH_RANKS = 64
#: the node of the launcher that hosts the controller (its agent is called in process)
LOCAL_NODE = "local"


class SwitchPhase(str, enum.Enum):
    """Where one hot switch stands (the transitions: :data:`SWITCH_MOVES`)."""

    STARTING = "starting"
    """The spares start for the switched ranks; training goes on."""
    READY = "ready"
    """Every spare parked at its rejoin point; the graceful pause is asked."""
    PAUSING = "pausing"
    """The pause plan runs (every rank finishes iteration K and holds)."""
    COMMITTED = "committed"
    """Past the commit point: the switch plan was sent (rebuild, transfer, resume)."""
    DONE = "done"
    """Training resumed at K+1 with the new processes in the switched ranks' places."""
    ABORTED = "aborted"
    """Given up before the commit point: training goes on on the old ranks."""
    FAILED = "failed"
    """Failed after the commit point: the job's fault handling took over."""


#: phase -> the phases it may move to
SWITCH_MOVES: Dict[SwitchPhase, FrozenSet[SwitchPhase]] = {
    SwitchPhase.STARTING: frozenset({SwitchPhase.READY, SwitchPhase.ABORTED}),
    SwitchPhase.READY: frozenset({SwitchPhase.PAUSING, SwitchPhase.ABORTED}),
    SwitchPhase.PAUSING: frozenset({SwitchPhase.COMMITTED, SwitchPhase.ABORTED}),
    SwitchPhase.COMMITTED: frozenset({SwitchPhase.DONE, SwitchPhase.FAILED}),
    SwitchPhase.DONE: frozenset(),
    SwitchPhase.ABORTED: frozenset(),
    SwitchPhase.FAILED: frozenset(),
}
#: phases of a switch that is over
ENDED = frozenset({SwitchPhase.DONE, SwitchPhase.ABORTED, SwitchPhase.FAILED})


@dataclasses.dataclass
class Switch:
    """One hot switch: its request, its phase and when each phase began (controller clock, s).

    Attributes:
        request_id: the operator request's id (the reply waits on it).
        ranks: the global ranks switched, sorted.
        at: when the request was accepted.
        phase: where it stands.
        marks: phase value -> when it was entered (``requested`` at ``at``; the controller
            adds ``paused``, ``rebuilt``, ``transferred``, ``resumed`` as the ranks report).
        started: rank -> pid of its new process, as its agent reports it.
        ready: rank -> pid of its new process, once READY.
        iteration: K, the iteration every rank holds after (known in PAUSING).
        reason: why it ended (ABORTED / FAILED) or how (DONE).
        stage_seconds: the slowest rank's seconds per stage of the commit (``rebuild``,
            ``transfer``; the replica fallback's ``repair``), from the ranks' answers.
        fallback: switched rank -> the replica holder its new process is repaired from (the
            replica fallback: its outgoing process died in its handoff; empty otherwise).
    """

    request_id: str
    ranks: Tuple[int, ...]
    at: float
    phase: SwitchPhase = SwitchPhase.STARTING
    marks: Dict[str, float] = dataclasses.field(default_factory=dict)
    started: Dict[int, int] = dataclasses.field(default_factory=dict)
    ready: Dict[int, int] = dataclasses.field(default_factory=dict)
    iteration: Optional[int] = None
    reason: str = ""
    stage_seconds: Dict[str, float] = dataclasses.field(default_factory=dict)
    fallback: Dict[int, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.marks.setdefault("requested", self.at)

    @property
    def ended(self) -> bool:
        return self.phase in ENDED

    def transition(self, new: SwitchPhase, now: float, why: str = "") -> None:
        """Move to ``new`` (marked at ``now``), one log line.

        Raises:
            ValueError: ``new`` is not in :data:`SWITCH_MOVES` of the current phase.
        """
        if new not in SWITCH_MOVES[self.phase]:
            raise ValueError(f"hot switch of ranks {list(self.ranks)}: {self.phase.value} -> {new.value} "
                             f"is not allowed (allowed: {sorted(p.value for p in SWITCH_MOVES[self.phase])})")
        log.warning("hot switch of ranks %s: %s -> %s%s", summarise_ranks(self.ranks), self.phase.value, new.value,
                    f" ({why})" if why else "")
        self.phase = new
        self.marks.setdefault(new.value, now)
        if new in ENDED:
            self.reason = why

    def mark(self, name: str, now: float) -> None:
        """Note when ``name`` (a phase boundary the ranks report) happened, once."""
        self.marks.setdefault(name, now)


#: published phase -> (mark it starts at, mark it ends at) on the controller's clock:
#: ``commit``: the plan sent -> every rank and new process answered (inside it, the ranks'
#: own ``rebuild`` and ``transfer`` seconds, :attr:`Switch.stage_seconds`); ``pause_window``
#: is what the training loop sees held (paused -> resumed), independent of the spares' start-up;
#: ``fallback`` (the replica fallback only): an outgoing process's death seen -> every answer of
#: the repair from its replica holder
PHASE_SPANS: Tuple[Tuple[str, str, str], ...] = (
    ("spare_ready", "requested", "ready"),
    ("pause", "ready", "paused"),
    ("commit", "paused", "answered"),
    ("fallback", "died", "answered"),
    ("resume", "answered", "resumed"),
    ("pause_window", "paused", "resumed"),
    ("total", "requested", "resumed"),
)


def phase_seconds(marks: Mapping[str, float], stages: Optional[Mapping[str, float]] = None) -> Dict[str, float]:
    """The phase seconds of one switch from its marks (:data:`PHASE_SPANS`; a phase whose
    two marks are not both known is left out) and the ranks' stage seconds ``stages``."""
    out: Dict[str, float] = {}
    for name, a, b in PHASE_SPANS:
        if a in marks and b in marks:
            out[name] = round(max(0.0, marks[b] - marks[a]), 6)
    for name, s in (stages or {}).items():
        out[name] = round(float(s), 6)
    return out


def node_ranks(state: ClusterState, host: str) -> Tuple[List[int], Optional[str]]:
    """The ranks whose processes registered from ``host`` (``switch --node HOST``: every rank
    of that node moves in one switch), or ([], why not)."""
    on = sorted(r for r, i in state.ranks.items() if i.host == host)
    if not on:
        return [], (f"--node {host!r}: no rank registered from it (hosts: "
                    f"{sorted({i.host for i in state.ranks.values()})})")
    return on, None


def refuse(state: ClusterState, config: HAConfig, ranks: Sequence[int], spares: Optional[Mapping[str, int]],
           switching: Sequence[int] = (), node_of: Optional[Mapping[int, str]] = None) -> Optional[str]:
    """Why a hot switch of ``ranks`` may not start now, or None.

    Args:
        state: the job as the controller sees it.
        config: the job's config (``worker_reboot``: the new process rejoins as a restarted one).
        ranks: the global ranks asked for.
        spares: node -> warm spares parked there, as the nodes' launchers reported them
            (None: no launcher reported a warm spare). Every node of a switched rank needs
            one: it starts that node's first new process; the node's other switched ranks
            (a whole node) start theirs cold, while training goes on (the pause waits for
            every one READY, so the pause window does not depend on it).
        switching: ranks of a switch under way.
        node_of: global rank -> its node (the keys of ``spares``); a rank not in it is on
            :data:`LOCAL_NODE`, the launcher hosting the controller (None: every rank).

    Returns:
        The reason (the operator's reply, code REFUSED), or None.
    """
    if not ranks:
        return "--ranks: give at least one global rank"
    if len(ranks) > MAX_SWITCH_RANKS:
        return f"--ranks: at most {MAX_SWITCH_RANKS} ranks per switch (got {len(ranks)})"
    bad = sorted({r for r in ranks if not 0 <= r < state.world_size})
    if bad:
        return f"--ranks {bad}: outside the job's ranks 0..{state.world_size - 1}"
    if len(set(ranks)) != len(ranks):
        return f"--ranks {list(ranks)}: a rank is named twice"
    if not config.worker_reboot:
        return "a hot switch needs --enable-worker-reboot (the new process joins as a restarted one does)"
    busy = sorted(set(ranks) & set(switching))
    if busy:
        return f"ranks {summarise_ranks(busy)} are already switching"
    if switching:
        return f"a hot switch of ranks {summarise_ranks(switching)} is under way (one switch at a time)"
    if state.phase is not Phase.RUNNING:
        return f"the job is {state.phase.value}, not running"
    if state.fault is not None or any(i.fault is not None for i in state.ranks.values()):
        return "a fault is being handled"
    if state.stop_request is not None:
        return f"a graceful stop was requested ({state.stop_request.reason})"
    if state.pause is not None:
        return "a graceful pause is under way"
    missing = sorted(set(range(state.world_size)) - set(state.ranks))
    if missing:
        return f"ranks {summarise_ranks(missing)} have not registered yet"
    dead = sorted(r for r, i in state.ranks.items() if not i.alive)
    if dead:
        return f"ranks {summarise_ranks(dead)} are gone"
    waiting = sorted(state.rejoin_wait)
    if waiting:
        return f"ranks {summarise_ranks(waiting)} are being restarted"
    no_rejoin = sorted(r for r in ranks if not state.ranks[r].rejoins)
    if no_rejoin:
        return f"ranks {summarise_ranks(no_rejoin)} registered without rejoin support"
    if spares is None:
        return "no spare: start the job with MINDSPEED_HA_WARM_SPARES=1 (no launcher reported a warm spare)"
    nodes: Dict[str, List[int]] = {}
    for r in ranks:
        nodes.setdefault((node_of or {}).get(r, LOCAL_NODE), []).append(r)
    bare = sorted(r for n, rs in nodes.items() if spares.get(n, 0) < 1 for r in rs)
    if bare:
        return (f"no spare parked on the node of ranks {summarise_ranks(bare)} (its launcher needs "
                "MINDSPEED_HA_WARM_SPARES=1; a new spare is started after each use)")
    return None


class SwitchAction(str, enum.Enum):
    """What the controller does for a switch under way in this turn."""

    WAIT = "wait"
    """Nothing yet."""
    PAUSE = "pause"
    """Every spare READY: ask the graceful pause (STARTING/READY -> PAUSING)."""
    COMMIT = "commit"
    """Every rank holds after K: send the switch plan (PAUSING -> COMMITTED)."""
    ABORT = "abort"
    """Give up before the commit point: back to training on the old ranks (the spares end,
    a pause of this switch is released)."""
    FINISH = "finish"
    """After the commit point, every answer ok: the new processes take the ranks' places, RELEASE."""
    FAIL = "fail"
    """After the commit point, a failure: the new processes end; the job stops gracefully
    (``SwitchStep.stop``) or its fault handling, already under way, decides."""
    FALLBACK = "fallback"
    """After the commit point, an outgoing process died in its handoff and a live replica
    holder has its state (``SwitchStep.sources``): the switch takes the death (the new process
    stands for the rank in the controller's view: no fault of the job) and repairs the new
    process from the holder (REPAIR) instead of the job's fault handling."""
    REPAIR = "repair"
    """The replica fallback's plan goes out: every new process to repair failed its handoff
    and is parked again, every staying rank rebuilt its groups."""


@dataclasses.dataclass(frozen=True)
class SwitchStep:
    """One decision for a switch under way: the action and a human-readable reason."""

    action: SwitchAction
    reason: str
    stop: bool = False
    """FAIL: ask the graceful stop of the job (its checkpoint of K); False: a fault's
    handling (the dying checkpoint) or a stop is under way already."""
    sources: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """FALLBACK: switched rank -> the replica holder (a staying rank with its tp, pp and
    optimizer shard); REPAIR: the ranks whose new process is repaired now -> their holder."""


def step(now: float, sw: Switch, state: ClusterState, config: HAConfig,
         spares_gone: Mapping[int, str]) -> SwitchStep:
    """The decision for ``sw`` in this turn (before the commit point; after it the recovery
    plan and the job's fault handling decide).

    Args:
        now: the controller's clock, s.
        sw: the switch (STARTING, READY or PAUSING).
        state: the job.
        config: ``connect_timeout_s`` bounds the wait for READY.
        spares_gone: switched rank -> why its spare process is gone (exited, killed).
    """
    wait = SwitchStep(SwitchAction.WAIT, "")
    if sw.phase not in (SwitchPhase.STARTING, SwitchPhase.READY, SwitchPhase.PAUSING):
        return wait
    gone = sorted(r for r in sw.ranks if r in spares_gone)
    if gone:
        why = "; ".join(f"rank {r}: {spares_gone[r]}" for r in gone)
        return SwitchStep(SwitchAction.ABORT, f"the spare died before the commit point ({why}): training goes on "
                          "on the old ranks")
    if sw.phase is SwitchPhase.PAUSING:
        if state.phase is Phase.PAUSED:
            return SwitchStep(SwitchAction.COMMIT, f"every rank holds after iteration {state.drain_until}: the "
                              "switch plan goes out")
        if state.phase is Phase.PAUSING:
            return wait
        return SwitchStep(SwitchAction.ABORT, f"the graceful pause did not hold (job {state.phase.value}): "
                          "training goes on on the old ranks")
    if state.phase is not Phase.RUNNING or state.stop_request is not None:
        return SwitchStep(SwitchAction.ABORT, f"the job left running before the pause (phase "
                          f"{state.phase.value}{', a stop was requested' if state.stop_request else ''})")
    gone_ranks = sorted(r for r, i in state.ranks.items() if not i.alive)
    if gone_ranks:
        return SwitchStep(SwitchAction.ABORT, f"ranks {summarise_ranks(gone_ranks)} ended before the pause ("
                          f"{state.ranks[gone_ranks[0]].dead_reason or 'gone'})")
    if state.fault is not None or any(i.fault is not None for i in state.ranks.values()):
        return SwitchStep(SwitchAction.ABORT, "a fault came before the pause: its handling goes first")
    if all(r in sw.ready for r in sw.ranks):
        return SwitchStep(SwitchAction.PAUSE, f"the spares of ranks {summarise_ranks(sw.ranks)} are READY: "
                          "graceful pause")
    bound = config.connect_timeout_s
    if now - sw.at > bound:
        late = [r for r in sw.ranks if r not in sw.ready]
        return SwitchStep(SwitchAction.ABORT, f"the spares of ranks {summarise_ranks(late)} were not READY within "
                          f"{bound:g} s (--ha-connect-timeout): training goes on on the old ranks")
    return wait


def replica_holders(state: ClusterState, sw: Switch, dead: Sequence[int],
                    spares_gone: Mapping[int, str]) -> Tuple[Dict[int, int], List[int]]:
    """The replica fallback's sources: (switched rank -> the lowest live staying rank with its
    (tp, pp, optimizer shard), the ranks of ``dead`` without one). A rank whose new process is
    gone has none (nothing to repair)."""
    donors = {r: i for r, i in state.ranks.items() if r not in sw.ranks and i.alive and i.exit_code is None}
    found, orphans = sources(state.ranks, set(dead), donors)
    orphans += [r for r in found if r in spares_gone]
    return {r: s for r, s in found.items() if r not in spares_gone}, sorted(orphans)


def committed(now: float, sw: Switch, state: ClusterState, spares_gone: Mapping[int, str],
              failed: Mapping[Tuple[str, int], str], late: Sequence[Tuple[str, int]],
              deadline: float, parked_again: AbstractSet[int] = frozenset()) -> SwitchStep:
    """The decision for ``sw`` after the commit point (COMMITTED), in this turn.

    Args:
        now: the controller's clock, s.
        sw: the switch (``sw.fallback`` set: the replica fallback is under way; its mark
            ``repair``: its plan went out).
        state: the job (PAUSED after K while the plan runs).
        spares_gone: switched rank -> why its new process is gone.
        failed: who (``("rank", r)`` or ``("incoming", r)``) -> the detail of a failed answer
            (of the replica fallback's plan once it went out).
        late: who has not answered yet (the same).
        deadline: when the answers are due (2 x ``--ha-action-timeout`` after the plan went out).
        parked_again: switched ranks whose new process, its handoff failed, waits at its
            rejoin point again for another plan.

    Returns:
        The decision, by this table (the first row that holds):

        ===============================================  =======================================
        the replica fallback under way (``sw.fallback``)  :func:`_falling_back`
        an outgoing process died, no other rank, the job  FALLBACK (``sources``: the holders)
        still PAUSED, each one's new process alive and a
        live staying rank holds its (tp, pp, shard)
        another rank died, or a replica is missing        FAIL, ``stop`` False: the job's fault
        (``--distributed-optimizer-no-replica``)           handling took over (the dying
                                                          checkpoint of K needs a replica of a
                                                          dead rank's shard)
        the job left PAUSED                               FAIL, ``stop`` False
        a new process died                                FAIL, ``stop`` True: the graceful stop
                                                          (checkpoint of K from the old processes)
        a failed answer: only new processes whose         WAIT until ``deadline`` (its answer or
        outgoing process has not answered yet and has a   its death decides: a death mid-handoff
        replica holder                                     breaks the new process's link first)
        any other failed answer, or answers late past     FAIL, ``stop`` True
        ``deadline``
        answers due                                       WAIT
        every answer ok                                   FINISH
        ===============================================  =======================================
    """
    if sw.fallback:
        return _falling_back(now, sw, state, spares_gone, failed, late, deadline, parked_again)
    dead = sorted(r for r, i in state.ranks.items() if not i.alive)
    if dead:
        why = (f"ranks {summarise_ranks(dead)} ended after the commit point ("
               f"{state.ranks[dead[0]].dead_reason or 'gone'})")
        holders, orphans = replica_holders(state, sw, dead, spares_gone)
        staying = sorted(set(dead) - set(sw.ranks))
        if not staying and not orphans and state.phase is Phase.PAUSED:
            return SwitchStep(SwitchAction.FALLBACK, f"{why}: the new {_processes(holders)} repaired from the "
                              f"replica {_holders(holders)} (the replica fallback)", sources=holders)
        return SwitchStep(SwitchAction.FAIL, f"{why}: the job's fault handling takes over")
    if state.phase is not Phase.PAUSED:
        return SwitchStep(SwitchAction.FAIL, f"the job left the pause after the commit point (phase "
                          f"{state.phase.value}): its own handling takes over")
    gone = sorted(r for r in sw.ranks if r in spares_gone)
    if gone:
        why = "; ".join(f"rank {r}: {spares_gone[r]}" for r in gone)
        return SwitchStep(SwitchAction.FAIL, f"a new process died after the commit point ({why})", stop=True)
    if failed:
        holders, _ = replica_holders(state, sw, sw.ranks, spares_gone)
        unsettled = all(w[0] == "incoming" and ("rank", w[1]) in late and w[1] in holders for w in failed)
        if unsettled and now < deadline:
            return SwitchStep(SwitchAction.WAIT, "")
        why = "; ".join(f"{w[0]} {w[1]}: {d}" for w, d in sorted(failed.items()))
        return SwitchStep(SwitchAction.FAIL, why, stop=True)
    if late and now >= deadline:
        return SwitchStep(SwitchAction.FAIL, f"no answer from {sorted(late)} in time", stop=True)
    if late:
        return SwitchStep(SwitchAction.WAIT, "")
    return SwitchStep(SwitchAction.FINISH, "every rank and new process answered")


def _processes(holders: Mapping[int, int]) -> str:
    return f"process{'es' if len(holders) > 1 else ''} of ranks {summarise_ranks(sorted(holders))} " \
           f"{'are' if len(holders) > 1 else 'is'}"


def _holders(holders: Mapping[int, int]) -> str:
    return ", ".join(f"holder rank {s} (of rank {r})" for r, s in sorted(holders.items()))


def _falling_back(now: float, sw: Switch, state: ClusterState, spares_gone: Mapping[int, str],
                  failed: Mapping[Tuple[str, int], str], late: Sequence[Tuple[str, int]], deadline: float,
                  parked_again: AbstractSet[int]) -> SwitchStep:
    """:func:`committed` while the replica fallback is under way (``sw.fallback``: the new
    processes stand for their ranks; a FAIL gives the outgoing processes' deaths back to the
    job's fault handling, ``stop`` False).

    ==========================================  ==============================================
    another rank died, a new process died, or   FAIL
    the job left PAUSED
    the plan not out yet (no mark ``repair``):
      a failed answer but those of the dead     FAIL (e.g. a staying rank's: its groups are
      outgoing processes and their new ones     not rebuilt)
      answers due (but the dead outgoing        WAIT until ``deadline``, then FAIL
      processes'), or a new process whose
      handoff failed not parked again yet
      no new process to repair (each one's      FINISH (its outgoing process died after
      handoff answered ok)                      handing everything over)
      else                                      REPAIR (``sources``: those whose handoff failed)
    the plan out: a failed answer, or answers   FAIL
    late past ``deadline``; answers due; else   WAIT; FINISH
    ==========================================  ==============================================
    """
    dead = sorted(r for r, i in state.ranks.items() if not i.alive)
    if dead:
        return SwitchStep(SwitchAction.FAIL, f"ranks {summarise_ranks(dead)} ended during the replica fallback ("
                          f"{state.ranks[dead[0]].dead_reason or 'gone'}): the job's fault handling takes over")
    gone = sorted(r for r in sw.ranks if r in spares_gone)
    if gone:
        why = "; ".join(f"rank {r}: {spares_gone[r]}" for r in gone)
        return SwitchStep(SwitchAction.FAIL, f"a new process died during the replica fallback ({why}): the job's "
                          "fault handling takes over")
    if state.phase is not Phase.PAUSED:
        return SwitchStep(SwitchAction.FAIL, f"the job left the pause during the replica fallback (phase "
                          f"{state.phase.value}): its own handling takes over")
    if "repair" not in sw.marks:
        bad = sorted(w for w in failed if w[1] not in sw.fallback)
        if bad:
            return SwitchStep(SwitchAction.FAIL, "; ".join(f"{w[0]} {w[1]}: {failed[w]}" for w in bad)
                              + ": no replica fallback (only a handoff whose outgoing process died is repaired)")
        to_repair = {r: s for r, s in sw.fallback.items() if ("incoming", r) in failed}
        due = sorted(w for w in late if w[0] == "incoming" or w[1] not in sw.fallback)
        waiting = sorted(set(to_repair) - set(parked_again))
        if due or waiting:
            if now >= deadline:
                return SwitchStep(SwitchAction.FAIL, f"the replica fallback: no answer from {due} or ranks "
                                  f"{waiting} not parked again in time")
            return SwitchStep(SwitchAction.WAIT, "")
        if not to_repair:
            return SwitchStep(SwitchAction.FINISH, "every new process received its whole state before its "
                              "outgoing process died")
        return SwitchStep(SwitchAction.REPAIR, f"the new {_processes(to_repair)} repaired from the replica "
                          f"{_holders(to_repair)} (every group stays as rebuilt)", sources=to_repair)
    if failed:
        why = "; ".join(f"{w[0]} {w[1]}: {d}" for w, d in sorted(failed.items()))
        return SwitchStep(SwitchAction.FAIL, f"the replica fallback failed ({why}): the job's fault handling "
                          "takes over")
    if late and now >= deadline:
        return SwitchStep(SwitchAction.FAIL, f"the replica fallback: no answer from {sorted(late)} in time")
    if late:
        return SwitchStep(SwitchAction.WAIT, "")
    return SwitchStep(SwitchAction.FINISH, "every new process was repaired from its replica holder")


__all__ = ["ENDED", "LOCAL_NODE", "MAX_SWITCH_RANKS", "PHASE_SPANS", "SWITCH_MOVES", "Switch", "SwitchAction",
           "SwitchPhase", "SwitchStep", "committed", "node_ranks", "phase_seconds", "refuse", "replica_holders",
           "step"]
