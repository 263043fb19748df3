"""The controller: one I/O thread per job that applies :func:`policy.decide`.

The thread owns a ZeroMQ ROUTER socket (a CURVE server; processors connect DEALER
sockets as CURVE clients, see :mod:`auth`), the context's ZAP handler, a socket
monitor (a closed TCP connection = the rank's process is gone, detected in well
under a millisecond on the same host) and a wake pipe for
:meth:`Controller.report_rank_exit`. It holds no policy of its own.

Liveness cannot be starved by inbound traffic. The loop runs in bounded turns
(:meth:`Controller._turn`): agent reports, ZAP requests, at most
``MAX_EVENTS_PER_TURN`` connection events, at most ``MAX_FRAMES_PER_TURN`` frames,
then always the decision step ``decide(clock(), state, config)``, so decisions run
at least every ``tick_s`` when idle and after every bounded batch under any load.
Within a batch the frames of registered ranks are handled first; each frame is
checked against its peer's rate budget (:class:`admission.PeerLimiter`) before it is
authenticated, and stamped with the clock read when it is handled (not when the turn
began). The ROUTER socket reads its connections fairly, so a flooding connection
cannot hold a rank's heartbeats back by more than a frame per connection per round.
Rejections are counted and logged at a bounded rate (:class:`admission.RejectLog`).

Standalone (no lingering: exits when the job is DONE or nobody registers)::

    MINDSPEED_HA_AUTH_KEY=<hex> python -m mindspeed_ha.control.controller --world-size 8 --port 8000
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import itertools
import logging
import os
import queue
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import zmq
from zmq.utils.monitor import recv_monitor_message

from mindspeed_ha.config import ENV_AUTH_KEY, ENV_TTP_PORT, ConfigError, HAConfig
from mindspeed_ha.control import admission, auth, wire
from mindspeed_ha.control.integrity import IntegrityReport
from mindspeed_ha.control.policy import ActionKind, Decision, DumpPlan, decide
from mindspeed_ha.control.state import (ClusterState, Layout, OptimizerStatus, PendingAction, Phase, RankInfo,
                                        StopRequest)
from mindspeed_ha.faults import FaultKind

log = logging.getLogger(__name__)

#: frames read from the ROUTER socket per loop turn (the decision step follows each turn)
MAX_FRAMES_PER_TURN = 256
#: socket-monitor events handled per loop turn
MAX_EVENTS_PER_TURN = 1024
#: ZAP requests answered per loop turn
MAX_ZAP_PER_TURN = 64
#: monitor events libzmq may queue before its I/O thread waits for this one to read them
#: (the default of 1000 lets a burst of failed connections stall every connection)
MONITOR_HWM = 100_000
#: what the socket monitor reports: closed connections and failed handshakes
MONITOR_EVENTS = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
                     zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_protocol_error",
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_auth_denied"}


@dataclasses.dataclass(frozen=True)
class Event:
    """One applied decision: monotonic time, phase after it, action, reason."""

    t: float
    phase: Phase
    action: ActionKind
    reason: str


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How the job ended, as the controller saw it.

    ``timings`` (seconds): ``detect`` fault evidence -> STOP sent; ``decide`` STOP ->
    DUMP (stop round + selection, integrity round included) or -> EXIT; ``verify`` (only
    when ranks verified) VERIFY -> DUMP or EXIT; ``save`` DUMP -> EXIT (dump + assemble +
    commit); ``total`` evidence -> EXIT sent. A graceful stop (``stop_request``, no
    fault): ``drain`` request -> every rank paused (VERIFY / DUMP sent, or the stop round
    that abandoned the iteration), ``save`` as above, ``total`` request -> EXIT sent.
    """

    phase: Phase
    exit_code: Optional[int]
    reason: str
    iteration: Optional[int]
    plan: Optional[DumpPlan]
    fault_rank: Optional[int]
    fault_kind: Optional[FaultKind]
    timings: Dict[str, float]
    events: Tuple[Event, ...]
    stop_request: Optional[StopRequest] = None
    #: in-place recoveries, oldest first (see ClusterState.recoveries): iteration, kind, rank,
    #: generation, repairs, controller times (evidence_at, stop_at, retry_at, done_at) and each
    #: rank's RETRY result (JSON: its per-phase seconds)
    recoveries: Tuple[Dict[str, Any], ...] = ()
    #: worker restarts (--enable-worker-reboot), oldest first: rank, incarnation, pid, the previous
    #: incarnation's exit_code, at (controller clock); recorded only, no decision reads them yet
    restarts: Tuple[Dict[str, Any], ...] = ()


class Controller:
    """Job-wide controller thread (I/O only).

    Args:
        config: the job's HAConfig; ``auth_key`` is required.
        world_size: number of ranks expected to register.
        bind_addr: address to bind (default ``config.controller_addr``); ``*`` for all.
        port: port to bind (default ``config.controller_port``; 0 picks a free port).
        tick_s: decision tick when no message arrives.
        clock: monotonic clock (seconds).

    Raises:
        ConfigError: no auth key (``MINDSPEED_HA_AUTH_KEY``); port in use (from start()).
    """

    def __init__(self, config: HAConfig, world_size: int, bind_addr: Optional[str] = None,
                 port: Optional[int] = None, *, tick_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic):
        if config.auth_key is None:
            raise ConfigError(f"the controller needs the job's auth key: set {ENV_AUTH_KEY} (hex)")
        if world_size < 1:
            raise ConfigError(f"--world-size={world_size}: accepted range >= 1")
        self.config = config
        self.world_size = world_size
        self.bind_addr = bind_addr or config.controller_addr
        self._port = config.controller_port if port is None else int(port)
        self.tick_s = tick_s
        self.clock = clock
        self.codec = wire.Codec(config.auth_key, wire.new_sender("controller"), config.max_message_bytes,
                                max_senders=max(wire.MAX_SENDERS, 4 * world_size))
        self._keys = auth.derive_keys(config.auth_key)
        strangers = max(admission.STRANGERS_RATE, 2.0 * world_size)  # every rank registers at once
        self._limiter = admission.PeerLimiter(strangers, strangers, max(admission.MAX_STRANGERS, 4 * world_size))
        #: connections refused by libzmq before any frame (failed handshakes, ZAP denials), by reason
        self.transport_rejected = admission.RejectLog(log, "connection")
        self._zap: Optional[auth.ZapHandler] = None
        self.state = ClusterState(world_size=world_size, phase_since=clock())
        self.events: List[Event] = []
        self._lock = threading.Lock()  # guards state/events against readers in other threads
        self._cmds: "queue.SimpleQueue[Tuple[str, Any]]" = queue.SimpleQueue()
        self._done = threading.Event()
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._ctx: Optional[zmq.Context] = None
        self._router = None
        self._monitor = None
        self._wake_r = self._wake_w = -1
        self._wake_lock = threading.Lock()
        self._ident: Dict[int, bytes] = {}
        self._rank_of_ident: Dict[bytes, int] = {}
        self._rank_of_fd: Dict[int, int] = {}
        self._action_ids = itertools.count(1)
        self.first_register_at: Optional[float] = None
        self._restarts: List[Dict[str, Any]] = []  # report_rank_restart, in order (I/O thread, under _lock)
        self._abandoned: Set[int] = set()  # ranks the agent will not restart again (I/O thread)
        # controller failover (mindspeed_ha.control.lease): set by the launcher before start()
        #: the term this controller holds (``Leadership``), or None (no failover: always acts)
        self.leadership: Any = None
        #: the job's LeaseDir: the roster (who registered, with what layout) is kept there for a successor
        self.lease: Any = None
        #: "host:port" of the TCPStore a successor hosts for the process-group rebuilds (RETRY
        #: params ``store``): the first generation's store died with node 0's agent
        self.rebuild_store: Optional[str] = None
        self.stepped_down: Optional[str] = None  # why this controller stopped acting (a successor leads)
        self._takeover_at: Optional[float] = None  # a successor: when it started (see take_over)
        self._roster_dirty = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def port(self) -> int:
        return self._port

    def start(self) -> "Controller":
        """Bind and start the I/O thread. Raises ConfigError if the port is in use.

        The I/O thread owns the sockets, the context and the wake pipe and closes them
        when it ends (linger 0); if starting fails half-way, everything created so far is
        closed here before the error propagates.
        """
        ctx = zmq.Context()
        router = monitor = zap = None
        wake: Tuple[int, ...] = ()
        try:
            zap = auth.ZapHandler(ctx, self._keys)  # before the bind: no connection is ever unchecked
            router = ctx.socket(zmq.ROUTER)
            wire.configure_socket(router, self.config.max_message_bytes)
            auth.configure_server(router, self._keys)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self._bind(router)
            monitor = self._monitor_socket(ctx, router)
            wake = os.pipe()
            for fd in wake:
                os.set_blocking(fd, False)
            self._ctx, self._router, self._monitor, self._zap = ctx, router, monitor, zap
            self._wake_r, self._wake_w = wake
            self._thread = threading.Thread(target=self._run, name="mindspeed-ha-controller", daemon=True)
            self._thread.start()
        except BaseException:
            self._thread = None
            self._ctx = self._router = self._monitor = self._zap = None
            self._wake_r = self._wake_w = -1
            for fd in wake:
                os.close(fd)
            wire.close_all(ctx, monitor, router, zap.socket if zap is not None else None)
            raise
        log.info("controller listening on %s:%d for %d ranks", self.bind_addr, self._port, self.world_size)
        return self

    @staticmethod
    def _monitor_socket(ctx: Any, router: Any) -> Any:
        """The monitor's PAIR socket, with room for ``MONITOR_HWM`` queued events."""
        addr = f"inproc://mindspeed-ha-monitor-{id(router):x}"
        router.monitor(addr, MONITOR_EVENTS)
        monitor = ctx.socket(zmq.PAIR)
        try:
            monitor.setsockopt(zmq.LINGER, 0)
            monitor.setsockopt(zmq.RCVHWM, MONITOR_HWM)
            monitor.connect(addr)
        except BaseException:
            monitor.close(linger=0)
            raise
        return monitor

    def _bind(self, router: Any) -> None:
        try:
            if self._port == 0:
                host = self.bind_addr.strip("[]")
                self._port = router.bind_to_random_port(wire.endpoint(host, 0).rsplit(":", 1)[0])
            else:
                router.bind(wire.endpoint(self.bind_addr, self._port))
        except zmq.ZMQError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"controller port {self._port} on {self.bind_addr} is already in use: choose another with "
                    f"--ha-controller-port or {ENV_TTP_PORT} (1..65535)") from exc
            raise ConfigError(f"cannot bind the controller to {self.bind_addr}:{self._port}: {exc}") from exc

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the I/O thread, which closes its sockets and context (idempotent)."""
        self._stopping.set()
        self._wake()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():  # it still owns the sockets: it closes them when it ends
                log.error("controller thread did not stop within %.1f s", timeout)

    def __enter__(self) -> "Controller":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except (BlockingIOError, OSError):
                    pass

    # ------------------------------------------------------------------ public API
    def request_stop(self, reason: str, rank: int = -1) -> None:
        """Ask for a graceful stop of the job (the launcher got SIGTERM/SIGINT). Thread-safe
        and safe to call from a signal handler.

        Every rank finishes the iteration in progress, the checkpoint of the last one is
        written as a dying checkpoint with no dead rank, and the ranks exit 75 (see
        :func:`policy.decide`, phase DRAINING). Ignored once a fault round or another
        stop is under way. Never blocks: the loop reads the request at its next turn
        (within ``tick_s``) if the wake-up cannot be written at once.
        """
        self._cmds.put(("stop", (int(rank), str(reason), self.clock())))
        if self._wake_lock.acquire(blocking=False):  # a signal may interrupt a holder of the lock
            try:
                if self._wake_w >= 0:
                    try:
                        os.write(self._wake_w, b"x")
                    except (BlockingIOError, OSError):
                        pass
            finally:
                self._wake_lock.release()

    def report_rank_exit(self, rank: int, exitcode: int) -> None:
        """Agent/launcher report: worker ``rank``'s process exited with ``exitcode``. Thread-safe."""
        self._cmds.put(("exit", (int(rank), int(exitcode), self.clock())))
        self._wake()

    def report_rank_restart(self, rank: int, incarnation: int, pid: int, exitcode: int) -> None:
        """Agent report (``--enable-worker-reboot``): worker ``rank``, whose process exited
        with ``exitcode``, runs again as ``pid``, its ``incarnation``-th restart. Recorded in
        the outcome (``restarts``); the rank's state is not changed (its new process
        registers as a new sender). Thread-safe."""
        self._cmds.put(("restart", (int(rank), int(incarnation), int(pid), int(exitcode), self.clock())))
        self._wake()

    def restart_refused(self, rank: int) -> Optional[str]:
        """None while the agent may restart a dead ``rank``, else why not. Thread-safe.

        Allowed while the job runs or recovers in place (phases RUNNING, RECOVERING before
        the RETRY is sent) with no graceful stop requested, for a rank that never
        registered (it died while starting) or whose processor said its process can
        rejoin (REGISTER ``rejoins``: ``--enable-worker-reboot`` and the rejoin support
        loaded). The policy then waits for the new process (``ClusterState.rejoin_wait``,
        set when the death is reported) instead of starting the dying checkpoint. Any
        other phase is a verdict under way (the dying checkpoint, a drain): a new process
        would register into a round that has no place for it.
        """
        with self._lock:
            return self._restart_refused_locked(rank)

    def _restart_refused_locked(self, rank: int) -> Optional[str]:
        st = self.state
        if self.stepped_down is not None:
            return f"this controller stepped down ({self.stepped_down})"
        pending = st.pending
        if st.phase not in (Phase.RUNNING, Phase.RECOVERING):
            return f"the controller is in phase {st.phase.value} (its verdict on the job is under way)"
        if st.phase is Phase.RECOVERING and pending is not None and pending.kind == ActionKind.RETRY.value:
            return "an in-place recovery is already under way (its plan was sent)"
        if st.stop_request is not None:
            return "a graceful stop was requested"
        info = st.ranks.get(rank)
        if info is not None and not info.rejoins:
            return (f"rank {rank} registered without rejoin support (needs --enable-worker-reboot): its death "
                    "takes the dying-checkpoint path")
        return None

    def report_restart_abandoned(self, rank: int, why: str) -> None:
        """Agent report (``--enable-worker-reboot``): dead ``rank`` will not be restarted
        (its restart budget is spent, its exit code is a verdict...). The policy stops
        waiting for it. Thread-safe."""
        self._cmds.put(("abandoned", (int(rank), str(why), self.clock())))
        self._wake()

    def wait_done(self, timeout: Optional[float] = None) -> Optional[Outcome]:
        """Block until the job is DONE (or ``timeout``); return the outcome or None."""
        if not self._done.wait(timeout):
            return None
        return self.outcome()

    def unresponsive_ranks(self) -> Dict[int, str]:
        """Ranks given up on for silence once a fault round started: rank -> reason.

        A rank whose heartbeats stopped (a hung or SIGSTOPped process) is left out of
        the dying checkpoint, but its process may still exist and cannot act on a
        SIGTERM while stopped: whoever hosts the workers ends it (the launcher SIGKILLs
        it). Empty while no fault was acted on: until then silence is fault evidence
        for :func:`decide`, not a verdict. Ranks that said goodbye or whose exit was
        reported are never listed. Thread-safe.
        """
        with self._lock:
            st = self.state
            if st.fault is None:
                return {}
            now, limit = self.clock(), self.config.heartbeat_timeout_s
            return {r: f"no heartbeat for {now - i.last_heartbeat:.1f} s (> {limit} s)"
                    for r, i in sorted(st.ranks.items())
                    if i.alive and i.exit_code is None and now - i.last_heartbeat > limit}

    @property
    def phase(self) -> Phase:
        with self._lock:
            return self.state.phase

    def outcome(self) -> Outcome:
        """The outcome so far (final once the phase is DONE)."""
        with self._lock:
            st = self.state
            events = tuple(self.events)
            plan = st.plan
            fault = st.fault
            req = st.stop_request
            recoveries = tuple(dict(r, ranks=dict(r["ranks"])) for r in st.recoveries)
            restarts = tuple(dict(r) for r in self._restarts)
        first = {}
        for e in events:
            first.setdefault(e.action, e.t)
        timings: Dict[str, float] = {}
        t_stop, t_dump, t_exit = first.get(ActionKind.STOP_ALL), first.get(ActionKind.DUMP), first.get(ActionKind.EXIT)
        if fault is not None and t_stop is not None:
            timings["detect"] = t_stop - fault.at
        if t_stop is not None and (t_dump or t_exit) is not None:
            timings["decide"] = (t_dump if t_dump is not None else t_exit) - t_stop
        t_verify = first.get(ActionKind.VERIFY)
        t_end = t_dump if t_dump is not None else t_exit
        if t_verify is not None and t_end is not None:
            timings["verify"] = t_end - t_verify
        if t_dump is not None and t_exit is not None:
            timings["save"] = t_exit - t_dump
        if fault is not None and t_exit is not None:
            timings["total"] = t_exit - fault.at
        if fault is None and req is not None:
            ends = [t for t in (t_verify, t_dump, t_stop) if t is not None]
            if ends:
                timings["drain"] = min(ends) - req.at
            if t_exit is not None:
                timings["total"] = t_exit - req.at
        return Outcome(st.phase, st.exit_code, st.exit_reason, plan.iteration if plan else None, plan,
                       fault.rank if fault else None, fault.kind if fault else None, timings, events, req,
                       recoveries, restarts)

    # ------------------------------------------------------------------ I/O thread
    def _run(self) -> None:
        wake_r = self._wake_r
        timeout_ms = max(1, int(self.tick_s * 1000))
        try:
            poller = zmq.Poller()
            for sock in (self._router, self._monitor, self._zap.socket, wake_r):
                poller.register(sock, zmq.POLLIN)
            while not self._stopping.is_set():
                ready = dict(poller.poll(timeout_ms))  # returns at once while a turn left input behind
                if wake_r in ready:
                    try:
                        while os.read(wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                try:
                    with self._lock:
                        self._turn()
                        done = self.state.phase is Phase.DONE
                except Exception:  # never let one bad event kill the controller
                    log.exception("controller: error while handling events")
                    done = False
                if done:
                    self._done.set()
                    break
        finally:
            with self._wake_lock:
                fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
            for fd in fds:
                os.close(fd)
            ctx, router, monitor, zap = self._ctx, self._router, self._monitor, self._zap
            self._ctx = self._router = self._monitor = self._zap = None
            wire.close_all(ctx, monitor, router, zap.socket if zap is not None else None)
            log.info("controller thread exits (phase %s); control plane: %s", self.state.phase.value,
                     self.traffic(zap))

    def traffic(self, zap: Optional[auth.ZapHandler] = None) -> str:
        """Counters of the control plane so far, one line (for logs and reports). Thread-safe."""
        with self._lock:
            zap = zap or self._zap
            return (f"frames accepted {self.codec.accepted}, frames rejected {dict(self.codec.rejected)}, "
                    f"connections refused {dict(self.transport_rejected.totals)}, "
                    f"ZAP {dict(zap.counts) if zap is not None else {}}")

    def _turn(self) -> None:
        """One bounded loop turn, then the decision step (caller holds ``_lock``).

        Agent reports, at most ``MAX_ZAP_PER_TURN`` ZAP requests,
        ``MAX_EVENTS_PER_TURN`` monitor events and ``MAX_FRAMES_PER_TURN`` frames; what
        is left waits for the next turn. Then ``decide`` runs whatever the inbound
        rate. Each item is stamped with the clock read when it is handled.
        """
        if self._fenced():
            self._drop_input()
            return
        self._drain_cmds()
        if self._zap is not None:
            self._zap.serve(MAX_ZAP_PER_TURN)
        self._drain_monitor(MAX_EVENTS_PER_TURN)
        self._drain_router(MAX_FRAMES_PER_TURN)
        now = self.clock()
        self.codec.reject_log.flush(now)
        self.transport_rejected.flush(now)
        self._step(now)

    def _drain_cmds(self) -> None:
        while True:
            try:
                cmd, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd == "exit":
                self._rank_exited(*arg)
            elif cmd == "abandoned":
                self._restart_abandoned(*arg)
            elif cmd == "stop":
                self._stop_requested(*arg)
            elif cmd == "restart":
                self._rank_restarted(*arg)

    def _rank_exited(self, rank: int, code: int, at: float) -> None:
        if self.state.mark_dead(rank, f"process exited with code {code} (agent report)", code, at):
            log.warning("rank %d: process exited with code %d (agent report)", rank, code)
        self._expect_rejoin(rank, code, at)

    def _restart_abandoned(self, rank: int, why: str, at: float) -> None:
        self._abandoned.add(rank)  # its exit, reported after this, must not re-arm the wait
        if self.state.rejoin_wait.pop(rank, None) is not None:
            log.warning("rank %d: its agent will not restart it (%s): not waiting for it to rejoin", rank, why)

    def _rank_restarted(self, rank: int, incarnation: int, pid: int, code: int, at: float) -> None:
        self._restarts.append({"rank": rank, "incarnation": incarnation, "pid": pid, "exit_code": code, "at": at})
        log.warning("rank %d: restarted by its agent as pid %d (incarnation %d; the previous one exited "
                    "with %d)", rank, pid, incarnation, code)

    # ------------------------------------------------------------------ agents of other nodes
    def _agent(self, now: float, ident: bytes, msg: wire.Message) -> None:
        """A message of another node's launcher (``mindspeed_ha.control.agent_link``):
        the same decisions as the hooks this node's agent calls in process."""
        body, t = msg.body, msg.type
        reply: Any = None
        if t is wire.MsgType.AGENT_HELLO:
            reply = self._welcome(body)
            log.log(logging.INFO if reply.accepted else logging.WARNING, "node %d's launcher (pid %d on %s), ranks "
                    "%s: %s", body.node_rank, body.pid, body.host, list(body.ranks),
                    f"incarnations {list(reply.incarnations)}" if reply.accepted else f"refused: {reply.detail}")
        elif t is wire.MsgType.RESTART_QUERY:
            if 0 <= body.rank < self.world_size:
                reply = wire.RestartAnswer(body.rank, body.query_id, self._restart_refused_locked(body.rank) or "")
            else:
                reply = wire.RestartAnswer(body.rank, body.query_id, f"rank {body.rank} outside world size "
                                                                     f"{self.world_size}")
        elif t is wire.MsgType.AGENT_REPORT and 0 <= body.rank < self.world_size:
            if body.event == "exit":
                self._rank_exited(body.rank, body.exit_code, now)
            elif body.event == "restarted":
                self._rank_restarted(body.rank, body.incarnation, body.pid, body.exit_code, now)
            elif body.event == "abandoned":
                self._restart_abandoned(body.rank, body.detail, now)
            else:
                self.codec.rejected["unexpected_type"] += 1
        else:
            self.codec.rejected["bad_body"] += 1
        if reply is not None:
            try:
                self._router.send_multipart([ident, self.codec.encode(reply)], zmq.NOBLOCK)
            except (zmq.ZMQError, wire.WireError) as exc:
                log.warning("controller: cannot answer %s of an agent: %s", t.value, exc)

    def _welcome(self, body: wire.AgentHello) -> wire.AgentWelcome:
        """Which incarnation each of ``body.ranks`` starts as: 0 for a rank that never
        registered (the job's first start), its last incarnation + 1 for a rank whose
        process is gone and may rejoin (a lost node's replacement launcher)."""
        st = self.state
        ranks = list(body.ranks)
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad or not ranks or len(set(ranks)) != len(ranks):
            return wire.AgentWelcome(body.query_id, False, [], f"ranks {ranks}: expected distinct ranks in "
                                                               f"0..{self.world_size - 1}")
        incarnations = []
        for r in ranks:
            info = st.ranks.get(r)
            if info is None:
                incarnations.append(0)
                continue
            if info.alive and info.sender == "" and self._takeover_at is not None:
                # a successor still waits for it to register again: a launcher replacing its node says it is gone
                st.mark_dead(r, "its node's launcher was replaced (lost with the previous leader's node)", None,
                             self._takeover_at)
                self._expect_rejoin(r, None, self._takeover_at)
            if info.alive:
                return wire.AgentWelcome(body.query_id, False, [], f"rank {r} is alive (pid {info.pid} on "
                                                                   f"{info.host})", wait=True)
            why = self._restart_refused_locked(r)
            if why is None and r not in st.rejoin_wait:
                why = f"rank {r} is not awaited to rejoin (it exited with {info.exit_code})"
            if why is not None:
                return wire.AgentWelcome(body.query_id, False, [], why)
            incarnations.append(info.incarnation + 1)
        return wire.AgentWelcome(body.query_id, True, incarnations)

    def _expect_rejoin(self, rank: int, code: Optional[int], at: float) -> None:
        """ARF: a rank whose process died with a code its agent restarts (not 0, not a
        verdict 75-79; None: its control connection closed, the agent says more), while
        the job runs or recovers, and whose processor said it can rejoin: the policy
        waits for its new process (``ClusterState.rejoin_wait``) until the agent reports
        it abandoned or the wait's deadline."""
        st = self.state
        info = st.ranks.get(rank)
        if not self.config.worker_reboot:
            return
        if code is not None and (code == 0 or code in range(75, 80)):
            st.rejoin_wait.pop(rank, None)
            return
        if info is None or not info.rejoins or st.stop_request is not None or rank in self._abandoned:
            return
        pending = st.pending
        if st.phase is Phase.RUNNING or (st.phase is Phase.RECOVERING and
                                          (pending is None or pending.kind != ActionKind.RETRY.value)):
            if rank not in st.rejoin_wait:
                st.rejoin_wait[rank] = at
                log.info("rank %d: its agent may restart it: the new process is awaited to rejoin", rank)

    def _stop_requested(self, rank: int, reason: str, at: float) -> None:
        if self.state.request_stop(at, rank, reason):
            log.warning("graceful stop requested: %s", reason)
        else:
            log.info("graceful stop request ignored (%s): job phase %s%s", reason, self.state.phase.value,
                     ", a stop was already requested" if self.state.stop_request else "")

    def _drain_monitor(self, limit: int) -> None:
        if self._monitor is None:
            return
        for _ in range(limit):
            try:
                evt = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            event, now = evt["event"], self.clock()
            if event == zmq.EVENT_DISCONNECTED:
                rank = self._rank_of_fd.pop(int(evt["value"]), None)
                if rank is not None:
                    info = self.state.ranks.get(rank)
                    if info is not None and info.alive and info.exit_code is None:
                        self.state.mark_dead(rank, "control connection closed", None, now)
                        log.warning("rank %d: control connection closed", rank)
                        self._expect_rejoin(rank, None, now)
            elif event in _HANDSHAKE_FAILED:
                self.transport_rejected.note("unauthenticated peers", _HANDSHAKE_FAILED[event], now)

    def _bind_fd(self, fd: Optional[int], rank: int) -> None:
        """Remember that connection ``fd`` carries ``rank`` (its close is the rank's death).

        File descriptors are reused: a connection that failed (e.g. a flood of refused
        ones) may have had the same number, and its "disconnected" event may still be
        queued. Every event of an earlier connection was queued before this one was
        accepted, so the queue is read up to its bound before a new binding is made.
        """
        if fd is None or self._rank_of_fd.get(fd) == rank:
            return
        self._drain_monitor(MONITOR_HWM + 2 * MAX_EVENTS_PER_TURN)
        self._rank_of_fd[fd] = rank

    def _drain_router(self, limit: int) -> None:
        batch: List[Tuple[bytes, Any]] = []
        for _ in range(limit):
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(parts) != 2:
                self.codec.rejected["bad_framing"] += 1
                self.codec.reject_log.note(repr(parts[0].bytes), "bad_framing", self.clock())
                continue
            batch.append((parts[0].bytes, parts[1]))
        ranks = self._rank_of_ident
        for ident, frame in admission.ranks_first(batch, lambda item: item[0] in ranks):
            now = self.clock()
            if not self._limiter.allow(ident, ident in ranks, now):
                self.codec.rejected["rate_limited"] += 1
                self.codec.reject_log.note(repr(ident), "rate_limited", now)
                continue
            msg = self.codec.try_decode(frame.buffer, peer=repr(ident), now=now)
            if msg is None:
                continue
            try:
                fd = frame.get(zmq.SRCFD)
            except zmq.ZMQError:
                fd = None
            self._handle(now, ident, fd, msg)

    def _send(self, rank: int, body: Any) -> bool:
        ident = self._ident.get(rank)
        if ident is None:
            return False
        try:
            self._router.send_multipart([ident, self.codec.encode(body)], zmq.NOBLOCK)
            return True
        except (zmq.ZMQError, wire.WireError) as exc:
            log.warning("controller: cannot send %s to rank %d: %s", type(body).__name__, rank, exc)
            return False

    def _handle(self, now: float, ident: bytes, fd: Optional[int], msg: wire.Message) -> None:
        body = msg.body
        st = self.state
        if msg.type is wire.MsgType.REGISTER:
            self._register(now, ident, fd, msg.sender, body)
            return
        if msg.type.value in wire.AGENT_TYPES:
            self._agent(now, ident, msg)
            return
        rank = self._rank_of_ident.get(ident)
        if rank is None or getattr(body, "rank", rank) != rank:
            self.codec.rejected["unregistered"] += 1
            log.debug("controller: %s from unregistered peer %r ignored", msg.type.value, ident)
            if rank is None and msg.type is not wire.MsgType.GOODBYE:
                try:  # e.g. a controller restarted: ask the processor to register again
                    self._router.send_multipart([ident, self.codec.encode(wire.Registered(
                        getattr(body, "rank", -1), False, "unregistered: send REGISTER"))], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            return
        info = st.ranks[rank]
        self._bind_fd(fd, rank)
        info.last_heartbeat = now
        t = msg.type
        if t is wire.MsgType.HEARTBEAT:
            pass
        elif t is wire.MsgType.STATUS:
            info.status, info.iteration = OptimizerStatus(body.status), body.iteration
            info.step = body.step
        elif t is wire.MsgType.FAULT:
            info.fault = FaultKind(body.kind) if body.kind in FaultKind._value2member_map_ else FaultKind.UNKNOWN
            info.fault_message = body.message
            info.fault_where = body.where
            info.fault_iteration = body.iteration
            info.fault_at = now
            # body.iteration is the iteration being computed, not the optimizer status's:
            # STATUS / STOPPED messages stay the only source of (status, iteration).
            if info.failed_at is None:
                info.failed_at = now
            log.warning("rank %d: %s fault at iteration %d: %s", rank, info.fault.value, body.iteration, body.message)
        elif t is wire.MsgType.STOPPED:
            if body.pause_at >= 0 and body.pause_at != st.drain_until:
                # paused at its first-round limit before the target was known: it says so
                # again when DRAIN(target) reaches it, if the target is where it is
                log.debug("rank %d: paused after iteration %d (drain target %s)", rank, body.pause_at,
                          st.drain_until)
                return
            info.stopped = True
            info.status, info.iteration = OptimizerStatus(body.status), body.iteration
            info.step = body.step
            log.info("rank %d: stopped, optimizer %s@%d%s", rank, info.status.value, info.iteration,
                     f" (paused after iteration {body.pause_at})" if body.pause_at >= 0 else "")
        elif t is wire.MsgType.DRAINING:
            info.pause_at = body.pause_at
            log.info("rank %d: will pause after iteration %d", rank, body.pause_at)
        elif t is wire.MsgType.STOP_REQUEST:
            self._stop_requested(rank, body.reason, now)
        elif t is wire.MsgType.ACTION_RESULT:
            p = st.pending
            if p is not None and p.action_id == body.action_id and rank in p.targets:
                p.results[rank] = (body.ok, body.detail)
                log.info("rank %d: %s %s %s", rank, p.kind, "ok" if body.ok else "FAILED", body.detail)
        elif t is wire.MsgType.INTEGRITY:
            info.integrity = IntegrityReport(body.iteration, body.shard_ok, body.shard_digest, body.model_ok,
                                             body.model_digest, body.detail)
            log.log(logging.INFO if body.shard_ok and body.model_ok else logging.ERROR,
                    "rank %d: integrity at iteration %d: shard %s %s, model %s %s%s", rank, body.iteration,
                    "ok" if body.shard_ok else "CORRUPT", body.shard_digest[:12],
                    "ok" if body.model_ok else "CORRUPT", body.model_digest[:12],
                    f" ({body.detail})" if body.detail else "")
        elif t is wire.MsgType.GOODBYE:
            info.exit_code = body.exit_code
            st.mark_dead(rank, f"said goodbye (exit code {body.exit_code})", body.exit_code, now)
            self._expect_rejoin(rank, body.exit_code, now)  # a rank that said goodbye is not restarted
            log.info("rank %d: goodbye, exit code %d", rank, body.exit_code)
        else:
            self.codec.rejected["unexpected_type"] += 1

    def _register(self, now: float, ident: bytes, fd: Optional[int], sender: str, body: wire.Register) -> None:
        st = self.state
        ok, detail = True, ""
        if not 0 <= body.rank < self.world_size:
            ok, detail = False, f"rank {body.rank} outside world size {self.world_size}"
        elif body.world_size != self.world_size:
            ok, detail = False, f"world size {body.world_size} != controller's {self.world_size}"
        if ok:
            old = st.ranks.get(body.rank)
            repeat = old is not None and old.sender == sender
            if repeat:
                info = old  # re-sent REGISTER (its REGISTERED crossed it or was lost): idempotent
            else:
                info = RankInfo(rank=body.rank, layout=body.layout, last_heartbeat=now, pid=body.pid,
                                host=body.host, save_dir=body.save_dir, sender=sender)
                try:
                    info.status = OptimizerStatus(body.status)
                except ValueError:
                    info.status = OptimizerStatus.UNKNOWN
                info.iteration = body.iteration
                info.verifies = body.verifies
                info.incarnation = body.incarnation
                info.rejoins = body.rejoins
                st.ranks[body.rank] = info
                if old is not None:
                    log.warning("rank %d re-registered as a new process (pid %d)", body.rank, body.pid)
            info.last_heartbeat = now
            self._ident[body.rank] = ident
            self._rank_of_ident[ident] = body.rank
            self._bind_fd(fd, body.rank)
            if self.first_register_at is None:
                self.first_register_at = now
            self._roster_dirty = True
            if not st.run_id:
                st.run_id = body.run_id
            if repeat:
                log.debug("rank %d: REGISTER repeated, answered again", body.rank)
            else:
                log.info("rank %d registered (pid %d on %s, layout %s); %d/%d ranks", body.rank, body.pid,
                         body.host, body.layout, len(st.ranks), self.world_size)
        else:
            log.error("registration refused: %s", detail)
        try:
            self._router.send_multipart([ident, self.codec.encode(wire.Registered(body.rank, ok, detail))],
                                        zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("controller: cannot answer REGISTER of rank %d: %s", body.rank, exc)
        if ok and st.phase is Phase.STOPPING:
            self._send(body.rank, wire.Stop("job is stopping"))
        elif ok and st.phase is Phase.DRAINING:
            self._send(body.rank, wire.Drain("graceful stop", -1 if st.drain_until is None else st.drain_until))

    def _recovered(self, now: float, d: Decision) -> None:
        """RESUME: every rank recovered in place. Keep the record (per-rank phase seconds
        from the RETRY results), forget the fault, so the next one starts afresh."""
        st = self.state
        pending = st.pending
        self._roster_dirty = True
        if st.recoveries:
            rec = st.recoveries[-1]
            rec["done_at"] = now
            for r, (_, detail) in sorted((pending.results if pending is not None else {}).items()):
                rec["ranks"][r] = detail
            log.warning("controller: recovered in place from the %s fault of rank %s in %.3f s (evidence -> every "
                        "rank ready to %s iteration %d)", rec["kind"], rec["rank"], now - rec["evidence_at"],
                        *(("go on with", rec["iteration"]) if rec.get("mode") == "forward"
                          else ("re-run", rec["iteration"] + 1)))
        st.fault = None
        st.pending = None
        st.abort_sent_at = None
        st.rejoin_wait.clear()
        for info in st.ranks.values():
            info.fault, info.fault_message, info.fault_where = None, "", ""
            info.failed_at = info.fault_at = None
            info.fault_iteration = -1
            info.stopped = False

    # ------------------------------------------------------------------ decisions
    def _fenced(self) -> bool:
        """Controller failover: True once this controller may not act (its lease ran out or
        a successor took a higher term); from then on it handles nothing, for good."""
        if self.stepped_down is None and self.leadership is not None and not self.leadership.may_act():
            self.stepped_down = self.leadership.lost or "leadership lost"
            log.error("controller: STEPPING DOWN (term %d): %s; this controller acts no more and closes its port",
                      self.leadership.term.term, self.stepped_down)
            self._stopping.set()  # the I/O thread ends and closes the sockets: the ranks see it and follow
        return self.stepped_down is not None

    def _drop_input(self) -> None:
        """A stepped-down controller reads and drops what arrives (it answers nothing)."""
        while True:
            try:
                self._cmds.get_nowait()
            except queue.Empty:
                break
        for _ in range(MAX_FRAMES_PER_TURN):
            try:
                self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
        if self._zap is not None:
            self._zap.serve(MAX_ZAP_PER_TURN)
        self._drain_monitor(MAX_EVENTS_PER_TURN)

    def _step(self, now: float) -> None:
        if self._fenced():
            return
        if self._roster_dirty and self.lease is not None:
            self._write_roster()
        if self._takeover_at is not None and not self._takeover_window(now):
            return
        for _ in range(8):  # chain decisions that need no new input (e.g. DONE right after EXIT)
            d = decide(now, self.state, self.config)
            if d.action is ActionKind.NOOP and d.next_phase is None:
                return
            self._apply(now, d)

    # ------------------------------------------------------------------ failover
    def take_over(self, roster: Dict[str, Any]) -> None:
        """Start as the successor of a lost leader (before :meth:`start`).

        ``roster``: the predecessor's :meth:`roster` (``ranks``: rank -> registration;
        ``recoveries``: its in-place recoveries, so that the next process-group generation
        is a new one, their times dropped: another clock). Every rank of it is expected to register again (a survivor's processor finds this controller in
        the lease directory); no decision is taken until all did or
        ``heartbeat_timeout_s`` passed. A rank that did not is dead since the takeover
        (lost with the leader's node): with worker reboot its new process is awaited.
        """
        now = self.clock()
        self._takeover_at = now
        self.state.recoveries.extend(
            dict(r, **{k: None for k in r if k.endswith("_at")}, inherited=True) for r in roster.get("recoveries", ()))
        for rank, rec in roster.get("ranks", {}).items():
            info = RankInfo(rank=int(rank), layout=Layout(**rec["layout"]), last_heartbeat=now, pid=int(rec["pid"]),
                            host=str(rec["host"]), save_dir=rec.get("save_dir"), sender="")
            info.incarnation = int(rec.get("incarnation", 0))
            info.rejoins = bool(rec.get("rejoins", False))
            info.verifies = bool(rec.get("verifies", False))
            self.state.ranks[int(rank)] = info
        if self.state.ranks:
            self.first_register_at = now

    def _takeover_window(self, now: float) -> bool:
        """True once a successor's registration window is over (then: the ranks that did
        not register again are dead)."""
        st = self.state
        missing = sorted(r for r, i in st.ranks.items() if i.sender == "" and i.alive)
        if missing and now - self._takeover_at <= self.config.heartbeat_timeout_s:
            return False
        for r in missing:
            st.mark_dead(r, "did not register with the new leader (lost with the previous leader's node)", None,
                         self._takeover_at)
            log.warning("rank %d: did not register with the new leader within %.1f s: lost", r,
                        self.config.heartbeat_timeout_s)
            self._expect_rejoin(r, None, self._takeover_at)
        self._takeover_at = None
        return True

    def roster(self) -> Dict[str, Any]:
        """What a successor needs (JSON-able): ``ranks``, rank -> what its processor
        registered; ``recoveries``, the in-place recoveries so far."""
        ranks = {str(r): {"layout": dataclasses.asdict(i.layout), "pid": i.pid, "host": i.host,
                          "save_dir": i.save_dir, "incarnation": i.incarnation, "rejoins": i.rejoins,
                          "verifies": i.verifies} for r, i in self.state.ranks.items()}
        recoveries = [{k: v for k, v in r.items() if k != "ranks"} | {"ranks": {}} for r in self.state.recoveries]
        return {"ranks": ranks, "recoveries": recoveries}

    def _write_roster(self) -> None:
        self._roster_dirty = False
        try:
            self.lease.write_roster(self.roster())
        except OSError as exc:
            log.warning("controller: cannot write the roster to %s: %s", self.lease.path, exc)

    def _apply(self, now: float, d: Decision) -> None:
        st = self.state
        old = st.phase
        if d.action is ActionKind.DRAIN:
            until = int(d.params["until"])
            if until >= 0:
                st.drain_until = until
            for r in d.targets:
                info = st.ranks[r]
                info.stopped = False  # only a STOPPED that answers this round counts
                if until < 0:
                    info.pause_at = None
                self._send(r, wire.Drain(d.reason, until))
        elif d.action is ActionKind.STOP_ALL:
            if not d.params.get("graceful"):
                st.record_fault(d.params.get("at", now), d.params.get("rank", -1),
                                FaultKind(d.params.get("kind", "unknown")), d.reason)
            if d.params.get("recover"):
                st.abort_sent_at = now
            for r in d.targets:
                st.ranks[r].stopped = False
                st.ranks[r].integrity = None  # a report describes the state frozen by this STOP only
                self._send(r, wire.Stop(d.reason, bool(d.params.get("recover")), not d.params.get("in_place")))
        elif d.action is ActionKind.RESUME:
            self._recovered(now, d)
        elif d.action is not ActionKind.NOOP:
            aid = next(self._action_ids)
            st.pending = PendingAction(aid, d.action.value, tuple(d.targets), now, dict(d.params))
            if d.action is ActionKind.DUMP:
                st.plan = DumpPlan.from_params(d.params)
            if d.action is ActionKind.EXIT:
                st.exit_code = int(d.params["code"])
                st.exit_reason = d.reason
            if d.action is ActionKind.RETRY:
                fault = st.fault
                st.recoveries.append({"iteration": int(d.params["iteration"]), "kind": d.params["kind"],
                                      "mode": d.params.get("mode", "rollback"),
                                      "rank": int(d.params["fault_rank"]), "generation": int(d.params["generation"]),
                                      "repairs": d.params.get("repairs", []),
                                      "evidence_at": fault.at if fault is not None else now,
                                      "stop_at": st.phase_since, "abort_at": st.abort_sent_at, "retry_at": now,
                                      "done_at": None, "ranks": {}})
            params = dict(d.params)
            if d.action is ActionKind.RETRY and self.rebuild_store:
                params["store"] = self.rebuild_store
            if d.action is ActionKind.RETRY and self.lease is not None:
                self._write_roster()  # a successor must count this generation, even if it never completes
            for r in d.targets:
                self._send(r, wire.Action(aid, d.action.value, params))
        if d.next_phase is not None and d.next_phase is not old:
            st.set_phase(d.next_phase, now)
        self.events.append(Event(now, st.phase, d.action, d.reason))
        fault = st.fault
        log.info("controller: phase %s -> %s, decision %s, targets %s, fault rank %s, iteration %s: %s",
                 old.value, st.phase.value, d.action.value, list(d.targets),
                 fault.rank if fault else None, d.params.get("iteration", st.plan.iteration if st.plan else None),
                 d.reason)


# ---------------------------------------------------------------------- standalone
def _process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux ``/proc``, 10 ms ticks; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m mindspeed_ha.control.controller``: run until DONE; exit with the job's code."""
    p = argparse.ArgumentParser(prog="python -m mindspeed_ha.control.controller",
                                description="mindspeed-ha job controller (exits with the job)")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, default=None, help=f"default: {ENV_TTP_PORT} or 8000; 0: any free port")
    p.add_argument("--bind", default=None, help="bind address (default: CONTROLLER_ADDR/TTP_ADDR or 127.0.0.1)")
    p.add_argument("--save", default=None, help="fallback --save directory if ranks register none")
    p.add_argument("--registration-timeout", type=float, default=None,
                   help="exit if no rank registers within this many seconds (default: 2 x connect timeout)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = HAConfig.from_args(argparse.Namespace(save=a.save), os.environ)
        ctl = Controller(cfg, a.world_size, a.bind, a.port if a.port is not None else cfg.controller_port)
        ctl.start()
    except ConfigError as exc:
        print(f"mindspeed-ha controller: {exc}", file=sys.stderr)
        return 2
    age = _process_age_s()
    if age is not None:  # imports nothing heavy: well under a second, even on a busy node
        log.info("controller listening %.2f s after its process started", age)
    reg_timeout = a.registration_timeout or 2 * cfg.connect_timeout_s
    t0 = time.monotonic()
    try:
        while True:
            out = ctl.wait_done(0.5)
            if out is not None:
                log.info("job done: exit code %s, %s, timings %s", out.exit_code, out.reason, out.timings)
                return 0 if out.exit_code is None else out.exit_code
            if ctl.first_register_at is None and time.monotonic() - t0 > reg_timeout:
                log.error("no rank registered within %.1f s; exiting", reg_timeout)
                return 1
    except KeyboardInterrupt:
        return 130
    finally:
        ctl.stop()


if __name__ == "__main__":
    sys.exit(main())
