"""The processor: one per training rank, the rank's end of the control plane.

A facade over one module per role:

* :mod:`link`: the DEALER socket, its I/O thread ("heartbeat thread": registers,
  heartbeats, drains the outbox, answers STOP at once), following the leader after a
  controller failover, and the controller-loss clock;
* :mod:`protocol`: the step protocol, one :class:`~protocol.StepState` table (RUNNING,
  DRAINING, OBSERVED, FROZEN, RECOVERING, EXITED) and the data beside it;
* :mod:`actions`: the action thread that runs the handlers registered with
  :meth:`Processor.on_action` (a long save never delays heartbeats) and sends ACTION_RESULT;
* :mod:`without_controller`: the dying checkpoint the ranks write themselves when the
  controller is lost.

Step protocol, called by the training main thread (call-ordering rules):

1. ``begin_update(k)`` right before the optimizer update that produces iteration k;
2. ``end_update(k)`` right after it completed (on every rank of the instance);
3. on an exception in the step: ``report_fault(exc, k)``, which returns the
   controller's action for the main thread (RETRY / EXIT).

Both update calls take the lock, move the authoritative :class:`RankState` and mark
it dirty: a few microseconds, no I/O, no thread wake-up. The I/O thread sends the
latest status as one STATUS at its next wake-up (at most ``heartbeat_interval_s``
later; every HEARTBEAT carries it too). Intermediate statuses are coalesced: the
controller needs exact status only at STOP, and STOPPED carries it.

Freeze protocol: on STOP the I/O thread moves the step protocol to FROZEN under the same
lock, takes the authoritative status and queues STOPPED behind every earlier STATUS, so
the controller's view is exact. While frozen, ``begin_update`` blocks (no new mutation
starts) until RETRY, or the process is ended by EXIT; ``end_update`` of an update
already running still completes and is reported. If no action arrives within the
freeze deadline, ``begin_update`` raises :class:`ControllerLostError`.

Graceful stop (DRAIN, after SIGTERM/SIGINT): the training thread calls
:meth:`Processor.pause_point` before it starts an iteration, with the last one it
completed (the training loop has counted, logged, evaluated and saved that one, so a
checkpoint of it is what Megatron-LM's own save of it would hold). DRAIN(-1) sets a pause
limit at the iteration now in progress and answers DRAINING with it; DRAIN(K) moves the
limit to K, the highest any rank announced. ``pause_point(k)`` blocks while
``k >= limit`` (the rank is then stable at UPDATED(k) and answers STOPPED(pause_at=k)),
so every rank ends paused after the same iteration K, none inside a collective.

Controller loss (see :mod:`link`): if no controller answers within ``lost_after_s`` of
the control connection closing (a standby at the same address, or the leader of a
higher term in the lease directory, would; the processor then registers again and
training goes on), the controller is lost: logged once, and the ranks write the
checkpoint of the last completed iteration themselves (:meth:`Processor.on_controller_lost`,
:mod:`without_controller`), or exit 78 when they cannot.

The control plane imports no torch: aborting the collectives on STOP(recover) and the
rendezvous store of a controller successor are hooks the runtime registers
(:meth:`Processor.set_recovery_hooks`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable, Optional, Tuple, Union

from mindspeed_ha import env as ha_env
from mindspeed_ha.config import ENV_AUTH_KEY, ENV_CONNECT_TIMEOUT, ConfigError, HAConfig
from mindspeed_ha.control import auth, wire
from mindspeed_ha.control.actions import ActionRunner, Handler
from mindspeed_ha.control.integrity import IntegrityReport
from mindspeed_ha.control.link import ControlLink, Outbox
from mindspeed_ha.control.policy import ActionKind
from mindspeed_ha.control.protocol import RecoveryHooks, StepProtocol, StopRequest
from mindspeed_ha.control.state import Layout, OptimizerStatus
from mindspeed_ha.control.without_controller import Exchange, WithoutController
from mindspeed_ha.mp_tempdir import release_mp_tempdir
from mindspeed_ha.errors import ProcessorExited
from mindspeed_ha.faults import EXIT_CONTROLLER_LOST, ControlPlaneError, FaultKind, classify, describe

log = logging.getLogger(__name__)

ExitHandler = Callable[[int, str], None]

__all__ = ["Exchange", "ExitHandler", "Handler", "Processor", "ProcessorExited", "default_exit_handler"]


def default_exit_handler(code: int, reason: str) -> None:
    """Flush logging and end the process with ``code`` (no atexit, no collective teardown)."""
    log.error("mindspeed-ha: exiting with code %d: %s", code, reason)
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - best effort before _exit
            pass
    release_mp_tempdir()  # what the skipped interpreter teardown would remove
    os._exit(code)


class Processor:
    """The control-plane endpoint of one rank.

    Args:
        config: the job's HAConfig (``auth_key`` required).
        rank: global rank.
        layout: the rank's parallel layout (see state.Layout).
        save_dir: Megatron ``--save`` (None: no dying checkpoint possible).
        world_size: job world size (default: tp*pp*dp*cp of the layout).
        iteration: iteration of the loaded state, if any (status UPDATED at it).
        port / addr: controller endpoint (default: the lease directory's leader, else the config's).
        run_id: job identifier reported at registration.
        exit_handler: called on EXIT as ``fn(code, reason)``; default ends the process.

    Raises:
        ConfigError: no auth key, or ZeroMQ without CURVE.
    """

    def __init__(self, config: HAConfig, rank: int, layout: Layout, save_dir: Optional[str] = None, *,
                 world_size: Optional[int] = None, iteration: Optional[int] = None,
                 addr: Optional[str] = None, port: Optional[int] = None, run_id: str = "",
                 exit_handler: Optional[ExitHandler] = None):
        if config.auth_key is None:
            raise ConfigError(f"the processor needs the job's auth key: set {ENV_AUTH_KEY} (hex)")
        self.config = config
        self.rank = rank
        self.layout = layout
        self.save_dir = save_dir
        self.world_size = world_size or layout.tp_size * layout.pp_size * layout.dp_size * layout.cp_size
        self.run_id = run_id
        self.exit_handler: ExitHandler = exit_handler or default_exit_handler
        self.codec = wire.Codec(config.auth_key, wire.new_sender("rank", rank), config.max_message_bytes)
        keys = auth.derive_keys(config.auth_key)  # ConfigError without CURVE
        self.freeze_deadline_s = (config.stop_timeout_s + 3 * config.action_timeout_s
                                  + config.heartbeat_timeout_s)
        self._cond = threading.Condition(threading.Lock())
        self._outbox = Outbox(self._cond)
        self._proto = StepProtocol(rank, self._cond, self._outbox, self.freeze_deadline_s, iteration)
        #: set when STOP or DRAIN arrives (a stop is under way); for the runtime and tests to wait on
        self.stop_event = self._proto.stop_event
        self._actions = ActionRunner(rank, on_exit=self._end, on_done=self._action_done)
        self._orphan = WithoutController(rank, layout, save_dir, self.world_size, self._proto, self._actions,
                                         config.action_timeout_s, self._end)
        self.link = ControlLink(config, rank, self.codec, keys, self._proto, self._outbox, addr=addr, port=port,
                                handle=self._handle, register_body=self._register_body,
                                on_lost=self._orphan.start, end=self._end, world_size=self.world_size)
        # ARF: the launcher's restarts of this rank's process, and whether it can rejoin
        self.incarnation = int(os.environ.get(ha_env.INCARNATION, "0") or 0)
        #: a hot switch's new process: it registers as its rank's incoming process (REGISTER.switching)
        self.switching = os.environ.get(ha_env.SWITCH) == "1" and self.incarnation > 0
        self.rejoins = False
        #: the sub-health sampler thread (--ha-subhealth; see subhealth_sampler), started with the link
        self.subhealth = None
        if config.subhealth.enabled:
            from mindspeed_ha.control.subhealth_sampler import SubhealthSampler, select_source

            def queue_health(body, cond=self._cond, outbox=self._outbox):
                with cond:  # nothing queued once closed or with no controller to send to
                    if not outbox.closed and self.link.controller_lost_at is None:
                        outbox.put_locked(body)

            self.subhealth = SubhealthSampler(rank, queue_health, lambda: self.status()[1],
                                              config.subhealth.window_s, select_source())

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: Optional[float] = None) -> "Processor":
        """Connect, register and start the threads; block until REGISTERED.

        REGISTER is re-sent with backoff (0.1 s doubling to 2 s) until answered; the
        wait is bounded by ``timeout``. Registration is logged once, at the first
        REGISTERED. The I/O thread owns the socket, the context and the wake pipe and
        closes them when it ends; a failure before it runs closes them here.

        Raises:
            ControlPlaneError: no REGISTERED within ``timeout`` (default
                ``config.connect_timeout_s``) or the controller refused the rank.
        """
        self.link.open()
        try:
            self._actions.start()
        except BaseException:
            self.close(None)
            raise
        wait = self.config.connect_timeout_s if timeout is None else timeout
        if not self.link.registered.wait(wait) or self.link.register_error:
            why = self.link.register_error or (f"no answer from {self.link.addr}:{self.link.port} within {wait} s "
                                               f"(--ha-connect-timeout / {ENV_CONNECT_TIMEOUT})")
            self.close(None)
            raise ControlPlaneError(f"rank {self.rank}: controller registration failed: {why} (check "
                                    f"{ha_env.CONTROLLER_ADDR}/{ha_env.TTP_ADDR}, {ha_env.TTP_PORT}, {ENV_AUTH_KEY})")
        if self.subhealth is not None:
            self.subhealth.start()
        return self

    def close(self, exit_code: Optional[int] = 0, timeout: float = 2.0) -> None:
        """Send GOODBYE(exit_code) (unless None), stop the threads, close the socket.

        Idempotent; a second call (e.g. the main thread after EXIT closed the
        processor from the action thread) only waits for the threads to end.
        """
        with self._cond:
            first = not self._outbox.closed
            self._outbox.closed = True
            if first and exit_code is not None and self.link.sock is not None:
                self._outbox.add_locked(wire.Goodbye(self.rank, int(exit_code)))
                self._outbox.goodbye_queued = True
            self._cond.notify_all()
        if first:
            if self.subhealth is not None:
                self.subhealth.stop()
            self.link.stop()
            self._actions.put(None)
        me = threading.current_thread()
        for t in (self.link.thread, self._actions.thread):
            if t is not None and t is not me and t.ident is not None:
                t.join(timeout)
                if t.is_alive() and first:  # the I/O thread closes its socket and context when it ends
                    log.error("rank %d: %s did not stop within %.1f s", self.rank, t.name, timeout)

    @property
    def lost_after_s(self) -> float:
        """Seconds without a working control connection before the controller counts as
        lost (see :attr:`ControlLink.lost_after_s`)."""
        return self.link.lost_after_s

    @property
    def controller_lost_at(self) -> Optional[float]:
        """``time.monotonic()`` when the controller was declared lost (None: it was not)."""
        return self.link.controller_lost_at

    @property
    def stop_received_at(self) -> Optional[float]:
        """``time.monotonic()`` of the STOP or DRAIN that started the stop under way (None: none)."""
        return self._proto.stop_received_at

    @property
    def frozen(self) -> bool:
        """No optimizer update can start: frozen by STOP, or paused at a drain limit."""
        with self._cond:
            return self._proto.frozen

    # ------------------------------------------------------------------ registration (runtime)
    def on_action(self, kind: Union[str, ActionKind], handler: Handler) -> None:
        """Register ``handler(params) -> (ok, detail)`` for ACTIONs of ``kind`` (action thread).

        A handler for VERIFY registered before :meth:`start` makes the rank announce that it
        verifies its state (REGISTER), and the controller then waits for its report.
        """
        self._actions.register(kind, handler)

    def on_controller_lost(self, exchange: Exchange) -> None:
        """Let this rank write the checkpoint itself if the controller is lost.

        ``exchange(record) -> records``: an all-gather of one JSON-able dict per rank, in
        rank order, over a process group every rank made at start-up (the controller and
        torchrun's store are gone; the group's connections are not). It must raise when a
        rank is gone, or silent past its timeout. Without it, a lost controller ends the
        rank with exit 78.
        """
        self._orphan.exchange = exchange

    def set_recovery_hooks(self, abort: Callable[[str], None], aborted: Callable[[str], BaseException],
                           use_store: Callable[[str], None],
                           pause_task: Optional[Callable[[wire.PauseTask], wire.PauseTaskResult]] = None) -> None:
        """The training side of an in-place recovery (see :class:`~protocol.RecoveryHooks`):
        ``abort(reason)`` on STOP(recover), ``aborted(message)`` the exception the step
        calls raise until RETRY, ``use_store("host:port")`` for a successor's store,
        ``pause_task(task) -> result`` for the pause tasks (check, relink; None: "not run").
        Register before :meth:`start` (the runtime does, ``runtime/bootstrap.py``); without
        it the processor has no collectives to interrupt."""
        with self._cond:
            self._proto.hooks = (RecoveryHooks(abort, aborted, use_store) if pause_task is None
                                 else RecoveryHooks(abort, aborted, use_store, pause_task))

    # ------------------------------------------------------------------ step protocol (training thread)
    def status(self) -> Tuple[OptimizerStatus, int]:
        """Authoritative (status, iteration)."""
        return self._proto.status()

    def begin_update(self, iteration: int) -> None:
        """Mark the optimizer UPDATING for ``iteration``; blocks while frozen.

        Raises:
            ControllerLostError: frozen longer than ``freeze_deadline_s``.
            ProcessorExited: the controller ended the rank and the exit handler returned.
            IllegalTransition: out-of-order call.
            the ``aborted`` hook's exception: the step is aborted for an in-place recovery.
        """
        self._proto.begin_update(iteration)

    def end_update(self, iteration: int) -> None:
        """Mark the optimizer UPDATED at ``iteration`` (never blocks). While frozen the
        controller waits for exactly this news (an update finishing after STOP): the I/O
        thread is woken to send it now instead of at its next heartbeat."""
        self._proto.end_update(iteration)

    def mark_unknown(self) -> None:
        """Report this rank's optimizer status UNKNOWN (its state is about to be
        overwritten: neither a dying checkpoint nor an in-place plan may use it)."""
        self._proto.mark_unknown()

    def pause_point(self, iteration: int) -> None:
        """The training thread is about to start the iteration after ``iteration``, the last
        one it completed; pause here while a graceful stop's limit says so
        (``iteration >= limit``).

        While paused the rank is stable at UPDATED(``iteration``) and counts as frozen;
        the controller's EXIT ends the process from the action thread. Returns at once
        when no stop is under way (a lock and a comparison).

        Raises:
            ProcessorExited: the controller ended the rank and the exit handler returned.
            the ``aborted`` hook's exception: the step is aborted for an in-place recovery.
        """
        if self._proto.pause_point(iteration, lost=self.link.controller_lost_at is not None):
            self._end(EXIT_CONTROLLER_LOST, f"rank {self.rank}: paused for {self.freeze_deadline_s:.0f} s "
                      "without an action")

    def report_fault(self, exc_or_kind: Union[BaseException, FaultKind, str], iteration: int,
                     timeout: Optional[float] = None, where: str = "train_step") -> wire.Action:
        """Report a fault of the training step and wait for the main thread's action.

        Args:
            exc_or_kind: the caught exception (classified) or a FaultKind.
            iteration: the iteration being computed.
            where: what raised (``train_step``, or the fault guard outside it: ``train``,
                ``save``, ``final_save``, ``eval``); only a step can be re-run in place.
            timeout: deadline, seconds (default ``freeze_deadline_s``).

        Returns:
            The ACTION for the main thread (RETRY / EXIT). On deadline, a synthetic EXIT
            with code EXIT_CONTROLLER_LOST (action_id -1).
        """
        if isinstance(exc_or_kind, BaseException):
            kind, message = classify(exc_or_kind), describe(exc_or_kind)
        else:
            kind = FaultKind(exc_or_kind)
            message = kind.value
        deadline = time.monotonic() + (self.freeze_deadline_s if timeout is None else timeout)
        action = self._proto.wait_action(iteration, kind.value, message, where, deadline)
        if action is None:
            return wire.Action(-1, ActionKind.EXIT.value,
                               {"code": EXIT_CONTROLLER_LOST, "reason": "no action from the controller"})
        return action

    def wait_to_rejoin(self, timeout: Optional[float] = None) -> wire.Action:
        """ARF: this restarted process built its model and optimizer; tell the controller
        it waits at its rejoin point (STOPPED, then FAULT ``process`` with ``where=
        "rejoin"``) and wait for the action (RETRY with the rejoin plan; EXIT when the
        job takes the dying-checkpoint path instead). Same return and deadline as
        :meth:`report_fault`."""
        with self._cond:
            st, it = self._proto.rank_state.snapshot()
            self._outbox.put_locked(wire.Stopped(self.rank, st.value, it, -1, -1))
        return self.report_fault(FaultKind.PROCESS, -1, timeout=timeout, where="rejoin")

    def report_integrity(self, report: IntegrityReport) -> None:
        """Send the integrity of this rank's frozen state (from the VERIFY handler, so it
        reaches the controller before that action's result)."""
        with self._cond:
            self._orphan.integrity = report
            self._outbox.put_locked(wire.Integrity(self.rank, int(report.iteration), bool(report.shard_ok),
                                                   str(report.shard_digest), bool(report.model_ok),
                                                   str(report.model_digest), str(report.detail)[:1000]))

    def action_result(self, action_id: int, ok: bool, detail: str) -> None:
        """Send the result of a main-thread action (RETRY: after the rank recovered)."""
        with self._cond:
            self._outbox.put_locked(wire.ActionResult(int(action_id), self.rank, bool(ok), str(detail)))

    def request_stop(self, reason: str, exit_code: int = 143) -> bool:
        """Ask the controller for a graceful stop of the job (this rank got SIGTERM/SIGINT).

        Safe in a signal handler: it never waits for a lock another thread of this
        process could hold for long (a lock the interrupted main thread holds is given
        up after 50 ms and the I/O thread sends the request at its next wake-up, within
        ``heartbeat_interval_s``). If no STOP or DRAIN follows within
        ``heartbeat_timeout_s`` (and the controller is not lost), the rank ends with
        ``exit_code`` (143: what SIGTERM's default action reports).

        Returns:
            False when there is no controller to ask (not registered yet, closed, ended):
            the caller then takes the signal's default action.
        """
        proto = self._proto
        if (self._outbox.closed or proto.exit is not None or not self.link.registered.is_set()
                or self.link.sock is None):
            return False
        if proto.stop_request is None:
            proto.stop_request = StopRequest(str(reason), int(exit_code), time.monotonic())
        if self._cond.acquire(timeout=0.05):
            try:
                proto.queue_stop_request_locked()
            finally:
                self._cond.release()
        return True

    # ------------------------------------------------------------------ internals
    def _register_body(self) -> wire.Register:
        status, it = self.status()
        verifies = self._actions.handler(ActionKind.VERIFY) is not None
        return wire.Register(self.rank, self.world_size, os.getpid(), socket.gethostname(), self.layout,
                             self.save_dir, self.run_id, status.value, it, verifies, self.incarnation,
                             self.rejoins, self.switching)

    def _handle(self, msg: wire.Message) -> None:
        """A message from the controller (I/O thread)."""
        t, body, link = msg.type, msg.body, self.link
        if t is wire.MsgType.REGISTERED:
            if body.accepted:
                link.disconnected_at = None  # e.g. a new leader answered
                if not link.registered.is_set():  # once: answers to repeated REGISTERs are not news
                    log.info("rank %d registered with the controller at %s:%s (REGISTER sent %d times)",
                             self.rank, link.addr, link.port, link.register_attempts)
                link.registered.set()
            elif body.detail.startswith("unregistered"):  # never the answer to a REGISTER
                # a new controller: register again (not registered yet: the answer to a frame
                # sent before this rank's REGISTER, e.g. one a relay held through a failover)
                link.registered.clear()
            else:
                link.register_error = body.detail
                link.registered.set()
        elif t is wire.MsgType.STOP:
            self._proto.on_stop(body)
        elif t is wire.MsgType.DRAIN:
            self._proto.on_drain(body)
        elif t is wire.MsgType.RELEASE:
            self._proto.on_release(body)
        elif t is wire.MsgType.PAUSE_TASK:  # check / relink: run by the paused training thread
            self._proto.on_pause_task(body)
        elif t is wire.MsgType.GOODBYE_ACK:
            link.goodbye_acked = True
        elif t is wire.MsgType.ACTION:
            if body.params.get("store"):  # a successor's rendezvous store (controller failover)
                self._proto.hooks.use_store(str(body.params["store"]))
            self._actions.put(body)
        else:
            self.codec.rejected["unexpected_type"] += 1

    def _action_done(self, action: wire.Action, ok: bool, detail: str) -> None:
        """An action ran (action thread): send its result; RETRY goes to the training thread."""
        with self._cond:
            if action.kind != ActionKind.RETRY.value:  # RETRY: the training thread answers once recovered
                self._outbox.put_locked(wire.ActionResult(action.action_id, self.rank, bool(ok), str(detail)))
            if action.kind == ActionKind.RETRY.value:
                self._proto.deliver_locked(action)

    def _end(self, code: int, reason: str, action: Optional[wire.Action] = None) -> None:
        """End this rank with ``code`` (the controller's EXIT ``action``, action thread; or
        the rank's own verdict): close (GOODBYE flushed, with linger, before the
        handler ends the process), hand the EXIT ``action`` (if any) to the training
        thread, then call the exit handler. Without an action (the rank's own verdict)
        only the first call ends the rank."""
        with self._cond:
            if action is None and self._proto.exit is not None:
                return
            self._proto.end_locked(code, reason)
        self.close(code)
        if action is not None:
            with self._cond:
                self._proto.deliver_locked(action)
        self.exit_handler(code, reason)
        with self._cond:
            self._proto.exit_returned = True
            self._cond.notify_all()
