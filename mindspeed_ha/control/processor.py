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
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable, Deque, Dict, Optional, Tuple, Union

import zmq

from mindspeed_ha.config import ENV_AUTH_KEY, ENV_CONNECT_TIMEOUT, ConfigError, HAConfig
from mindspeed_ha.control import auth, wire
from mindspeed_ha.control.integrity import IntegrityReport
from mindspeed_ha.control.policy import ActionKind
from mindspeed_ha.control.state import Layout, OptimizerStatus, RankState
from mindspeed_ha.faults import (
    EXIT_CONTROLLER_LOST,
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

#: how long a GOODBYE may take to leave when the processor closes (ms); every other close: 0
GOODBYE_LINGER_MS = 500

#: actions whose arrival is delivered to the main thread (report_fault / begin_update)
MAIN_THREAD_KINDS = frozenset({ActionKind.RETRY.value, ActionKind.RESUME.value, ActionKind.EXIT.value})


class ProcessorExited(HAError):
    """The controller ended this rank (EXIT) and the exit handler returned."""


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
        #: set when STOP arrives (frozen); for the runtime and tests to wait on
        self.stop_event = threading.Event()

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
            self._wake_r = self._wake_w = -1
            for fd in wake:
                os.close(fd)
            wire.close_all(ctx, sock)
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
    def frozen(self) -> bool:
        with self._cond:
            return self._frozen

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
            if self._frozen and self._exited is None:
                deadline = time.monotonic() + self.freeze_deadline_s
                while self._frozen and self._exited is None:
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
        """Mark the optimizer UPDATED at ``iteration`` (never blocks)."""
        with self._cond:
            self._state.transition(OptimizerStatus.UPDATED, iteration)
            self._status_dirty = True

    def report_fault(self, exc_or_kind: Union[BaseException, FaultKind, str], iteration: int,
                     timeout: Optional[float] = None) -> wire.Action:
        """Report a fault of the training step and wait for the main thread's action.

        Args:
            exc_or_kind: the caught exception (classified) or a FaultKind.
            iteration: the iteration being computed.
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
            self._main_action = None
            status, _ = self._state.snapshot()
            self._queue_locked(wire.Fault(self.rank, int(iteration), kind.value, message, status.value))
            log.error("rank %d: %s fault at iteration %d reported: %s", self.rank, kind.value, iteration, message)
            while self._main_action is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return wire.Action(-1, ActionKind.EXIT.value,
                                       {"code": EXIT_CONTROLLER_LOST, "reason": "no action from the controller"})
                self._cond.wait(left)
            return self._main_action

    def report_integrity(self, report: IntegrityReport) -> None:
        """Send the integrity of this rank's frozen state (from the VERIFY handler, so it
        reaches the controller before that action's result)."""
        with self._cond:
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
                             self.save_dir, self.run_id, status.value, it, verifies)

    def _flush_outbox(self) -> None:
        with self._cond:
            status = None
            if self._status_dirty:
                self._status_dirty = False
                st, it = self._state.snapshot()
                status = wire.Status(self.rank, st.value, it)
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
        hb = self.config.heartbeat_interval_s
        backoff = 0.1
        next_register = time.monotonic()
        next_hb = time.monotonic() + hb
        try:
            while not self._stop_io.is_set():
                now = time.monotonic()
                if not self._registered.is_set() and now >= next_register:
                    self._register_attempts += 1
                    log.debug("rank %d: REGISTER #%d to %s:%s", self.rank, self._register_attempts, self.addr,
                              self.port)
                    self._send(self._register_body())
                    next_register = now + backoff
                    backoff = min(backoff * 2, 2.0)
                if self._registered.is_set() and now >= next_hb:
                    st, it = self.status()
                    self._send(wire.Heartbeat(self.rank, it, st.value))
                    next_hb = now + hb
                wake_at = next_hb if self._registered.is_set() else next_register
                ready = dict(poller.poll(max(1, int((wake_at - time.monotonic()) * 1000))))
                if self._wake_r in ready:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                while True:
                    try:
                        frame = self._sock.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    msg = self.codec.try_decode(frame.buffer, peer="controller")
                    if msg is not None:
                        self._handle(msg)
                self._flush_outbox()
        except Exception:  # noqa: BLE001 - keep the reason in the log, never crash silently
            log.exception("rank %d: processor I/O thread failed", self.rank)
        finally:
            self._close_io()

    def _close_io(self) -> None:
        """End of the I/O thread: flush, close the socket and context, then the wake pipe.

        Linger is 0 except when this close sends a GOODBYE: that frame gets up to
        ``GOODBYE_LINGER_MS`` to leave (``term()`` returns as soon as it has), because
        without it the controller would take a clean exit for a death.
        """
        try:
            self._flush_outbox()
        except Exception:  # noqa: BLE001 - closing must not fail
            log.exception("rank %d: cannot flush the control queue", self.rank)
        with self._cond:
            goodbye = self._goodbye_queued
        ctx, sock = self._ctx, self._sock
        self._ctx = self._sock = None
        wire.close_all(ctx, sock, linger_ms=GOODBYE_LINGER_MS if goodbye else 0)
        with self._cond:  # pokes happen under this lock: never write to a closed (reused) fd
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def _handle(self, msg: wire.Message) -> None:
        t, body = msg.type, msg.body
        if t is wire.MsgType.REGISTERED:
            if body.accepted:
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
            with self._cond:
                self._frozen = True
                self.stop_received_at = time.monotonic()
                st, it = self._state.snapshot()
                self._status_dirty = False  # STOPPED carries it
                self._outbox.append(wire.Stopped(self.rank, st.value, it))
            self.stop_event.set()
            log.warning("rank %d: STOP (%s); frozen at %s@%d", self.rank, body.reason, st.value, it)
        elif t is wire.MsgType.ACTION:
            with self._actions_cv:
                self._actions.append(body)
                self._actions_cv.notify()
        else:
            self.codec.rejected["unexpected_type"] += 1

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
                self._queue_locked(wire.ActionResult(action.action_id, self.rank, bool(ok), str(detail)))
                if action.kind in MAIN_THREAD_KINDS:
                    if action.kind in (ActionKind.RESUME.value, ActionKind.RETRY.value):
                        self._frozen = False
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
