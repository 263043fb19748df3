"""The processor: one per training rank, the rank's end of the control plane.

Threads (both daemons, started by :meth:`Processor.start`):

* I/O thread ("heartbeat thread"): owns the DEALER socket (a CURVE client, keys derived
  from the job's auth key, see :mod:`auth`); registers (re-sent with
  backoff until REGISTERED), sends a HEARTBEAT every ``heartbeat_interval_s``, drains
  the outbox, answers STOP at once, hands ACTIONs to the action thread. ZeroMQ
  reconnects by itself (100 ms, backing off to 2 s).
* action thread: runs the handlers registered with :meth:`on_action` (a long save
  never delays heartbeats) and sends ACTION_RESULT.

Step protocol, called by the training main thread (call-ordering rules):

1. ``begin_update(k)`` right before the optimizer update that produces iteration k;
2. ``end_update(k)`` right after it completed (on every rank of the instance);
3. on an exception in the step: ``report_fault(exc, k)``, which returns the
   controller's action for the main thread (RETRY / RESUME / EXIT).

Both update calls take the lock, move the authoritative :class:`RankState` and mark
it dirty: a few microseconds, no I/O, no thread wake-up. The I/O thread sends the
latest status as one STATUS at its next wake-up (at most ``heartbeat_interval_s``
later; every HEARTBEAT carries it too). Intermediate statuses are coalesced: the
controller needs exact status only at STOP, and STOPPED carries it.

Freeze protocol: on STOP the I/O thread sets ``frozen`` under the same lock, takes
the authoritative status and queues STOPPED behind every earlier STATUS, so the
controller's view is exact. While frozen, ``begin_update`` blocks (no new mutation
starts) until RESUME/RETRY, or the process is ended by EXIT; ``end_update`` of an
update already running still completes and is reported. If no action arrives within
the freeze deadline, ``begin_update`` raises :class:`ControllerLostError`.

Graceful stop (DRAIN, after SIGTERM/SIGINT): the training thread calls
:meth:`Processor.pause_point` before it starts an iteration, with the last one it
completed (the training loop has counted, logged, evaluated and saved that one, so a
checkpoint of it is what Megatron-LM's own save of it would hold). DRAIN(-1) sets a pause
limit at the iteration now in progress and answers DRAINING with it; DRAIN(K) moves the
limit to K, the highest any rank announced. ``pause_point(k)`` blocks while
``k >= limit`` (the rank is then stable at UPDATED(k) and answers STOPPED(pause_at=k)),
so every rank ends paused after the same iteration K, none inside a collective.

Controller loss: the DEALER sends ZeroMQ heartbeats (PING every ``heartbeat_interval_s``;
no answer within ``heartbeat_timeout_s / 2`` closes the connection) and a socket
monitor reports the close, at once when the controller's process dies. If no
controller answers a new connection within another ``heartbeat_timeout_s / 2`` (a
standby would, at the same address; the processor then registers again and training
goes on), the controller is lost: logged once, and the ranks write the checkpoint of
the last completed iteration themselves (:meth:`Processor.on_controller_lost`, see
:meth:`Processor._without_controller`), or exit 78 when they cannot.
"""

from __future__ import annotations

from mindspeed_ha import env as ha_env
from mindspeed_ha.errors import ProcessorExited  # noqa: F401  (one error tree)
import collections
import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple, Union

import zmq

from mindspeed_ha.config import ENV_AUTH_KEY, ENV_CONNECT_TIMEOUT, ConfigError, HAConfig
from mindspeed_ha.control import auth, wire
from mindspeed_ha.control.integrity import IntegrityReport
from mindspeed_ha.control.lease import ENV_LEASE_DIR, LeaseDir, lease_seconds
from mindspeed_ha.control.policy import ActionKind, DumpPlan, agree_pause, plan_without_controller
from mindspeed_ha.control.state import Layout, OptimizerStatus, RankInfo, RankState
from mindspeed_ha.faults import (
    EXIT_CONTROLLER_LOST,
    EXIT_DYING_CHECKPOINT_SAVED,
    EXIT_FAULT_UNRECOVERABLE,
    EXIT_NO_COMPLETE_DATA,
    ControllerLostError,
    ControlPlaneError,
    FaultKind,
    HAError,
    classify,
    describe,
)

log = logging.getLogger(__name__)

Handler = Callable[[Dict[str, Any]], Tuple[bool, str]]
ExitHandler = Callable[[int, str], None]
#: all-gather of one JSON-able dict per rank over a process group every rank made at
#: start-up; returns the list in rank order; raises when a rank is gone or silent
Exchange = Callable[[Dict[str, Any]], List[Dict[str, Any]]]

#: socket-monitor events of the control connection (its close, a new authenticated one)
_CONNECTION_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED

#: how long a GOODBYE may take to leave when the processor closes (ms); every other close: 0
GOODBYE_LINGER_MS = 500
#: seconds between two looks into the lease directory while the control connection is closed
LEASE_POLL_S = 0.25

#: actions whose arrival is delivered to the main thread (report_fault / begin_update)
MAIN_THREAD_KINDS = frozenset({ActionKind.RETRY.value, ActionKind.RESUME.value, ActionKind.EXIT.value})


def default_exit_handler(code: int, reason: str) -> None:
    """Flush logging and end the process with ``code`` (no atexit, no collective teardown)."""
    log.error("mindspeed-ha: exiting with code %d: %s", code, reason)
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - best effort before _exit
            pass
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
        port / addr: controller endpoint (default from config).
        run_id: job identifier reported at registration.
        exit_handler: called on EXIT as ``fn(code, reason)``; default ends the process.
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
        self.addr = addr or config.controller_addr
        self.port = config.controller_port if port is None else port
        # controller failover: the leader of the highest term in the job's lease directory
        lease_path = os.environ.get(ENV_LEASE_DIR)
        self._lease = LeaseDir(lease_path) if lease_path else None
        self._lease_s = lease_seconds() if lease_path else 0.0
        self._term = -1
        self._next_lease_check = 0.0
        self._left: set = set()  # (host, port) of the leaders this rank left: their events are old news
        if self._lease is not None and addr is None and port is None:
            cur = self._lease.current()
            if cur is not None:  # e.g. a rank restarted after its node was lost: the leader moved
                self.addr, self.port, self._term = cur.host, cur.port, cur.term
        self.run_id = run_id
        self.exit_handler: ExitHandler = exit_handler or default_exit_handler
        self.codec = wire.Codec(config.auth_key, wire.new_sender("rank", rank), config.max_message_bytes)
        self._keys = auth.derive_keys(config.auth_key)  # ConfigError without CURVE
        self.freeze_deadline_s = (config.stop_timeout_s + 3 * config.action_timeout_s
                                  + config.heartbeat_timeout_s)
        self._state = RankState(rank)
        if iteration is not None:
            self._state.transition(OptimizerStatus.UPDATED, iteration)
        self._cond = threading.Condition(threading.Lock())
        self._frozen = False
        self._exited: Optional[Tuple[int, str]] = None
        self._main_action: Optional[wire.Action] = None
        self._outbox: Deque[Any] = collections.deque()
        self._wake_pending = False
        self._status_dirty = False
        self._handlers: Dict[str, Handler] = {}
        self._actions: Deque[Optional[wire.Action]] = collections.deque()
        self._actions_cv = threading.Condition(threading.Lock())
        self._registered = threading.Event()
        self._register_attempts = 0  # REGISTER frames sent (I/O thread only)
        self._register_error: Optional[str] = None
        self._stop_io = threading.Event()
        self._ctx: Optional[zmq.Context] = None
        self._sock = None
        self._wake_r = self._wake_w = -1
        self._io: Optional[threading.Thread] = None
        self._worker: Optional[threading.Thread] = None
        self._closed = False
        self._goodbye_queued = False
        self.stop_received_at: Optional[float] = None
        # ARF: the launcher's restarts of this rank's process, and whether it can rejoin
        self.incarnation = int(os.environ.get(ha_env.INCARNATION, "0") or 0)
        self.rejoins = False
        #: set when STOP or DRAIN arrives (a stop is under way); for the runtime and tests to wait on
        self.stop_event = threading.Event()
        # graceful stop (guarded by _cond): pause limit, where the training thread is paused,
        # the last iteration it completed (pause_point), whether it waits in report_fault
        self._limit: Optional[int] = None
        self._paused_at: Optional[int] = None
        self._completed: Optional[int] = None
        self._in_fault = False
        self._last_fault: Optional[wire.Fault] = None  # re-sent to a new leader while in_fault
        self._recovering = False  # STOP(recover) until RETRY: the step must not go on (guarded by _cond)
        self._observed = False  # STOP(freeze=False) until RETRY: send each status change at once
        self._step = -1  # the train_step the training thread entered (pause_point), -1 before
        self._exit_returned = False  # the exit handler returned (test doubles; normally it ends the process)
        # a termination signal asked for a graceful stop: (reason, exit code if nobody acts, when)
        self._stop_request: Optional[Tuple[str, int, float]] = None
        self._stop_request_queued = False
        # controller loss (I/O thread): monitor socket, when the connection closed, verdict
        self._monitor = None
        self._disconnected_at: Optional[float] = None
        self.controller_lost_at: Optional[float] = None
        self._exchange: Optional[Exchange] = None
        self._integrity: Optional[IntegrityReport] = None
        self._orphan: Optional[threading.Thread] = None

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
        ctx = zmq.Context()
        sock = None
        wake: Tuple[int, ...] = ()
        try:
            sock = ctx.socket(zmq.DEALER)
            wire.configure_socket(sock, self.config.max_message_bytes)
            auth.configure_client(sock, self._keys)
            sock.setsockopt(zmq.ROUTING_ID, f"r{self.rank}-{secrets.token_hex(4)}".encode())
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            # ZMTP heartbeats (libzmq >= 4.2): a silent controller host closes the connection
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(self.config.heartbeat_interval_s * 1000)))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(self.lost_after_s * 1000)))
            self._monitor = sock.get_monitor_socket(_CONNECTION_EVENTS)
            sock.connect(wire.endpoint(self.addr, self.port))
            wake = os.pipe()
            for fd in wake:
                os.set_blocking(fd, False)
            self._ctx, self._sock = ctx, sock
            self._wake_r, self._wake_w = wake
            self._io = threading.Thread(target=self._io_loop, name=f"mindspeed-ha-processor-{self.rank}",
                                        daemon=True)
            self._worker = threading.Thread(target=self._action_loop, name=f"mindspeed-ha-action-{self.rank}",
                                            daemon=True)
            self._io.start()
        except BaseException:  # nothing runs yet: close what was made here
            self._io = self._worker = None
            self._ctx = self._sock = None
            monitor, self._monitor = self._monitor, None
            self._wake_r = self._wake_w = -1
            for fd in wake:
                os.close(fd)
            wire.close_all(ctx, monitor, sock)
            raise
        try:
            self._worker.start()
        except BaseException:
            self.close(None)
            raise
        wait = self.config.connect_timeout_s if timeout is None else timeout
        if not self._registered.wait(wait) or self._register_error:
            why = self._register_error or (f"no answer from {self.addr}:{self.port} within {wait} s "
                                           f"(--ha-connect-timeout / {ENV_CONNECT_TIMEOUT})")
            self.close(None)
            raise ControlPlaneError(f"rank {self.rank}: controller registration failed: {why} "
                                    "(check CONTROLLER_ADDR/TTP_ADDR, TTP_PORT, MINDSPEED_HA_AUTH_KEY)")
        return self

    def close(self, exit_code: Optional[int] = 0, timeout: float = 2.0) -> None:
        """Send GOODBYE(exit_code) (unless None), stop the threads, close the socket.

        Idempotent; a second call (e.g. the main thread after EXIT closed the
        processor from the action thread) only waits for the threads to end.
        """
        with self._cond:
            first = not self._closed
            self._closed = True
            if first and exit_code is not None and self._sock is not None:
                self._outbox.append(wire.Goodbye(self.rank, int(exit_code)))
                self._goodbye_queued = True
            self._cond.notify_all()
        if first:
            self._stop_io.set()
            with self._cond:
                self._poke()
            with self._actions_cv:
                self._actions.append(None)
                self._actions_cv.notify()
        me = threading.current_thread()
        for t in (self._io, self._worker):
            if t is not None and t is not me and t.ident is not None:
                t.join(timeout)
                if t.is_alive() and first:  # the I/O thread closes its socket and context when it ends
                    log.error("rank %d: %s did not stop within %.1f s", self.rank, t.name, timeout)

    # ------------------------------------------------------------------ step protocol
    @property
    def lost_after_s(self) -> float:
        """Seconds without a working control connection before the controller counts as
        lost, and the ZeroMQ heartbeat timeout: half the heartbeat timeout each, so a
        silent controller host is declared lost within ``heartbeat_timeout_s``."""
        return self.config.heartbeat_timeout_s / 2

    @property
    def frozen(self) -> bool:
        """No optimizer update can start: frozen by STOP, or paused at a drain limit."""
        with self._cond:
            return self._frozen or self._paused_at is not None

    def on_controller_lost(self, exchange: Exchange) -> None:
        """Let this rank write the checkpoint itself if the controller is lost.

        ``exchange(record) -> records``: an all-gather of one JSON-able dict per rank, in
        rank order, over a process group every rank made at start-up (the controller and
        torchrun's store are gone; the group's connections are not). It must raise when a
        rank is gone, or silent past its timeout. Without it, a lost controller ends the
        rank with exit 78.
        """
        self._exchange = exchange

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
        if self._closed or self._exited is not None or not self._registered.is_set() or self._sock is None:
            return False
        if self._stop_request is None:
            self._stop_request = (str(reason), int(exit_code), time.monotonic())
        if self._cond.acquire(timeout=0.05):
            try:
                self._queue_stop_request_locked()
            finally:
                self._cond.release()
        return True

    def _queue_stop_request_locked(self) -> None:
        if self._stop_request is not None and not self._stop_request_queued:
            self._stop_request_queued = True
            self._queue_locked(wire.StopRequest(self.rank, self._stop_request[0]))
            log.warning("rank %d: %s: asking the controller for a graceful stop", self.rank, self._stop_request[0])

    def pause_point(self, iteration: int) -> None:
        """The training thread is about to start the iteration after ``iteration``, the last
        one it completed; pause here while a graceful stop's limit says so
        (``iteration >= limit``).

        While paused the rank is stable at UPDATED(``iteration``) and counts as frozen;
        the controller's EXIT ends the process from the action thread. Returns at once
        when no stop is under way (a lock and a comparison).

        Raises:
            ProcessorExited: the controller ended the rank and the exit handler returned.
        """
        timed_out = False
        with self._cond:
            self._raise_if_recovering_locked()
            self._completed = int(iteration)
            if self._step != self._completed + 1:
                self._step = self._completed + 1
                if self._observed:  # in-place recovery, round 1: the controller waits for this
                    self._status_dirty = True
                    self._poke()
            if self._limit is None or iteration < self._limit or self._exited is not None:
                return
            self._paused_at = int(iteration)
            st, it = self._state.snapshot()
            if self.controller_lost_at is None:
                self._queue_locked(wire.Stopped(self.rank, st.value, it, int(iteration)))
            self._cond.notify_all()
            log.warning("rank %d: paused after iteration %d (graceful stop)", self.rank, iteration)
            deadline = time.monotonic() + self.freeze_deadline_s
            try:
                while self._limit is not None and iteration >= self._limit and self._exited is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        timed_out = True
                        break
                    self._cond.wait(left)
            finally:
                self._paused_at = None
            exited = self._exited
            while exited is not None and not self._exit_returned:
                self._cond.wait()  # the exit handler ends the process; a test double returns
        if timed_out:
            self._end(EXIT_CONTROLLER_LOST, f"rank {self.rank}: paused for {self.freeze_deadline_s:.0f} s "
                      "without an action")
        if exited is not None:
            raise ProcessorExited(f"rank {self.rank}: job ended ({exited[1]})")

    def _next_pause_locked(self) -> int:
        """The iteration this rank is computing, or will compute next (-1: not started)."""
        if self._completed is not None:
            return self._completed + 1
        st, it = self._state.snapshot()
        if st is OptimizerStatus.UPDATING:
            return it
        if st is OptimizerStatus.UPDATED and it >= 0:
            return it + 1
        return -1

    def status(self) -> Tuple[OptimizerStatus, int]:
        """Authoritative (status, iteration)."""
        with self._cond:
            return self._state.snapshot()

    def begin_update(self, iteration: int) -> None:
        """Mark the optimizer UPDATING for ``iteration``; blocks while frozen.

        Raises:
            ControllerLostError: frozen longer than ``freeze_deadline_s``.
            ProcessorExited: the controller ended the rank and the exit handler returned.
            IllegalTransition: out-of-order call.
        """
        with self._cond:
            self._raise_if_recovering_locked()
            if self._frozen and self._exited is None:
                deadline = time.monotonic() + self.freeze_deadline_s
                while self._frozen and self._exited is None:
                    self._raise_if_recovering_locked()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ControllerLostError(
                            f"rank {self.rank}: frozen for {self.freeze_deadline_s:.0f} s without an action")
                    self._cond.wait(left)
            if self._exited is not None:
                raise ProcessorExited(f"rank {self.rank}: job ended ({self._exited[1]})")
            self._state.transition(OptimizerStatus.UPDATING, iteration)
            self._status_dirty = True

    def end_update(self, iteration: int) -> None:
        """Mark the optimizer UPDATED at ``iteration`` (never blocks). While frozen the
        controller waits for exactly this news (an update finishing after STOP): the I/O
        thread is woken to send it now instead of at its next heartbeat."""
        with self._cond:
            self._state.transition(OptimizerStatus.UPDATED, iteration)
            self._status_dirty = True
            if self._frozen or self._observed:
                self._poke()

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
            The ACTION for the main thread (RETRY / RESUME / EXIT). On deadline, a
            synthetic EXIT with code EXIT_CONTROLLER_LOST (action_id -1).
        """
        if isinstance(exc_or_kind, BaseException):
            kind, message = classify(exc_or_kind), describe(exc_or_kind)
        else:
            kind = FaultKind(exc_or_kind)
            message = kind.value
        deadline = time.monotonic() + (self.freeze_deadline_s if timeout is None else timeout)
        with self._cond:
            self._in_fault = True
            self._main_action = None
            status, _ = self._state.snapshot()
            self._last_fault = wire.Fault(self.rank, int(iteration), kind.value, message, status.value, where)
            self._queue_locked(self._last_fault)
            log.error("rank %d: %s fault at iteration %d reported: %s", self.rank, kind.value, iteration, message)
            try:
                while self._main_action is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return wire.Action(-1, ActionKind.EXIT.value,
                                           {"code": EXIT_CONTROLLER_LOST, "reason": "no action from the controller"})
                    self._cond.wait(left)
                return self._main_action
            finally:
                self._in_fault = False

    def wait_to_rejoin(self, timeout: Optional[float] = None) -> wire.Action:
        """ARF: this restarted process built its model and optimizer; tell the controller
        it waits at its rejoin point (STOPPED, then FAULT ``process`` with ``where=
        "rejoin"``) and wait for the action (RETRY with the rejoin plan; EXIT when the
        job takes the dying-checkpoint path instead). Same return and deadline as
        :meth:`report_fault`."""
        with self._cond:
            st, it = self._state.snapshot()
            self._queue_locked(wire.Stopped(self.rank, st.value, it, -1, -1))
        return self.report_fault(FaultKind.PROCESS, -1, timeout=timeout, where="rejoin")

    def report_integrity(self, report: IntegrityReport) -> None:
        """Send the integrity of this rank's frozen state (from the VERIFY handler, so it
        reaches the controller before that action's result)."""
        with self._cond:
            self._integrity = report
            self._queue_locked(wire.Integrity(self.rank, int(report.iteration), bool(report.shard_ok),
                                              str(report.shard_digest), bool(report.model_ok),
                                              str(report.model_digest), str(report.detail)[:1000]))

    def on_action(self, kind: Union[str, ActionKind], handler: Handler) -> None:
        """Register ``handler(params) -> (ok, detail)`` for ACTIONs of ``kind`` (action thread).

        A handler for VERIFY registered before :meth:`start` makes the rank announce that it
        verifies its state (REGISTER), and the controller then waits for its report.
        """
        with self._actions_cv:
            self._handlers[ActionKind(kind).value] = handler

    # ------------------------------------------------------------------ internals
    def _queue_locked(self, body: Any) -> None:
        self._outbox.append(body)
        if not self._wake_pending:
            self._wake_pending = True
            self._poke()

    def _poke(self) -> None:
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except (BlockingIOError, OSError):
                pass

    def _send(self, body: Any) -> None:
        try:
            self._sock.send(self.codec.encode(body), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("rank %d: control queue full, %s dropped", self.rank, type(body).__name__)
        except (zmq.ZMQError, wire.WireError) as exc:
            log.warning("rank %d: cannot send %s: %s", self.rank, type(body).__name__, exc)

    def _register_body(self) -> wire.Register:
        status, it = self.status()
        with self._actions_cv:
            verifies = ActionKind.VERIFY.value in self._handlers
        return wire.Register(self.rank, self.world_size, os.getpid(), socket.gethostname(), self.layout,
                             self.save_dir, self.run_id, status.value, it, verifies, self.incarnation,
                             self.rejoins)

    def _flush_outbox(self) -> None:
        with self._cond:
            status = None
            if self._status_dirty:
                self._status_dirty = False
                st, it = self._state.snapshot()
                status = wire.Status(self.rank, st.value, it, self._step)
        if status is not None:
            self._send(status)
        while True:
            with self._cond:
                self._wake_pending = False
                if not self._outbox:
                    return
                body = self._outbox.popleft()
            self._send(body)

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        hb = self.config.heartbeat_interval_s
        backoff = 0.1
        next_register = time.monotonic()
        next_hb = time.monotonic() + hb
        try:
            while not self._stop_io.is_set():
                now = time.monotonic()
                lost = self.controller_lost_at is not None
                if not lost and not self._registered.is_set() and now >= next_register:
                    self._register_attempts += 1
                    log.debug("rank %d: REGISTER #%d to %s:%s", self.rank, self._register_attempts, self.addr,
                              self.port)
                    self._send(self._register_body())
                    next_register = now + backoff
                    backoff = min(backoff * 2, 2.0)
                if not lost and self._registered.is_set() and now >= next_hb:
                    st, it = self.status()
                    self._send(wire.Heartbeat(self.rank, it, st.value))
                    next_hb = now + hb
                self._check_controller(now)
                wake_at = next_hb if self._registered.is_set() else next_register
                if self._disconnected_at is not None and self.controller_lost_at is None:
                    wake_at = min(wake_at, self._disconnected_at + self._lost_after(),
                                  now + LEASE_POLL_S if self._lease is not None else wake_at)
                ready = dict(poller.poll(max(1, int((wake_at - time.monotonic()) * 1000))))
                if self._wake_r in ready:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                if self._monitor is not None and self._monitor in ready:
                    self._drain_monitor()
                while True:
                    try:
                        frame = self._sock.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    msg = self.codec.try_decode(frame.buffer, peer="controller")
                    if msg is not None and self.controller_lost_at is None:
                        self._handle(msg)
                if self.controller_lost_at is None and self._registered.is_set() and self._disconnected_at is None:
                    with self._cond:
                        self._queue_stop_request_locked()
                    self._flush_outbox()
        except Exception:  # noqa: BLE001 - keep the reason in the log, never crash silently
            log.exception("rank %d: processor I/O thread failed", self.rank)
        finally:
            self._close_io()

    def _drain_monitor(self) -> None:
        """Connection events: a close starts the loss clock, a new authenticated connection stops it."""
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                evt = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            now = time.monotonic()
            if _host_port(evt.get("endpoint", b"")) in self._left:
                continue  # the connection to a previous leader
            if evt["event"] == zmq.EVENT_DISCONNECTED:
                if self._disconnected_at is None and self._registered.is_set() and self.controller_lost_at is None:
                    self._disconnected_at = now
                    log.warning("rank %d: control connection to %s:%s closed; waiting up to %.1f s for a "
                                "controller to answer", self.rank, self.addr, self.port, self.lost_after_s)
            elif evt["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED and self._disconnected_at is not None:
                log.warning("rank %d: control connection to %s:%s open again after %.2f s", self.rank, self.addr,
                            self.port, now - self._disconnected_at)
                self._disconnected_at = None

    def _lost_after(self) -> float:
        """Seconds of closed connection before the controller is lost: ``lost_after_s``,
        plus, with a lease directory, two leases (the leader's lease runs out, a standby
        takes the next term and starts)."""
        return self.lost_after_s + 2 * self._lease_s

    def _follow_leader(self, now: float) -> bool:
        """The connection is closed: if a higher term than ours has a leader, connect to
        it and register again (the fault this rank waits on is reported again). True if so."""
        if self._lease is None or now < self._next_lease_check:
            return False
        self._next_lease_check = now + LEASE_POLL_S
        cur = self._lease.current()
        if cur is None or cur.term <= self._term:
            return False
        try:
            self._sock.disconnect(wire.endpoint(self.addr, self.port))
        except zmq.ZMQError:
            pass
        old = (self.addr, self.port, self._term)
        if (cur.host, cur.port) != (self.addr, self.port):
            self._left.add(_host_port(wire.endpoint(self.addr, self.port).encode()))
        self.addr, self.port, self._term = cur.host, cur.port, cur.term
        self._sock.connect(wire.endpoint(self.addr, self.port))
        self._registered.clear()
        self._disconnected_at = now  # until the new leader answers REGISTER (or the loss deadline)
        with self._cond:
            if self._in_fault and self._last_fault is not None:
                self._outbox.appendleft(self._last_fault)
        log.warning("rank %d: the controller at %s:%s (term %d) is gone; following the leader of term %d at %s:%s "
                    "(node %d)", self.rank, old[0], old[1], old[2], cur.term, cur.host, cur.port, cur.node_rank)
        return True

    def _check_controller(self, now: float) -> None:
        """Declare the controller lost (once), and end a rank whose stop request nobody answered."""
        if self.controller_lost_at is None and self._disconnected_at is not None and self._follow_leader(now):
            return
        if self.controller_lost_at is None and self._disconnected_at is not None \
                and now - self._disconnected_at > self._lost_after():
            self.controller_lost_at = now
            with self._cond:
                done = self._exited is not None or self._closed
            if done:
                return
            log.error("rank %d: CONTROLLER LOST: no controller at %s:%s for %.1f s (connection closed, no "
                      "standby answered); training stops and the ranks write the checkpoint of the last completed "
                      "iteration themselves", self.rank, self.addr, self.port, now - self._disconnected_at)
            self._orphan = threading.Thread(target=self._without_controller, daemon=True,
                                            name=f"mindspeed-ha-no-controller-{self.rank}")
            self._orphan.start()
            return
        req = self._stop_request
        if (req is not None and self.controller_lost_at is None and not self.stop_event.is_set()
                and now - req[2] > self.config.heartbeat_timeout_s):
            self._stop_request = None
            threading.Thread(target=self._end, args=(req[1], f"{req[0]}: no controller acted on the stop request "
                             f"within {self.config.heartbeat_timeout_s} s"), daemon=True).start()

    # ------------------------------------------------------------------ without a controller
    def _without_controller(self) -> None:
        """The controller is lost: write the dying checkpoint with the other ranks, no controller.

        Runs in its own thread; every rank runs the same steps, and each exchange is a
        collective over the start-up process group (:meth:`on_controller_lost`):

        1. each rank announces where it will pause (its drain limit if a graceful stop was
           under way, else the iteration in progress); K = :func:`policy.agree_pause`;
           every training thread pauses after iteration K (``pause_point``);
        2. each rank verifies its state (if it can) and announces status, layout and
           integrity report; every rank runs :func:`policy.plan_without_controller` on
           the same records and gets the same plan;
        3. dump, assemble, commit, each followed by an exchange of the results (a barrier).

        Exit codes: 75 committed; 76 nothing complete; 77 a write failed (staging removed
        by the savers' exit handler); 78 the ranks could not agree (a rank is gone or
        silent: no exchange without every rank), or this rank was waiting for the
        controller's action on a fault of its own.
        """
        try:
            code, reason = self._checkpoint_without_controller()
        except Exception as exc:  # noqa: BLE001 - any failure ends the rank with a clear code
            log.exception("rank %d: checkpoint without the controller failed", self.rank)
            code, reason = EXIT_CONTROLLER_LOST, f"controller lost; the ranks could not finish without it: " \
                                                 f"{describe(exc)}"
        self._end(code, reason)

    def _checkpoint_without_controller(self) -> Tuple[int, str]:
        exchange = self._exchange
        if exchange is None:
            return EXIT_CONTROLLER_LOST, "controller lost (no process group to agree without it)"
        with self._cond:
            if self._in_fault:
                return EXIT_CONTROLLER_LOST, "controller lost while this rank waited for its action on a fault"
            self._frozen = False  # a pause limit replaces any freeze
            mine = self._limit if self._limit is not None else self._next_pause_locked()
            self._limit = max(0, mine)
        records = exchange({"rank": self.rank, "pause_at": mine})
        k = agree_pause({int(r["rank"]): int(r["pause_at"]) for r in records})
        if k is None:
            return EXIT_NO_COMPLETE_DATA, "controller lost before any rank started an iteration; nothing written"
        log.warning("rank %d: without the controller: every rank pauses after iteration %d", self.rank, k)
        deadline = time.monotonic() + self.config.action_timeout_s
        with self._cond:
            self._limit = k
            self._cond.notify_all()
            while self._paused_at != k and self._exited is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            paused = self._paused_at == k
        if not paused:
            return EXIT_CONTROLLER_LOST, f"controller lost; this rank did not reach iteration {k} within " \
                                         f"{self.config.action_timeout_s} s"
        records = exchange(self._status_record())
        ranks = {int(r["rank"]): _rank_info(r) for r in records}
        save_dir = next((r["save_dir"] for r in records if r.get("save_dir")), None)
        verified = any(info.verifies for info in ranks.values())
        plan = plan_without_controller(ranks, save_dir, self.world_size, verified=verified)
        if not isinstance(plan, DumpPlan):
            return plan
        log.warning("rank %d: without the controller: %s", self.rank, plan.reason)
        params = plan.to_params(save_dir)
        for kind, targets in ((ActionKind.DUMP, plan.savers()), (ActionKind.ASSEMBLE, plan.assemblers.values()),
                              (ActionKind.COMMIT, (plan.committer,))):
            ok, detail = True, "nothing to do"
            if self.rank in set(targets):
                with self._actions_cv:
                    handler = self._handlers.get(kind.value)
                try:
                    ok, detail = handler(dict(params)) if handler else (False, f"no handler for {kind.value}")
                except Exception as exc:  # noqa: BLE001 - a failed step is a result
                    log.exception("rank %d: %s without the controller failed", self.rank, kind.value)
                    ok, detail = False, describe(exc)
            failed = [r for r in exchange({"rank": self.rank, "ok": bool(ok), "detail": str(detail)[:500]})
                      if not r["ok"]]
            if failed:
                return EXIT_FAULT_UNRECOVERABLE, (f"controller lost; {kind.value} failed on rank {failed[0]['rank']}: "
                                                  f"{failed[0]['detail']}; nothing committed")
        return EXIT_DYING_CHECKPOINT_SAVED, (f"controller lost; the ranks committed the checkpoint of iteration "
                                             f"{plan.iteration} to {save_dir} themselves")

    def _status_record(self) -> Dict[str, Any]:
        """This rank's paused state for the exchange: status, layout, --save, integrity."""
        with self._actions_cv:
            verify = self._handlers.get(ActionKind.VERIFY.value)
        report = None
        if verify is not None:
            self._integrity = None
            ok, detail = verify({})
            report = self._integrity if ok else None
            if not ok:
                log.error("rank %d: verification failed: %s", self.rank, detail)
        st, it = self.status()
        return {"rank": self.rank, "status": st.value, "iteration": it, "save_dir": self.save_dir,
                "layout": dataclasses.asdict(self.layout), "verifies": verify is not None,
                "integrity": None if report is None else dict(dataclasses.asdict(report), detail=report.detail[:300])}

    def _end(self, code: int, reason: str) -> None:
        """End this rank with ``code`` as an EXIT from the controller would (exit handler)."""
        with self._cond:
            if self._exited is not None:
                return
            self._exited = (code, reason)
            self._cond.notify_all()
        self.close(code)
        self.exit_handler(code, reason)
        with self._cond:
            self._exit_returned = True
            self._cond.notify_all()

    def _close_io(self) -> None:
        """End of the I/O thread: flush, close the socket and context, then the wake pipe.

        Linger is 0 except when this close sends a GOODBYE: that frame gets up to
        ``GOODBYE_LINGER_MS`` to leave (``term()`` returns as soon as it has), because
        without it the controller would take a clean exit for a death.
        """
        try:
            if self.controller_lost_at is None:  # nobody to send to otherwise
                self._flush_outbox()
        except Exception:  # noqa: BLE001 - closing must not fail
            log.exception("rank %d: cannot flush the control queue", self.rank)
        with self._cond:
            goodbye = self._goodbye_queued
        ctx, sock, monitor = self._ctx, self._sock, self._monitor
        self._ctx = self._sock = self._monitor = None
        if monitor is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
        lost = self.controller_lost_at is not None  # nobody to say goodbye to: no linger
        wire.close_all(ctx, monitor, sock, linger_ms=GOODBYE_LINGER_MS if goodbye and not lost else 0)
        with self._cond:  # pokes happen under this lock: never write to a closed (reused) fd
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def _handle(self, msg: wire.Message) -> None:
        t, body = msg.type, msg.body
        if t is wire.MsgType.REGISTERED:
            if body.accepted:
                self._disconnected_at = None  # e.g. a new leader answered
                if not self._registered.is_set():  # once: answers to repeated REGISTERs are not news
                    log.info("rank %d registered with the controller at %s:%s (REGISTER sent %d times)",
                             self.rank, self.addr, self.port, self._register_attempts)
                self._registered.set()
            elif self._registered.is_set() and body.detail.startswith("unregistered"):
                self._registered.clear()  # a new controller: register again
            else:
                self._register_error = body.detail
                self._registered.set()
        elif t is wire.MsgType.STOP:
            if body.recover:
                self._abort_step(body.reason)
            with self._cond:
                if body.freeze or body.recover:
                    self._frozen = True
                else:
                    self._observed = True  # in-place recovery, round 1: status changes go out at once
                self.stop_received_at = time.monotonic()
                st, it = self._state.snapshot()
                self._status_dirty = False  # STOPPED carries it
                self._outbox.append(wire.Stopped(self.rank, st.value, it, -1, self._step))
            self.stop_event.set()
            log.warning("rank %d: STOP (%s); %s at %s@%d", self.rank, body.reason,
                        "frozen" if (body.freeze or body.recover) else "observed", st.value, it)
        elif t is wire.MsgType.DRAIN:
            self._drain(body)
        elif t is wire.MsgType.ACTION:
            if body.params.get("store"):  # a successor's rendezvous store (controller failover)
                from mindspeed_ha.recovery import groups

                groups.use_rendezvous_store(str(body.params["store"]))
            with self._actions_cv:
                self._actions.append(body)
                self._actions_cv.notify()
        else:
            self.codec.rejected["unexpected_type"] += 1

    def _abort_step(self, reason: str) -> None:
        """STOP(recover): the training thread must leave its step and park in
        :meth:`report_fault` (in-place recovery). Every collective it is blocked in or
        starts raises (:func:`mindspeed_ha.recovery.comm.abort`), and so do
        :meth:`begin_update` and :meth:`pause_point` until RETRY arrives."""
        with self._cond:
            self._recovering = True
            self._cond.notify_all()
        try:
            from mindspeed_ha.recovery import comm

            comm.abort(reason)
        except Exception:  # noqa: BLE001 - the I/O thread must go on; begin_update still raises
            log.exception("rank %d: aborting the collectives failed", self.rank)

    def _raise_if_recovering_locked(self) -> None:
        if self._recovering and self._exited is None:
            from mindspeed_ha.recovery.comm import CollectiveAborted

            raise CollectiveAborted(f"rank {self.rank}: step aborted for in-place recovery")

    def action_result(self, action_id: int, ok: bool, detail: str) -> None:
        """Send the result of a main-thread action (RETRY: after the rank recovered)."""
        with self._cond:
            self._queue_locked(wire.ActionResult(int(action_id), self.rank, bool(ok), str(detail)))

    def _drain(self, body: wire.Drain) -> None:
        """DRAIN(-1): set the pause limit at the iteration in progress, announce it (DRAINING).
        DRAIN(K): move the limit to K; a rank already paused after K says so again (STOPPED)."""
        with self._cond:
            if self.stop_received_at is None:
                self.stop_received_at = time.monotonic()
            if body.until < 0:
                mine = self._next_pause_locked()
                self._limit = max(0, mine)  # not started: pause after the first iteration
                self._outbox.append(wire.Draining(self.rank, mine))
            else:
                mine = body.until
                self._limit = body.until
                if self._paused_at is not None and self._paused_at >= body.until:
                    st, it = self._state.snapshot()
                    self._outbox.append(wire.Stopped(self.rank, st.value, it, self._paused_at))
            self._cond.notify_all()
        self.stop_event.set()
        log.warning("rank %d: graceful stop (%s): pausing after iteration %d", self.rank, body.reason, mine)

    def _action_loop(self) -> None:
        while True:
            with self._actions_cv:
                while not self._actions:
                    self._actions_cv.wait()
                action = self._actions.popleft()
                handler = self._handlers.get(action.kind) if action is not None else None
            if action is None:
                return
            log.info("rank %d: action %s #%d", self.rank, action.kind, action.action_id)
            if action.kind == ActionKind.EXIT.value:
                self._do_exit(action)
                continue
            if handler is None and action.kind not in MAIN_THREAD_KINDS:
                ok, detail = False, f"no handler for action {action.kind!r} on rank {self.rank}"
            elif handler is None:
                ok, detail = True, "delivered to the main thread"
            else:
                try:
                    ok, detail = handler(dict(action.params))
                except Exception as exc:  # noqa: BLE001 - a failed action is a result, not a crash
                    log.exception("rank %d: action %s failed", self.rank, action.kind)
                    ok, detail = False, describe(exc)
            with self._cond:
                if action.kind != ActionKind.RETRY.value:  # RETRY: the training thread answers once recovered
                    self._queue_locked(wire.ActionResult(action.action_id, self.rank, bool(ok), str(detail)))
                if action.kind in MAIN_THREAD_KINDS:
                    if action.kind in (ActionKind.RESUME.value, ActionKind.RETRY.value):
                        self._frozen = False
                        self._recovering = False
                        self._observed = False
                        self.stop_received_at = None  # the job runs on: a later stop is news
                        self.stop_event.clear()
                    self._main_action = action
                    self._cond.notify_all()

    def _do_exit(self, action: wire.Action) -> None:
        code = int(action.params.get("code", 1))
        reason = str(action.params.get("reason", ""))
        with self._cond:
            self._exited = (code, reason)
        self.close(code)  # GOODBYE flushed (linger) before the handler ends the process
        with self._cond:
            self._main_action = action
            self._cond.notify_all()
        self.exit_handler(code, reason)
        with self._cond:
            self._exit_returned = True
            self._cond.notify_all()


def _host_port(endpoint: bytes) -> Tuple[str, str]:
    """(host, port) of a ZeroMQ tcp endpoint, IPv4-mapped IPv6 hosts as IPv4 (libzmq names
    a reconnected peer ``tcp://[::ffff:127.0.0.1]:port``)."""
    text = endpoint.decode(errors="replace").split("://", 1)[-1]
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    return (host[7:] if host.startswith("::ffff:") else host), port


def _rank_info(record: Dict[str, Any]) -> RankInfo:
    """A rank's exchanged record as the policy reads it (paused, so stopped and authoritative)."""
    integ = record.get("integrity")
    return RankInfo(rank=int(record["rank"]), layout=Layout(**record["layout"]), stopped=True,
                    status=OptimizerStatus(record["status"]), iteration=int(record["iteration"]),
                    save_dir=record.get("save_dir"), verifies=bool(record.get("verifies")),
                    integrity=None if integ is None else IntegrityReport(**integ))
