"""The controller: one I/O thread per job that applies :func:`policy.decide`.

It holds no policy of its own; its roles are modules, one each:

* :mod:`.server` -- the ROUTER socket (CURVE server), ZAP, the socket monitor (a closed
  TCP connection = the rank's process is gone), the wake pipe and the poll loop;
* :mod:`.handlers` -- message type -> handler (what a message does to ``ClusterState``);
* :mod:`.effects` -- action kind -> effect (what a decision sends and records);
* :mod:`.restarts` -- node agents and restart arbitration (``--enable-worker-reboot``);
* :mod:`.failover` -- fencing, the roster and a successor's takeover window;
* :mod:`.operator_desk` -- the operator's requests (status, graceful pause, resume, stop);
* :mod:`.outcome` -- the outcome and the phase events its timings are read from;
* :mod:`.observe` -- the events file and the metrics / status port (:meth:`Controller.status`).

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
import gc
import itertools
import logging
import math
import os
import queue
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from mindspeed_ha import env as ha_env
from mindspeed_ha.config import HAConfig, add_subhealth_arguments
from mindspeed_ha.control import admission, auth, effects, handlers, wire
from mindspeed_ha.control.failover import Failover
from mindspeed_ha.control.observe import Observers
from mindspeed_ha.control.operator_desk import OperatorDesk
from mindspeed_ha.control.outcome import Event, Outcome, PhaseTimer, build_outcome
from mindspeed_ha.control.policy import ActionKind, decide
from mindspeed_ha.control.policy.detect import silent
from mindspeed_ha.control.restarts import RestartArbiter
from mindspeed_ha.control.server import (MAX_EVENTS_PER_TURN, MAX_FRAMES_PER_TURN, MAX_ZAP_PER_TURN, MONITOR_EVENTS,
                                         MONITOR_HWM, ControlServer)
from mindspeed_ha.control.snapshot import snapshot
from mindspeed_ha.control.state import ClusterState, Phase
from mindspeed_ha.control.subhealth_monitor import SubhealthMonitor
from mindspeed_ha.errors import ConfigError
from mindspeed_ha.events import EventRecorder

__all__ = ["Controller", "Event", "Outcome", "main", "MAX_FRAMES_PER_TURN", "MAX_EVENTS_PER_TURN",
           "MAX_ZAP_PER_TURN", "MONITOR_HWM", "MONITOR_EVENTS"]

log = logging.getLogger(__name__)

#: decisions chained in one step when they need no new input (e.g. DONE right after EXIT)
MAX_DECISIONS_PER_STEP = 8
#: while only routine frames arrive, a decision step waits this many times the last one's
#: cost (the steps take at most about 1/ROUTINE_STEP_GAP of the thread; see routine_gap)
ROUTINE_STEP_GAP = 10


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
            raise ConfigError(f"the controller needs the job's auth key: set {ha_env.AUTH_KEY} (hex)")
        if world_size < 1:
            raise ConfigError(f"--world-size={world_size}: accepted range >= 1")
        self.config = config
        self.world_size = world_size
        self.bind_addr = bind_addr or config.controller_addr
        self.tick_s = tick_s
        self.clock = clock
        self.codec = wire.Codec(config.auth_key, wire.new_sender("controller"), config.max_message_bytes,
                                max_senders=max(wire.MAX_SENDERS, 4 * world_size))
        strangers = max(admission.STRANGERS_RATE, 2.0 * world_size)  # every rank registers at once
        limiter = admission.PeerLimiter(strangers, strangers, max(admission.MAX_STRANGERS, 4 * world_size))
        #: the sockets and who is behind each connection (see :mod:`.server`)
        self.server = ControlServer(config.max_message_bytes, config.auth_key, self.bind_addr,
                                    config.controller_port if port is None else int(port), self.codec,
                                    lambda: self.clock(), limiter,
                                    lambda rank, now: handlers.connection_closed(self, rank, now),
                                    backlog=world_size)
        #: connections refused by libzmq before any frame (failed handshakes, ZAP denials), by reason
        self.transport_rejected = self.server.transport_rejected
        self.state = ClusterState(world_size=world_size, phase_since=clock())
        self.events: List[Event] = []  # every applied decision, in order
        #: the controller's phase events (see :mod:`.outcome`); add a sink to keep them
        self.recorder = EventRecorder("controller")
        self.timer = PhaseTimer(self.recorder)
        self.action_ids = itertools.count(1)  # ACTION ids, in send order
        self.first_register_at: Optional[float] = None
        self._lock = threading.Lock()  # guards state/events against readers in other threads
        self._cmds: "queue.SimpleQueue[Tuple[str, Any]]" = queue.SimpleQueue()
        self._done = threading.Event()
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.arbiter = RestartArbiter(self)
        #: the operator's requests (``mindspeed-ha status | pause | resume | stop``, see :mod:`.operator_desk`)
        self.operators = OperatorDesk()
        self.failover = Failover(self, self._stopping)
        # controller failover (mindspeed_ha.control.lease): set by the launcher
        #: the term this controller holds (``Leadership``), or None (no failover: always acts)
        self.leadership: Any = None
        #: the job's LeaseDir: the roster (who registered, with what layout) is kept there for a successor
        self.lease: Any = None
        #: "host:port" of the TCPStore a successor hosts for the process-group rebuilds (RETRY
        #: params ``store``): the first generation's store died with node 0's agent
        self.rebuild_store: Optional[str] = None
        self.stepped_down: Optional[str] = None  # why this controller stopped acting (a successor leads)
        #: global ranks of the workers this controller's own launcher runs (set by the
        #: launcher): a hung one is ended and restarted under --enable-worker-reboot
        self.hosted_ranks: frozenset = frozenset()
        #: the warm spares parked for this job, as the launcher hosting this controller reports
        #: them (``[{"host", "pid"}]``; None: not reported; ``mindspeed-ha status``)
        self.spares: Optional[List[Dict[str, Any]]] = None
        self._last_decision_at: Optional[float] = None  # the previous decision step (controller clock)
        #: seconds the last decision step took (controller clock; paces routine steps, see routine_gap)
        self.decision_cost_s = 0.0
        #: something since the last decision step may change a decision (see :meth:`_turn`)
        self._news = True
        #: REGISTERs of a rank already registered by the same process, answered again (counter)
        self.duplicate_registers = 0
        #: NODE_BEATs of node relays handled, and the local connections they named that were no
        #: rank's connection through that relay (counters, ``handlers.node_beat``); NODE_ANSWERS
        #: frames handled (``handlers.node_answers``)
        self.node_beats = self.beat_unknown = self.node_answers = 0
        #: the heap was frozen when every rank registered (``handlers.FREEZE_HEAP_FROM``)
        self.heap_frozen = False
        #: seconds the I/O thread spent busy outside reading its socket beyond ``tick_s`` in a
        #: turn, credited to every rank's liveness (see :func:`credit_busy`); total
        self.busy_credited_s = 0.0
        #: the events file (--ha-events-file) and the metrics port (--ha-metrics-port), with start/stop
        self.observers = Observers(self)
        #: the sub-health detector's windows and verdicts (--ha-subhealth), or None
        self.subhealth = SubhealthMonitor(config.subhealth) if config.subhealth.enabled else None

    # ------------------------------------------------------------------ lifecycle
    @property
    def port(self) -> int:
        return self.server.port

    @property
    def _router(self) -> Any:
        """The ROUTER socket (tests put a stand-in here before driving :meth:`_turn`)."""
        return self.server.router

    @_router.setter
    def _router(self, router: Any) -> None:
        self.server.router = router

    def start(self) -> "Controller":
        """Bind and start the I/O thread, then the events file and the metrics port (if
        configured). Raises ConfigError if a port is in use or the events file cannot be
        opened.

        The I/O thread owns the sockets, the context and the wake pipe and closes them
        when it ends (linger 0); if starting fails half-way, everything created so far is
        closed here before the error propagates.
        """
        self.server.open()
        try:
            self._thread = threading.Thread(target=self._run, name="mindspeed-ha-controller", daemon=True)
            self._thread.start()
        except BaseException:
            self._thread = None
            self.server.close()
            raise
        try:
            self.observers.start()
        except BaseException:
            self.stop()
            raise
        log.info("controller listening on %s:%d for %d ranks", self.bind_addr, self.port, self.world_size)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the I/O thread, which closes its sockets and context, then the metrics
        port and the events file (idempotent)."""
        self._stopping.set()
        self.server.wake()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():  # it still owns the sockets: it closes them when it ends
                log.error("controller thread did not stop within %.1f s", timeout)
        self.failover.close()
        self.observers.stop()

    def __enter__(self) -> "Controller":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

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
        self.server.wake(blocking=False)  # a signal may interrupt a holder of the lock

    def report_rank_exit(self, rank: int, exitcode: int) -> None:
        """Agent/launcher report: worker ``rank``'s process exited with ``exitcode``. Thread-safe."""
        self._cmds.put(("exit", (int(rank), int(exitcode), self.clock())))
        self.server.wake()

    def report_rank_restart(self, rank: int, incarnation: int, pid: int, exitcode: int) -> None:
        """Agent report (``--enable-worker-reboot``): worker ``rank``, whose process exited
        with ``exitcode``, runs again as ``pid``, its ``incarnation``-th restart. Recorded in
        the outcome (``restarts``); the rank's state is not changed (its new process
        registers as a new sender). Thread-safe."""
        self._cmds.put(("restart", (int(rank), int(incarnation), int(pid), int(exitcode), self.clock())))
        self.server.wake()

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
            return self.arbiter.refused(rank)

    def report_restart_abandoned(self, rank: int, why: str) -> None:
        """Agent report (``--enable-worker-reboot``): dead ``rank`` will not be restarted
        (its restart budget is spent, its exit code is a verdict...). The policy stops
        waiting for it. Thread-safe."""
        self._cmds.put(("abandoned", (int(rank), str(why), self.clock())))
        self.server.wake()

    def wait_done(self, timeout: Optional[float] = None) -> Optional[Outcome]:
        """Block until the job is DONE (or ``timeout``); return the outcome or None."""
        if not self._done.wait(timeout):
            return None
        return self.outcome()

    def unresponsive_ranks(self) -> Dict[int, Tuple[int, str]]:
        """Processes given up on for silence: rank -> (pid, reason); the launcher ends
        each (SIGKILL) if that pid is still its worker of the rank.

        A rank whose heartbeats stopped (a hung or SIGSTOPped process) cannot act on a
        SIGTERM while stopped: whoever hosts the workers ends it. Listed: a hung rank
        declared dead for ARF (``RestartArbiter.note_hung``: its agent then restarts
        it), and, once a fault round started, every silent rank (left out of the dying
        checkpoint) but one inside its ordered recovery (:func:`~.policy.detect.silent`).
        Otherwise silence is fault evidence for :func:`decide`, not a verdict. Ranks
        that said goodbye or whose exit was reported are never listed. Thread-safe.
        """
        with self._lock:
            st = self.state
            out = self.arbiter.hung_processes()
            if st.fault is None:
                return out
            now, limit = self.clock(), self.config.heartbeat_timeout_s
            out.update({r: (i.pid, f"no heartbeat for {now - i.last_heartbeat:.1f} s (> {limit} s)")
                        for r, i in sorted(st.ranks.items())
                        if i.alive and i.exit_code is None and silent(now, st, self.config, r, limit)})
            return out

    def status(self) -> Dict[str, Any]:
        """The job as this controller sees it now (JSON-able copies, :func:`.snapshot.snapshot`;
        ``up``: its I/O thread runs). Thread-safe: read under the lock."""
        thread = self._thread
        with self._lock:
            out = snapshot(self, self.clock(), self.observers.job)
        out["up"] = thread is not None and thread.is_alive() and not self._stopping.is_set()
        return out

    @property
    def phase(self) -> Phase:
        with self._lock:
            return self.state.phase

    def outcome(self) -> Outcome:
        """The outcome so far (final once the phase is DONE); ``timings`` are the phase
        events of the last round (see :mod:`.outcome`)."""
        with self._lock:
            return build_outcome(self.state, tuple(self.events), self.timer.timings(),
                                 tuple(dict(r) for r in self.arbiter.restarts))

    def take_over(self, roster: Dict[str, Any]) -> None:
        """Start as the successor of a lost leader (before :meth:`start`).

        ``roster``: the predecessor's :meth:`roster` (``ranks``: rank -> registration;
        ``recoveries``: its in-place recoveries, so that the next process-group generation
        is a new one, their times dropped: another clock). Every rank of it is expected to
        register again (a survivor's processor finds this controller in the lease
        directory); no decision is taken until all did or ``heartbeat_timeout_s`` passed.
        A rank that did not is dead since the takeover (lost with the leader's node): with
        worker reboot its new process is awaited.
        """
        self.failover.take_over(roster, self.clock())

    def roster(self) -> Dict[str, Any]:
        """What a successor needs (JSON-able): ``ranks``, rank -> what its processor
        registered; ``recoveries``, the in-place recoveries so far."""
        return self.failover.roster()

    def traffic(self, zap: Optional[auth.ZapHandler] = None) -> str:
        """Counters of the control plane so far, one line (for logs and reports). Thread-safe."""
        with self._lock:
            zap = zap or self.server.zap
            return (f"frames accepted {self.codec.accepted}, frames rejected {dict(self.codec.rejected)}, "
                    f"connections refused {dict(self.transport_rejected.totals)}, "
                    f"ZAP {dict(zap.counts) if zap is not None else {}}")

    # ------------------------------------------------------------------ I/O thread
    def _run(self) -> None:
        try:
            self.server.serve(self._locked_turn, self._stopping, self.tick_s)
        finally:
            if self.heap_frozen:  # handlers.FREEZE_HEAP_FROM: the frozen objects are collected as usual again
                gc.unfreeze()
                self.heap_frozen = False
            log.info("controller thread exits (phase %s); control plane: %s", self.state.phase.value,
                     self.traffic(self.server.closed_zap))

    def _locked_turn(self) -> bool:
        """One turn under the lock; True (and ``wait_done`` answers) once the job is DONE."""
        try:
            with self._lock:
                self._turn()
                done = self.state.phase is Phase.DONE
        except Exception:  # never let one bad event kill the controller
            log.exception("controller: error while handling events")
            done = False
        if done:
            self._done.set()
        return done

    def _turn(self) -> None:
        """One bounded loop turn, then the decision step (caller holds ``_lock``).

        Agent reports, at most ``MAX_ZAP_PER_TURN`` ZAP requests,
        ``MAX_EVENTS_PER_TURN`` monitor events and ``MAX_FRAMES_PER_TURN`` frames; what
        is left waits for the next turn. Then ``decide`` runs whatever the inbound
        rate (chaining up to ``MAX_DECISIONS_PER_STEP`` decisions that need no new
        input). Each item is stamped with the clock read when it is handled.
        """
        server = self.server
        if self.failover.fenced():  # a stepped-down controller reads and drops what arrives
            _discard(self._cmds)
            server.discard_input()
            return
        began = self.clock()
        if not self._cmds.empty():
            self._news = True
        handlers.drain_commands(self, self._cmds)
        server.serve_zap()
        closes = server.closes_reported
        server.drain_monitor(MAX_EVENTS_PER_TURN)
        reading = self.clock()
        for now, ident, fd, msg in server.frames(MAX_FRAMES_PER_TURN):
            if msg.type not in ROUTINE or self.state.phase is not Phase.RUNNING:
                self._news = True
            handlers.dispatch(self, now, ident, fd, msg)
        server.flush_closed()  # after the frames: a rank's GOODBYE before its close
        now = self.clock()
        busy = reading - began
        if server.closes_reported != closes:
            self._news = True
        try:
            self._decision_step(now)
        finally:
            end = self.clock()
            credit_busy(self, busy + end - now, end)

    def _decision_step(self, now: float) -> None:
        """The decision step of a turn: ``decide`` (chained), then the operator's replies.

        While the job runs and only heartbeats, status reports and registrations arrived
        since the last step (nothing any decision reads but silence, judged by the clock), it runs
        at most every :func:`routine_gap`: each step reads every rank (O(N)), and at thousands of
        ranks one per batch of frames would cost more than the frames. Likewise, while frames
        are still queued after a turn (thousands of STOPPED, FAULT or ACTION_RESULT answers
        arriving at once), the step waits until they are read or :func:`routine_gap` passed
        (16,384 ranks: 64 steps of O(N) per round otherwise), except in a running job that
        got news (a fault, a death: a heartbeat stream keeps the socket from being read empty).
        The gap is paced by the cost of ``decide`` alone (the last step's), not of the
        fan-outs it made (a 16,384-rank STOP took 0.1 s and held the next round's step 1 s).
        """
        self.codec.reject_log.flush(now)
        self.transport_rejected.flush(now)
        if not self.failover.may_decide(now):
            return
        if self.subhealth is not None:
            self.subhealth.tick(self, now)
        since = None if self._last_decision_at is None else now - self._last_decision_at
        if since is not None and not self.server.input_empty and since < routine_gap(self) and not (
                self._news and self.state.phase is Phase.RUNNING):
            return  # more answers are queued: one step once they are read (or the gap passed)
        if not self._news and self.state.phase is Phase.RUNNING and since is not None and since < routine_gap(self):
            return  # nothing but heartbeats, status and registrations since the last step
        self._news = False
        previous, self._last_decision_at = self._last_decision_at, now
        if previous is not None and now - previous < self.config.heartbeat_timeout_s / 2:
            # not after a stall of the controller itself (its process frozen, swapped out):
            # then every rank would look silent, and ending them would lose the job
            remote = frozenset(self.arbiter.agent_of) - self.hosted_ranks
            self.arbiter.note_hung(now, self.hosted_ranks | remote)
            self.arbiter.end_remote(now, remote)
        self.operators.switches.claim_deaths(self, now)  # a hot switch's replica fallback takes its deaths first
        cost = 0.0
        for _ in range(MAX_DECISIONS_PER_STEP):
            t = self.clock()
            d = decide(now, self.state, self.config)
            cost += self.clock() - t
            if d.action is ActionKind.NOOP and d.next_phase is None:
                break
            effects.apply(self, now, d)
            if awaits_answers(self.state, d):
                break  # nothing was read since: the next decide could only wait (O(N) saved)
        self.operators.settle(self, now)
        self.decision_cost_s = max(0.0, cost)


def routine_gap(ctl: Controller) -> float:
    """Seconds between two decision steps of ``ctl`` while only routine frames arrive, or
    while frames are still queued after a turn: ``tick_s``, or ``ROUTINE_STEP_GAP`` times the
    last step's cost if more (at most a tenth of the heartbeat timeout): each step reads
    every rank, and at 16,384 ranks one costs 10-60 ms, so a step every ``tick_s`` left the
    thread too little time to read the frames (265 of 32,768 frames/s handled, every rank
    taken for silent; a UCE round's loop 2.2-2.6 -> 1.5 CPU-s: docs/RESULTS.md). Silence is
    still judged within a tenth of its timeout; a death, a fault or an answer is decided as
    soon as the queued frames are read."""
    return max(ctl.tick_s, min(ROUTINE_STEP_GAP * ctl.decision_cost_s, ctl.config.heartbeat_timeout_s / 10))


#: the decisions that send a round whose answers the next decision waits for
ROUNDS = frozenset({ActionKind.STOP_ALL, ActionKind.RETRY, ActionKind.VERIFY, ActionKind.DUMP, ActionKind.ASSEMBLE,
                    ActionKind.COMMIT, ActionKind.EXIT})


def awaits_answers(state: ClusterState, d: Any) -> bool:
    """Whether decision ``d``, just applied, ends the decision step: it sent a round (STOP,
    RETRY, VERIFY, DUMP, ASSEMBLE, COMMIT, EXIT) to at least one rank, and no graceful stop
    is under way. Nothing is read between two decisions of one step and every such round's
    timeout counts from its sending, so the next ``decide`` (O(N): 10-40 ms at 16,384
    ranks) could only return NOOP while the answers are awaited; a graceful stop's
    preemption deadline is the one clock that may end a round at once (EXIT(77)), so then
    the step goes on as before."""
    return d.action in ROUNDS and bool(d.targets) and state.stop_request is None


def credit_busy(ctl: Controller, busy_s: float, now: float) -> None:
    """Liveness is judged on what was received, not on how fast this thread read it.

    ``busy_s``: the seconds of one turn of ``ctl`` spent on anything but reading the socket
    (agent reports, ZAP, the monitor, the decision step and its fan-out). A heartbeat
    sent meanwhile waited in the socket's queue: beyond ``tick_s`` (the loop's own
    pace), that time is credited to every live rank's last heartbeat (never past
    ``now``), so the controller never takes a rank for silent because it was itself
    busy. A rank that is really gone is judged silent that much later. O(N), only
    after such a turn.
    """
    excess = busy_s - ctl.tick_s
    if excess <= 0:
        return
    ctl.busy_credited_s += excess
    for info in ctl.state.ranks.values():
        if info.alive:
            info.last_heartbeat = min(now, info.last_heartbeat + excess)
    if excess > ctl.config.heartbeat_interval_s:
        log.warning("controller: busy for %.2f s outside reading its socket; credited to every rank's liveness",
                    busy_s)


#: the frames that change no decision while the job runs (silence is judged by the clock;
#: a registration, thousands of them at a job's start, changes none either)
ROUTINE = frozenset({wire.MsgType.HEARTBEAT, wire.MsgType.STATUS, wire.MsgType.REGISTER, wire.MsgType.HEALTH,
                     wire.MsgType.NODE_BEAT})


def _discard(commands: "queue.SimpleQueue[Any]") -> None:
    while True:
        try:
            commands.get_nowait()
        except queue.Empty:
            return


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


def _check_flags(a: argparse.Namespace) -> None:
    """The standalone controller's numeric flags (before anything binds).

    Raises:
        ConfigError: naming the flag and the accepted range.
    """
    if a.world_size < 1:
        raise ConfigError(f"--world-size={a.world_size}: accepted integers >= 1")
    if a.port is not None and not 0 <= a.port <= 65535:
        raise ConfigError(f"--port={a.port}: accepted range 0..65535 (0: any free port)")
    t = a.registration_timeout
    if t is not None and not (math.isfinite(t) and t > 0):
        raise ConfigError(f"--registration-timeout={t}: accepted finite seconds > 0")


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m mindspeed_ha.control.controller``: run until DONE; exit with the job's code."""
    p = argparse.ArgumentParser(prog="python -m mindspeed_ha.control.controller",
                                description="mindspeed-ha job controller (exits with the job)")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, default=None, help=f"default: {ha_env.TTP_PORT} or 8000; 0: any free port")
    p.add_argument("--bind", default=None, help="bind address (default: CONTROLLER_ADDR/TTP_ADDR or 127.0.0.1)")
    p.add_argument("--save", default=None, help="fallback --save directory if ranks register none")
    p.add_argument("--registration-timeout", type=float, default=None,
                   help="exit if no rank registers within this many seconds (default: 2 x connect timeout)")
    p.add_argument("--events-file", dest="ha_events_file", default=None, help="as --ha-events-file")
    p.add_argument("--metrics-port", dest="ha_metrics_port", type=int, default=None, help="as --ha-metrics-port")
    p.add_argument("--metrics-addr", dest="ha_metrics_addr", default=None, help="as --ha-metrics-addr")
    add_subhealth_arguments(p)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _check_flags(a)
        cfg = HAConfig.from_args(argparse.Namespace(**{k: v for k, v in vars(a).items() if k.startswith("ha_")},
                                                    save=a.save), os.environ)
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
