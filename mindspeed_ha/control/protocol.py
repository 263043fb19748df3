"""The rank's step protocol: where the control plane holds the training thread.

One :class:`StepState` (a ``str`` Enum with a transition table, like
:class:`~mindspeed_ha.control.state.Phase`) says what the controller (or, once it is
lost, the ranks' own agreement) asks of this rank's training thread::

    RUNNING --DRAIN--> DRAINING                     (a graceful stop or pause: pause at the limit)
    DRAINING --RELEASE--> RUNNING                   (the graceful pause ends)
    RUNNING / DRAINING --STOP(freeze=False)--> OBSERVED   (in-place round 1: steps go on)
    RUNNING / DRAINING / OBSERVED --STOP(freeze)--> FROZEN      (no optimizer update starts)
    any of the above --STOP(recover)--> RECOVERING  (the step is aborted until RETRY)
    OBSERVED / FROZEN / RECOVERING --RETRY--> RUNNING (DRAINING while a pause limit is set)
    RUNNING / DRAINING / OBSERVED / FROZEN --controller lost--> DRAINING  (the ranks' limit)
    any --EXIT--> EXITED                            (terminal)

A STOP never lowers the hold (STOP(freeze=False) after STOP(freeze) leaves the rank
FROZEN). The numbers of the protocol are data beside the state, guarded by the same
lock: the pause ``limit`` (DRAIN; kept through a later STOP), where the training thread
is paused (``paused_at``), the fault it waits on (``fault``), the exit code and reason.

:class:`StepProtocol` holds all of it under one condition variable (shared with the
outbox, :class:`~mindspeed_ha.control.link.Outbox`) and implements the training
thread's calls (``begin_update`` / ``end_update`` / ``pause_point`` / ``report_fault``)
and the effects of STOP, DRAIN and RETRY. No torch: aborting the collectives is a hook
the runtime registers (:class:`RecoveryHooks`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import threading
import time
from typing import Callable, Deque, Dict, FrozenSet, Optional, Tuple

from mindspeed_ha.control import wire
from mindspeed_ha.control.policy import ActionKind
from mindspeed_ha.control.state import OptimizerStatus, RankState
from mindspeed_ha.errors import CommunicationError, ControllerLostError, ProcessorExited

#: the processor's logger: every line of the rank's control plane keeps the name operators and tests filter on
log = logging.getLogger("mindspeed_ha.control.processor")


class StepState(str, enum.Enum):
    """What the control plane asks of this rank's training thread (see the module doc)."""

    RUNNING = "running"
    """No stop under way: steps go on; status changes go out at the next wake-up."""
    DRAINING = "draining"
    """A pause limit is set (DRAIN, or the ranks' own agreement without the controller):
    ``pause_point`` blocks once the completed iteration reaches it."""
    OBSERVED = "observed"
    """STOP(freeze=False), an in-place recovery's first round: steps go on, each status
    and step change is sent at once."""
    FROZEN = "frozen"
    """STOP(freeze): ``begin_update`` blocks until RETRY, or EXIT ends the rank."""
    RECOVERING = "recovering"
    """STOP(recover): every collective raises, and so do ``begin_update`` and
    ``pause_point``, until RETRY (the training thread parks in ``report_fault``)."""
    EXITED = "exited"
    """The job ended for this rank (the controller's EXIT, or the rank's own verdict)."""


STEP_MOVES: Dict[StepState, FrozenSet[StepState]] = {
    StepState.RUNNING: frozenset({StepState.RUNNING, StepState.DRAINING, StepState.OBSERVED, StepState.FROZEN,
                                  StepState.RECOVERING, StepState.EXITED}),
    StepState.DRAINING: frozenset({StepState.DRAINING, StepState.OBSERVED, StepState.FROZEN, StepState.RECOVERING,
                                   StepState.RUNNING, StepState.EXITED}),
    StepState.OBSERVED: frozenset({StepState.OBSERVED, StepState.FROZEN, StepState.RECOVERING, StepState.RUNNING,
                                   StepState.DRAINING, StepState.EXITED}),
    StepState.FROZEN: frozenset({StepState.FROZEN, StepState.RECOVERING, StepState.RUNNING, StepState.DRAINING,
                                 StepState.EXITED}),
    StepState.RECOVERING: frozenset({StepState.RECOVERING, StepState.RUNNING, StepState.DRAINING,
                                     StepState.EXITED}),
    StepState.EXITED: frozenset({StepState.EXITED}),
}

#: how far a STOP holds the training thread: a STOP never moves a rank to a lower hold
_HOLD = {StepState.RUNNING: 0, StepState.DRAINING: 0, StepState.OBSERVED: 1, StepState.FROZEN: 2,
         StepState.RECOVERING: 3, StepState.EXITED: 4}


def _no_collectives(_: str) -> None:
    """A processor without a runtime (unit tests, tools) has no collectives to interrupt
    and no groups to rebuild."""


def _aborted(message: str) -> BaseException:
    return CommunicationError(message)


def _no_pause_task(task: wire.PauseTask) -> wire.PauseTaskResult:
    return wire.PauseTaskResult(task.task_id, -1, PAUSE_TASK_NOT_RUN, "not run: no runtime on this rank")


#: a pause task's result code when it did not run (the reference's "1 not run -> resume")
PAUSE_TASK_NOT_RUN = 1


@dataclasses.dataclass(frozen=True)
class RecoveryHooks:
    """The training side's part of an in-place recovery, registered by the runtime
    (:meth:`Processor.set_recovery_hooks`), so that the control plane imports no torch.

    Attributes:
        abort: ``abort(reason)``: interrupt every collective of this process at once
            (STOP(recover)); thread-safe, returns at once.
        aborted: ``aborted(message) -> exception``: what ``begin_update`` and
            ``pause_point`` raise while the step is aborted.
        use_store: ``use_store("host:port")``: rendezvous the next group rebuilds in a
            controller successor's store (ACTION param ``store``).
        pause_task: ``pause_task(PauseTask) -> PauseTaskResult``: run a pause task (online
            check, relink) on the training thread while it holds at its pause point
            (``runtime/pause_tasks.py``); the default answers "not run".

    The runtime registers :mod:`mindspeed_ha.recovery.comm`'s and ``groups``' functions
    (``runtime/bootstrap.py``); the defaults, for a processor without a runtime, do nothing
    and raise a plain :class:`~mindspeed_ha.errors.CommunicationError`.
    """

    abort: Callable[[str], None] = _no_collectives
    aborted: Callable[[str], BaseException] = _aborted
    use_store: Callable[[str], None] = _no_collectives
    pause_task: Callable[[wire.PauseTask], wire.PauseTaskResult] = _no_pause_task


@dataclasses.dataclass
class StopRequest:
    """A termination signal asked the controller for a graceful stop."""

    reason: str
    exit_code: int  # the rank's exit code if nobody acts on it
    at: float  # time.monotonic() of the request
    queued: bool = False  # STOP_REQUEST is in the outbox


class StepProtocol:
    """The step protocol state of one rank (see the module doc), guarded by ``cond``.

    Methods ending in ``_locked`` expect ``cond`` held; the others take it.

    Args:
        rank: global rank (for log lines and messages).
        cond: the processor's one condition variable (shared with the outbox).
        outbox: where messages to the controller are queued (``put_locked`` wakes the
            I/O thread, ``add_locked`` does not: for the I/O thread itself).
        freeze_deadline_s: how long a frozen or paused training thread waits for an action.
        iteration: iteration of the loaded state, if any (status UPDATED at it).
    """

    def __init__(self, rank: int, cond: threading.Condition, outbox, freeze_deadline_s: float,
                 iteration: Optional[int] = None):
        self.rank = rank
        self.cond = cond
        self.outbox = outbox
        self.freeze_deadline_s = freeze_deadline_s
        self.rank_state = RankState(rank)
        if iteration is not None:
            self.rank_state.transition(OptimizerStatus.UPDATED, iteration)
        self.state = StepState.RUNNING
        self.hooks = RecoveryHooks()
        self.limit: Optional[int] = None  # the pause limit (DRAIN / the ranks' agreement)
        self.hold = False  # a graceful pause (DRAIN.hold): paused without the freeze deadline until RELEASE
        self.paused_at: Optional[int] = None  # the training thread is paused after this iteration
        self.completed: Optional[int] = None  # the last iteration the training thread completed
        self.step = -1  # the train_step the training thread entered (pause_point), -1 before
        self.fault: Optional[wire.Fault] = None  # the fault the training thread waits on (report_fault)
        self.exit: Optional[Tuple[int, str]] = None  # (code, reason) once EXITED
        self.exit_returned = False  # the exit handler returned (test doubles; normally it ends the process)
        self.main_action: Optional[wire.Action] = None  # RETRY / EXIT for the training thread
        self.tasks: Deque[wire.PauseTask] = collections.deque()  # pause tasks for the paused training thread
        self.status_dirty = False
        self.stop_received_at: Optional[float] = None
        self.stop_request: Optional[StopRequest] = None
        #: set when STOP or DRAIN arrives (a stop is under way); for the runtime and tests to wait on
        self.stop_event = threading.Event()

    # ------------------------------------------------------------------ the state table
    def transition(self, new: StepState) -> bool:
        """Move to ``new`` (``cond`` held); an illegal move is logged and rejected (False)."""
        new = StepState(new)
        if new not in STEP_MOVES[self.state]:
            log.error("rank %d: illegal step protocol move %s -> %s (ignored)", self.rank, self.state.value,
                      new.value)
            return False
        if new is not self.state:
            log.debug("rank %d: step protocol %s -> %s", self.rank, self.state.value, new.value)
        self.state = new
        return True

    @property
    def frozen(self) -> bool:
        """No optimizer update can start: frozen by STOP, or paused at a drain limit."""
        return self.frozen_by_stop or self.paused_at is not None

    @property
    def frozen_by_stop(self) -> bool:
        """A STOP holds ``begin_update`` (FROZEN, or RECOVERING: it raises)."""
        return self.state in (StepState.FROZEN, StepState.RECOVERING)

    def status(self) -> Tuple[OptimizerStatus, int]:
        """Authoritative (status, iteration)."""
        with self.cond:
            return self.rank_state.snapshot()

    # ------------------------------------------------------------------ the training thread
    def _raise_if_recovering_locked(self) -> None:
        if self.state is StepState.RECOVERING:
            raise self.hooks.aborted(f"rank {self.rank}: step aborted for in-place recovery")

    def begin_update(self, iteration: int) -> None:
        """See :meth:`Processor.begin_update`."""
        with self.cond:
            self._raise_if_recovering_locked()
            if self.frozen_by_stop:
                deadline = time.monotonic() + self.freeze_deadline_s
                while self.frozen_by_stop:
                    self._raise_if_recovering_locked()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ControllerLostError(
                            f"rank {self.rank}: frozen for {self.freeze_deadline_s:.0f} s without an action")
                    self.cond.wait(left)
            if self.exit is not None:
                raise ProcessorExited(f"rank {self.rank}: job ended ({self.exit[1]})")
            self.rank_state.transition(OptimizerStatus.UPDATING, iteration)
            self.status_dirty = True

    def end_update(self, iteration: int) -> None:
        """See :meth:`Processor.end_update`."""
        with self.cond:
            self.rank_state.transition(OptimizerStatus.UPDATED, iteration)
            self.status_dirty = True
            if self.state in (StepState.OBSERVED, StepState.FROZEN, StepState.RECOVERING):
                self.outbox.poke()

    def mark_unknown(self) -> None:
        """Report the optimizer status UNKNOWN (the state is about to be overwritten)."""
        with self.cond:
            _, it = self.rank_state.snapshot()
            self.rank_state.transition(OptimizerStatus.UNKNOWN, it)
            self.status_dirty = True
        self.outbox.poke()

    def pause_point(self, iteration: int, lost: bool) -> bool:
        """See :meth:`Processor.pause_point`; ``lost``: no controller to tell.

        Returns:
            True when the pause ran past ``freeze_deadline_s`` (the caller ends the rank).

        Raises:
            ProcessorExited: the rank was ended while paused and the exit handler returned.
        """
        timed_out = False
        with self.cond:
            self._raise_if_recovering_locked()
            self.completed = int(iteration)
            if self.step != self.completed + 1:
                self.step = self.completed + 1
                if self.state is StepState.OBSERVED:  # in-place recovery, round 1: the controller waits for this
                    self.status_dirty = True
                    self.outbox.poke()
            if self.limit is None or iteration < self.limit or self.exit is not None:
                return False
            self.paused_at = int(iteration)
            st, it = self.rank_state.snapshot()
            if not lost:
                self.outbox.put_locked(wire.Stopped(self.rank, st.value, it, int(iteration)))
            self.cond.notify_all()
            log.warning("rank %d: paused after iteration %d (%s)", self.rank, iteration,
                        "graceful pause" if self.hold else "graceful stop")
            deadline = time.monotonic() + self.freeze_deadline_s
            try:
                while self.limit is not None and iteration >= self.limit and self.exit is None:
                    if self.hold:  # the operator's pause: as long as the controller wants (RELEASE)
                        if self.tasks:  # a pause task (check, relink): run here, on the training thread
                            _run_pause_task_locked(self, self.tasks.popleft())
                            continue
                        deadline = time.monotonic() + self.freeze_deadline_s
                        self.cond.wait()
                        continue
                    left = deadline - time.monotonic()
                    if left <= 0:
                        timed_out = True
                        break
                    self.cond.wait(left)
            finally:
                self.paused_at = None
            exited = self.exit
            while exited is not None and not self.exit_returned:
                self.cond.wait()  # the exit handler ends the process; a test double returns
        if exited is not None:
            raise ProcessorExited(f"rank {self.rank}: job ended ({exited[1]})")
        return timed_out

    def wait_action(self, iteration: int, kind: str, message: str, where: str,
                    deadline: float) -> Optional[wire.Action]:
        """Report a fault (FAULT with the status now) and wait for the training thread's
        action until ``deadline`` (monotonic); None when it passed."""
        with self.cond:
            self.main_action = None
            status, _ = self.rank_state.snapshot()
            self.fault = wire.Fault(self.rank, int(iteration), kind, message, status.value, where)
            self.outbox.put_locked(self.fault)
            log.error("rank %d: %s fault at iteration %d reported: %s", self.rank, kind, iteration, message)
            try:
                while self.main_action is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self.cond.wait(left)
                return self.main_action
            finally:
                self.fault = None

    def next_pause_locked(self) -> int:
        """The iteration this rank is computing, or will compute next (-1: not started)."""
        if self.completed is not None:
            return self.completed + 1
        st, it = self.rank_state.snapshot()
        if st is OptimizerStatus.UPDATING:
            return it
        if st is OptimizerStatus.UPDATED and it >= 0:
            return it + 1
        return -1

    # ------------------------------------------------------------------ the controller's messages
    def on_stop(self, body: wire.Stop) -> None:
        """STOP (I/O thread): hold the training thread, answer STOPPED with the exact status."""
        if body.recover:
            self._abort_step(body.reason)
        holds = bool(body.freeze or body.recover)
        with self.cond:
            target = StepState.FROZEN if holds else StepState.OBSERVED
            if _HOLD[target] > _HOLD[self.state]:
                self.transition(target)
            self.stop_received_at = time.monotonic()
            st, it = self.rank_state.snapshot()
            self.status_dirty = False  # STOPPED carries it
            self.outbox.add_locked(wire.Stopped(self.rank, st.value, it, -1, self.step))
        self.stop_event.set()
        log.warning("rank %d: STOP (%s); %s at %s@%d", self.rank, body.reason, "frozen" if holds else "observed",
                    st.value, it)

    def _abort_step(self, reason: str) -> None:
        """STOP(recover): the training thread must leave its step and park in
        ``report_fault`` (in-place recovery). Every collective it is blocked in or
        starts raises (the ``abort`` hook), and so do ``begin_update`` and
        ``pause_point`` until RETRY arrives."""
        with self.cond:
            if self.state is not StepState.EXITED:
                self.transition(StepState.RECOVERING)
            self.cond.notify_all()
        try:
            self.hooks.abort(reason)
        except Exception:  # noqa: BLE001 - the I/O thread must go on; begin_update still raises
            log.exception("rank %d: aborting the collectives failed", self.rank)

    def on_drain(self, body: wire.Drain) -> None:
        """DRAIN(-1): set the pause limit at the iteration in progress, announce it (DRAINING).
        DRAIN(K): move the limit to K; a rank already paused after K says so again (STOPPED)."""
        with self.cond:
            if self.stop_received_at is None:
                self.stop_received_at = time.monotonic()
            self.hold = bool(body.hold)
            if body.until < 0:
                mine = self.next_pause_locked()
                self.limit = max(0, mine)  # not started: pause after the first iteration
                self.outbox.add_locked(wire.Draining(self.rank, mine))
            else:
                mine = body.until
                self.limit = body.until
                if self.paused_at is not None and self.paused_at >= body.until:
                    st, it = self.rank_state.snapshot()
                    self.outbox.add_locked(wire.Stopped(self.rank, st.value, it, self.paused_at))
            if self.state is StepState.RUNNING:
                self.transition(StepState.DRAINING)
            self.cond.notify_all()
        self.stop_event.set()
        log.warning("rank %d: graceful %s (%s): pausing after iteration %d", self.rank,
                    "pause" if body.hold else "stop", body.reason, mine)

    def on_release(self, body: wire.Release) -> None:
        """RELEASE: the graceful pause ends: lift the limit, the paused training thread goes on."""
        with self.cond:
            self.limit, self.hold = None, False
            if self.state is StepState.DRAINING:  # (a STOP that crossed the RELEASE keeps its hold)
                self.transition(StepState.RUNNING)
                self.stop_received_at = None  # the job runs on: a later stop is news
                self.stop_event.clear()
            self.cond.notify_all()
        log.warning("rank %d: graceful pause released (%s)", self.rank, body.reason)

    def on_pause_task(self, body: wire.PauseTask) -> None:
        """PAUSE_TASK (I/O thread): hand it to the training thread if it holds in a graceful
        pause; else answer at once, code 1 (not run)."""
        with self.cond:
            if self.paused_at is None or not self.hold or self.exit is not None:
                self.outbox.add_locked(wire.PauseTaskResult(body.task_id, self.rank, PAUSE_TASK_NOT_RUN,
                                                            "not run: this rank does not hold in a graceful pause"))
                return
            self.tasks.append(body)
            self.cond.notify_all()

    def deliver_locked(self, action: wire.Action) -> None:
        """Hand RETRY or EXIT to the training thread; RETRY ends the stop (the job runs on)."""
        if action.kind == ActionKind.RETRY.value:
            if self.state is not StepState.EXITED:
                self.transition(StepState.RUNNING if self.limit is None else StepState.DRAINING)
            self.stop_received_at = None  # the job runs on: a later stop is news
            self.stop_event.clear()
        self.main_action = action
        self.cond.notify_all()

    def end_locked(self, code: int, reason: str) -> None:
        """EXITED with ``code`` and ``reason`` (the waiting training thread is woken)."""
        self.exit = (code, reason)
        self.transition(StepState.EXITED)
        self.cond.notify_all()

    # ------------------------------------------------------------------ the I/O thread
    def status_body_locked(self) -> Optional[wire.Status]:
        """The STATUS to send, if the status changed since the last one."""
        if not self.status_dirty:
            return None
        self.status_dirty = False
        st, it = self.rank_state.snapshot()
        return wire.Status(self.rank, st.value, it, self.step)

    def resend_fault_locked(self) -> None:
        """A new leader: the fault the training thread waits on goes to it first."""
        if self.fault is not None:
            self.outbox.put_front_locked(self.fault)

    def queue_stop_request_locked(self) -> None:
        req = self.stop_request
        if req is not None and not req.queued:
            req.queued = True
            self.outbox.put_locked(wire.StopRequest(self.rank, req.reason))
            log.warning("rank %d: %s: asking the controller for a graceful stop", self.rank, req.reason)

    def take_expired_stop_request(self, now: float, timeout_s: float) -> Optional[StopRequest]:
        """The stop request nobody acted on (no STOP or DRAIN) within ``timeout_s``, taken
        (the caller ends the rank with its exit code); None otherwise."""
        req = self.stop_request
        if req is None or self.stop_event.is_set() or now - req.at <= timeout_s:
            return None
        self.stop_request = None
        return req

    def pause_without_controller(self) -> Tuple[Optional[int], str]:
        """The controller is lost: pause at this rank's limit (its drain limit, else the
        iteration in progress); (the limit announced, "") or (None, why this rank cannot)."""
        with self.cond:
            if self.fault is not None:
                return None, "controller lost while this rank waited for its action on a fault"
            if self.state is not StepState.RECOVERING and self.state is not StepState.EXITED:
                self.transition(StepState.DRAINING)  # a pause limit replaces any freeze
            self.hold = False  # a graceful pause without its controller: the ranks' own verdict follows
            self.cond.notify_all()
            mine = self.limit if self.limit is not None else self.next_pause_locked()
            self.limit = max(0, mine)
            return mine, ""

    def pause_after(self, k: int, timeout_s: float) -> bool:
        """Move the limit to ``k`` and wait up to ``timeout_s`` for the training thread to
        pause after it; True if it did."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            self.limit = k
            self.cond.notify_all()
            while self.paused_at != k and self.exit is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            return self.paused_at == k


def _run_pause_task_locked(self: "StepProtocol", task: wire.PauseTask) -> None:
    """Run one pause task with ``cond`` released (the I/O thread goes on: heartbeats,
    RELEASE, EXIT), then queue its result; an exception is a result (code 1), not a crash."""
    log.warning("rank %d: pause task %s #%d (budget %.0f s)", self.rank, task.kind, task.task_id, task.budget_s)
    self.cond.release()
    try:
        try:
            res = self.hooks.pause_task(task)
            res = dataclasses.replace(res, task_id=task.task_id, rank=self.rank)
        except Exception as exc:  # noqa: BLE001 - the rank goes on holding; the operator is told
            log.exception("rank %d: pause task %s #%d failed", self.rank, task.kind, task.task_id)
            res = wire.PauseTaskResult(task.task_id, self.rank, PAUSE_TASK_NOT_RUN,
                                       f"not run: {type(exc).__name__}: {exc}"[:2000])
    finally:
        self.cond.acquire()
    self.outbox.put_locked(res)
    log.warning("rank %d: pause task %s #%d: code %d %s", self.rank, task.kind, task.task_id, res.code,
                res.detail[:200])


__all__ = ["PAUSE_TASK_NOT_RUN", "RecoveryHooks", "STEP_MOVES", "StepProtocol", "StepState", "StopRequest"]
