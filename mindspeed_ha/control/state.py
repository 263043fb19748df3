"""State machines of the control plane: per-rank optimizer status and the job phase.

Both are explicit: a ``str`` Enum, a table of allowed transitions, and one
``transition()`` that logs and raises :class:`~mindspeed_ha.faults.IllegalTransition`
on a forbidden move. No torch.

Optimizer status of one rank (``RankState``)::

    UNKNOWN --begin(k)--> UPDATING(k) --end(k)--> UPDATED(k) --begin(j>k)--> UPDATING(j)
    UNKNOWN --loaded(k)--> UPDATED(k)        UPDATING(k) --begin(k)--> UPDATING(k)  (retry)
    any --invalidate--> UNKNOWN              UPDATED(k) --rollback(j<=k)--> UPDATED(j)

``iteration`` is the number of completed optimizer updates the state represents
(Megatron's ``args.iteration`` after ``train_step`` returns), i.e. the iteration a
checkpoint of that state is saved as.

Job phase (``Phase``), moved only by the decisions of
:func:`mindspeed_ha.control.policy.decide` (``PHASE_MOVES`` lists exactly the moves it makes)::

    RUNNING -> STOPPING -> VERIFYING -> DUMPING -> ASSEMBLING -> COMMITTING -> EXITING -> DONE
    RUNNING -> DRAINING (graceful stop requested: SIGTERM/SIGINT) -> VERIFYING / DUMPING (every
        rank paused at the agreed iteration) | STOPPING (a fault, or the drain took more than
        half the preemption deadline: abandon the iteration) | EXITING | DONE (training ended)
    STOPPING -> DUMPING  (no usable rank can verify its state: test doubles)
    STOPPING / VERIFYING / DUMPING / ASSEMBLING -> EXITING  (no save dir, no complete data, failure)
    RUNNING -> DONE (all said goodbye)
    RUNNING -> RECOVERING (a UCE or network fault recoverable in place, or a dead worker that
        is restarted (ARF): observe, abort, park, RETRY(plan)) -> RUNNING (every rank recovered)
        | STOPPING (the plan is impossible or a rank failed during recovery: the dying checkpoint)
    RUNNING -> PAUSING (the operator's ``pause``: the graceful stop's two rounds, nothing saved)
        -> PAUSED (every rank holds after the agreed iteration) -> RUNNING (``resume``, or ``--max``
        passed: RELEASE) | STOPPING (a fault: the dying checkpoint) | DRAINING (``stop``, or
        ``--max`` with ``--then-stop``: the ranks already hold at the iteration to save);
        PAUSING -> RUNNING (``resume`` before every rank paused, or the pause failed) | DONE

Step positions (``StepPosition``): where a rank was when it reported a fault
(``wire.Fault.where``, kept in ``RankInfo.fault_where``); the in-place plan reads them.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Tuple

from mindspeed_ha.control.holders import RankTable
from mindspeed_ha.faults import FaultKind, IllegalTransition

log = logging.getLogger(__name__)


class WireEnum(str, enum.Enum):
    """A ``str`` Enum whose members are their wire strings: ``str()``, ``format()`` and
    ``%s`` give the value (``"forward"``, not ``"RecoveryMode.FORWARD"``), ``==`` and
    ``in`` compare with plain strings, and msgpack / json encode a member as its value.
    (``enum.StrEnum`` does the same from Python 3.11; the package supports 3.10.)"""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)


class StepPosition(WireEnum):
    """Where a rank was when it reported a fault (``wire.Fault.where``).

    Other values travel too (the fault guard outside ``train_step`` names what raised:
    ``train``, ``save``, ...): ``RankInfo.fault_where`` stays a plain ``str``; these are
    the positions the in-place recovery plan tells apart.
    """

    NONE = ""
    """No fault reported, or a processor that does not say."""
    TRAIN_STEP = "train_step"
    """In ``train_step`` before the optimizer update."""
    UPDATE = "update"
    """Inside the optimizer update, not finished: the rank's state is dirty."""
    UPDATE_DONE = "update_done"
    """The update finished; the rank waits in the update's commit barrier (patches/optimizer.py)."""
    REJOIN = "rejoin"
    """A restarted process (ARF) parked at its rejoin point: model and optimizer built
    (fresh, no checkpoint), data iterators not yet."""


#: where a rank may be stopped for an in-place recovery (plain strings: RankInfo.fault_where)
IN_STEP: FrozenSet[str] = frozenset(p.value for p in (StepPosition.NONE, StepPosition.TRAIN_STEP,
                                                     StepPosition.UPDATE, StepPosition.UPDATE_DONE))
#: inside the optimizer update (finished or not): the roll-forward situation
IN_UPDATE: FrozenSet[str] = frozenset(p.value for p in (StepPosition.UPDATE, StepPosition.UPDATE_DONE))


class OptimizerStatus(str, enum.Enum):
    """Consistency of a rank's model+optimizer state."""

    UPDATED = "updated"
    """Consistent: exactly the state after ``iteration`` updates."""
    UPDATING = "updating"
    """Inside the update for ``iteration``: dirty, must not be saved."""
    UNKNOWN = "unknown"
    """Never reported, or invalidated by a fault inside the update."""


_STATUS_MOVES: Dict[OptimizerStatus, FrozenSet[OptimizerStatus]] = {
    OptimizerStatus.UNKNOWN: frozenset({OptimizerStatus.UPDATING, OptimizerStatus.UPDATED, OptimizerStatus.UNKNOWN}),
    OptimizerStatus.UPDATING: frozenset({OptimizerStatus.UPDATED, OptimizerStatus.UPDATING, OptimizerStatus.UNKNOWN}),
    OptimizerStatus.UPDATED: frozenset({OptimizerStatus.UPDATING, OptimizerStatus.UPDATED, OptimizerStatus.UNKNOWN}),
}


#: ranks a summary names in full; a longer list names its first ``SUMMARY_FIRST`` and counts the rest
SUMMARY_LIMIT = 16
SUMMARY_FIRST = 8


def summarise_ranks(ranks: Iterable[int]) -> str:
    """A list of ranks for a reason or a log line, bounded whatever the job's size: short
    lists in full (``[1, 5]``), longer ones as their first ranks and a count
    (``[0, 1, ..., 7, ... +4088 more (4096 ranks)]``). Keeps the order given."""
    ranks = list(ranks)
    if len(ranks) <= SUMMARY_LIMIT:
        return str(ranks)
    head = ", ".join(str(r) for r in ranks[:SUMMARY_FIRST])
    return f"[{head}, ... +{len(ranks) - SUMMARY_FIRST} more ({len(ranks)} ranks)]"


class RankState:
    """Authoritative optimizer status of one rank (the processor owns one per rank).

    Not thread-safe by itself: the processor guards it with its lock.
    """

    __slots__ = ("rank", "status", "iteration")

    def __init__(self, rank: int, status: OptimizerStatus = OptimizerStatus.UNKNOWN, iteration: int = -1):
        self.rank = rank
        self.status = OptimizerStatus(status)
        self.iteration = int(iteration)

    @staticmethod
    def allowed(old: OptimizerStatus, old_it: int, new: OptimizerStatus, new_it: int) -> Optional[str]:
        """Return None if ``(old, old_it) -> (new, new_it)`` is legal, else why not."""
        if new not in _STATUS_MOVES[old]:
            return f"{old.value} -> {new.value} is not in the transition table"
        if new is OptimizerStatus.UNKNOWN or old is OptimizerStatus.UNKNOWN:
            return None
        if old is OptimizerStatus.UPDATING and new is OptimizerStatus.UPDATED and new_it != old_it:
            return f"end of update {new_it} while updating {old_it}"
        if old is OptimizerStatus.UPDATING and new is OptimizerStatus.UPDATING and new_it != old_it:
            return f"begin of update {new_it} while update {old_it} is unfinished"
        if old is OptimizerStatus.UPDATED and new is OptimizerStatus.UPDATING and new_it <= old_it:
            return f"begin of update {new_it} after update {old_it} (iterations must increase; use rollback)"
        if old is OptimizerStatus.UPDATED and new is OptimizerStatus.UPDATED and new_it > old_it:
            return f"updated {old_it} -> {new_it} without an update in between"
        return None

    def transition(self, new: OptimizerStatus, iteration: int) -> None:
        """Move to ``(new, iteration)`` or raise IllegalTransition (logged)."""
        new = OptimizerStatus(new)
        why = self.allowed(self.status, self.iteration, new, iteration)
        if why is not None:
            log.error("rank %d: illegal optimizer status move: %s", self.rank, why)
            raise IllegalTransition(f"rank {self.rank}: {why}")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d: optimizer %s(%d) -> %s(%d)", self.rank, self.status.value, self.iteration,
                      new.value, iteration)
        self.status = new
        self.iteration = int(iteration)

    def snapshot(self) -> Tuple[OptimizerStatus, int]:
        return self.status, self.iteration

    def __repr__(self) -> str:
        return f"RankState(rank={self.rank}, {self.status.value}@{self.iteration})"


class Phase(str, enum.Enum):
    """Phase of the whole job as the controller sees it."""

    RUNNING = "running"
    RECOVERING = "recovering"
    DRAINING = "draining"
    PAUSING = "pausing"
    PAUSED = "paused"
    STOPPING = "stopping"
    VERIFYING = "verifying"
    DUMPING = "dumping"
    ASSEMBLING = "assembling"
    COMMITTING = "committing"
    EXITING = "exiting"
    DONE = "done"


PHASE_MOVES: Dict[Phase, FrozenSet[Phase]] = {
    Phase.RUNNING: frozenset({Phase.STOPPING, Phase.DRAINING, Phase.RECOVERING, Phase.PAUSING, Phase.DONE}),
    Phase.PAUSING: frozenset({Phase.PAUSED, Phase.RUNNING, Phase.STOPPING, Phase.DRAINING, Phase.DONE}),
    Phase.PAUSED: frozenset({Phase.RUNNING, Phase.STOPPING, Phase.DRAINING}),
    Phase.RECOVERING: frozenset({Phase.RUNNING, Phase.STOPPING}),
    Phase.DRAINING: frozenset({Phase.STOPPING, Phase.VERIFYING, Phase.DUMPING, Phase.EXITING, Phase.DONE}),
    Phase.STOPPING: frozenset({Phase.VERIFYING, Phase.DUMPING, Phase.EXITING}),
    Phase.VERIFYING: frozenset({Phase.DUMPING, Phase.EXITING}),
    Phase.DUMPING: frozenset({Phase.ASSEMBLING, Phase.EXITING}),
    Phase.ASSEMBLING: frozenset({Phase.COMMITTING, Phase.EXITING}),
    Phase.COMMITTING: frozenset({Phase.EXITING}),
    Phase.EXITING: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a rank sits in the parallel layout (sent in REGISTER).

    ``dp_size`` is the size of the group the distributed optimizer is sharded over
    (Megatron's DP x CP group when cp > 1). That group is cut into ``replica_count``
    contiguous optimizer instances of ``dp_size // replica_count`` ranks;
    ``instance_id`` is the rank's instance and ``shard_id`` its index inside it. A
    non-distributed optimizer reports ``replica_count = dp_size`` and ``shard_id = 0``.
    """

    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    replica_count: int = 1
    instance_id: int = 0
    shard_id: int = 0
    cp_size: int = 1

    @property
    def shards_per_instance(self) -> int:
        return max(1, self.dp_size // max(1, self.replica_count))

    @property
    def shard_key(self) -> Tuple[int, int, int]:
        return (self.tp_rank, self.pp_rank, self.shard_id)

    @property
    def model_key(self) -> Tuple[int, int]:
        return (self.tp_rank, self.pp_rank)


@dataclasses.dataclass
class RankInfo:
    """The controller's view of one rank. Mutated only by the controller thread."""

    rank: int
    layout: Layout
    alive: bool = True
    last_heartbeat: float = 0.0
    status: OptimizerStatus = OptimizerStatus.UNKNOWN
    iteration: int = -1
    fault: Optional[FaultKind] = None
    fault_message: str = ""
    stopped: bool = False
    exit_code: Optional[int] = None
    dead_reason: str = ""
    pid: int = 0
    host: str = ""
    save_dir: Optional[str] = None
    failed_at: Optional[float] = None
    sender: str = ""
    verifies: bool = False  # answers VERIFY with an integrity report (REGISTER)
    integrity: Any = None  # integrity.IntegrityReport of the frozen state, once reported
    pause_at: Optional[int] = None  # graceful stop, first round: where the rank said it pauses (-1: not started)
    paused_after: Optional[int] = None  # first round, not started: the iteration it paused after (STOPPED), K unknown
    fault_where: str = ""  # what raised the reported fault (wire.Fault.where; see StepPosition)
    fault_iteration: int = -1  # the iteration being computed when it raised
    fault_at: Optional[float] = None  # when its latest FAULT arrived (controller clock)
    step: int = -1  # the train_step the rank's training thread entered (STATUS / STOPPED), -1: unknown
    incarnation: int = 0  # how many times the launcher restarted this rank's process (ARF)
    rejoins: bool = False  # a restarted process of this rank can rejoin (REGISTER)
    updated_at: Optional[float] = None  # when its latest STATUS UPDATED(k) arrived (controller clock)
    step_seconds: Optional[float] = None  # between its last two UPDATED(k-1), UPDATED(k): its step time, s


@dataclasses.dataclass(frozen=True)
class FaultRecord:
    """The first fault of the job: when the controller got the evidence, and what it was."""

    at: float
    rank: int
    kind: FaultKind
    reason: str


@dataclasses.dataclass(frozen=True)
class StopRequest:
    """A graceful stop was asked for (SIGTERM/SIGINT): when, by whom (-1: the launcher), why."""

    at: float
    rank: int
    reason: str


@dataclasses.dataclass
class PauseRequest:
    """The operator's graceful pause: when it was asked (controller clock), its ``--max``
    (seconds, 0: none) and what ends it (``resume_at``: a ``resume`` arrived). ``task``: the
    pause task the ranks run now (``check`` / ``relink``, :mod:`.pause_tasks`; "" none): a
    resume or ``--max`` waits for it to end."""

    at: float
    max_s: float = 0.0
    then_stop: bool = False
    resume_at: Optional[float] = None
    task: str = ""


@dataclasses.dataclass
class PendingAction:
    """An ACTION sent to ``targets`` whose results the controller is collecting."""

    action_id: int
    kind: str
    targets: Tuple[int, ...]
    sent_at: float
    params: Dict[str, Any] = dataclasses.field(default_factory=dict)
    results: Dict[int, Tuple[bool, str]] = dataclasses.field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return all(r in self.results for r in self.targets)

    def is_target(self, rank: int) -> bool:
        """Whether ``rank`` is one of ``targets``: O(1), a set made on first use (``rank in
        targets`` scanned the tuple: 88 us per ACTION_RESULT at 16,384 ranks)."""
        found = self.__dict__.get("_target_set")
        if found is None:
            found = self.__dict__["_target_set"] = frozenset(self.targets)
        return rank in found

    @property
    def failures(self) -> Dict[int, str]:
        return {r: d for r, (ok, d) in self.results.items() if not ok}


@dataclasses.dataclass
class ClusterState:
    """Everything :func:`~mindspeed_ha.control.policy.decide` reads.

    The controller thread owns and mutates it; the policy only reads it.
    """

    world_size: int
    #: rank -> RankInfo; a :class:`~mindspeed_ha.control.holders.RankTable`, whose ``holders``
    #: (part -> its holders) the dying checkpoint's selection reads
    ranks: Dict[int, RankInfo] = dataclasses.field(default_factory=RankTable)
    phase: Phase = Phase.RUNNING
    phase_since: float = 0.0
    fault: Optional[FaultRecord] = None
    plan: Any = None  # policy.DumpPlan once DUMP was sent
    pending: Optional[PendingAction] = None
    exit_code: Optional[int] = None
    exit_reason: str = ""
    run_id: str = ""
    unregistered_exits: Dict[int, Tuple[Optional[int], str, float]] = dataclasses.field(default_factory=dict)
    stop_request: Optional[StopRequest] = None  # graceful stop (preemption), the first request
    drain_until: Optional[int] = None  # graceful stop / pause: the iteration every rank pauses after
    pause: Optional[PauseRequest] = None  # the operator's graceful pause under way (PAUSING / PAUSED)
    #: in-place recoveries so far, oldest first: dicts with iteration, kind, rank, generation, times
    recoveries: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    #: in-place recovery: when the abort (STOP with ``recover``) was sent; None before it
    abort_sent_at: Optional[float] = None
    #: ARF (--enable-worker-reboot): ranks whose process died and whose agent restarts it,
    #: with when the death was reported; the recovery waits for them to rejoin
    rejoin_wait: Dict[int, float] = dataclasses.field(default_factory=dict)
    #: start-up: while not every rank registered, silence is no evidence until this time
    #: (the first registration + ``connect_timeout_s``); None once all registered. A job's
    #: thousands of connections being made keep the controller's I/O thread busy with their
    #: handshakes, and a rank registered first waits for the others anyway
    registering_until: Optional[float] = None

    def silence_counts(self, now: float) -> bool:
        """Whether a rank's heartbeat silence is evidence now (see ``registering_until``)."""
        return self.registering_until is None or now > self.registering_until

    def set_phase(self, new: Phase, now: float, why: str = "") -> None:
        """Move the job to ``new`` or raise IllegalTransition (logged)."""
        new = Phase(new)
        if new not in PHASE_MOVES[self.phase]:
            log.error("job phase: illegal move %s -> %s (%s)", self.phase.value, new.value, why)
            raise IllegalTransition(f"job phase {self.phase.value} -> {new.value} is not allowed")
        self.phase = new
        self.phase_since = now

    def record_fault(self, at: float, rank: int, kind: FaultKind, reason: str) -> bool:
        """Keep the first fault; return True if this one is the first."""
        if self.fault is None:
            self.fault = FaultRecord(at, rank, FaultKind(kind), reason)
            return True
        return False

    def request_stop(self, at: float, rank: int, reason: str) -> bool:
        """Record a graceful-stop request; True if it is the first one.

        Only a running (or gracefully paused) job is stopped gracefully: once a fault round (or a graceful stop)
        is under way, or the job is over, the request changes nothing.
        """
        if self.stop_request is not None or self.phase not in (Phase.RUNNING, Phase.PAUSING, Phase.PAUSED):
            return False
        self.stop_request = StopRequest(at, rank, reason)
        return True

    def mark_dead(self, rank: int, reason: str, exit_code: Optional[int] = None, at: Optional[float] = None) -> bool:
        """Mark ``rank`` dead (evidence at time ``at``); return True if it was alive.

        A rank that dies before registering is remembered in ``unregistered_exits``.
        """
        info = self.ranks.get(rank)
        if info is None:
            if 0 <= rank < self.world_size and rank not in self.unregistered_exits:
                self.unregistered_exits[rank] = (exit_code, reason, at if at is not None else 0.0)
                return True
            return False
        if not info.alive:
            return False
        info.alive = False
        info.dead_reason = reason
        if exit_code is not None:
            info.exit_code = exit_code
        if info.failed_at is None and exit_code != 0:
            info.failed_at = at
        return True

    @property
    def save_dir(self) -> Optional[str]:
        """The ``--save`` directory the ranks registered (the first non-empty one)."""
        for r in sorted(self.ranks):
            if self.ranks[r].save_dir:
                return self.ranks[r].save_dir
        return None

    def alive_ranks(self) -> List[int]:
        return sorted([r for r, i in self.ranks.items() if i.alive])  # a list: faster than a generator at 16k
