"""What each inbound message does to the controller's ``ClusterState``: one table.

:func:`dispatch` routes one authenticated message: REGISTER to :func:`register`, a node
agent's messages to :data:`restarts.AGENT_HANDLERS`, and a registered rank's messages
to :data:`RANK_HANDLERS` (message type -> handler); anything else is counted as
rejected; an operator's OPERATOR_REQUEST goes to the controller's
:class:`~.operator_desk.OperatorDesk`. :data:`COMMANDS` does the same for the reports other threads of this
process queue (the launcher's hooks, a signal handler). Handlers run on the I/O thread
under the controller's lock; they change state and send replies, and decide nothing
(that is :func:`policy.decide`).
"""

from __future__ import annotations

import gc
import logging
import queue
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import zmq

from mindspeed_ha.control import restarts, wire
from mindspeed_ha.control.integrity import IntegrityReport, short_digest
from mindspeed_ha.control.state import OptimizerStatus, Phase, RankInfo
from mindspeed_ha.faults import FaultKind

if TYPE_CHECKING:
    from mindspeed_ha.control.controller import Controller

log = logging.getLogger("mindspeed_ha.control.controller")

#: from this world size on, the heap is frozen (``gc.freeze``) once every rank registered: a
#: full collection walks every object of the process (the ranks' state, the launcher's
#: torch), and at 16,384 ranks one took up to 1.1 s (scripts/bench_controller_logic.py,
#: load 20), a turn the controller reads nothing; objects made later are collected as usual
FREEZE_HEAP_FROM = 1024
#: the FAULT kinds this controller knows (another one is UNKNOWN)
_FAULT_KINDS = frozenset(k.value for k in FaultKind)

#: (controller, now, rank, its RankInfo, message body) -> None
RankHandler = Callable[["Controller", float, int, RankInfo, Any], None]


def dispatch(ctl: "Controller", now: float, ident: bytes, fd: Optional[int], msg: wire.Message) -> None:
    """Handle one message from connection ``ident`` (``fd``: its socket, if known)."""
    body = msg.body
    if msg.type is wire.MsgType.REGISTER:
        register(ctl, now, ident, fd, msg.sender, body)
        return
    if msg.type.value in wire.AGENT_TYPES:
        restarts.agent_message(ctl, now, ident, msg)
        return
    if msg.type is wire.MsgType.OPERATOR_REQUEST:  # an operator (mindspeed-ha status | pause | ...)
        ctl.operators.handle(ctl, now, ident, body)
        return
    if msg.type is wire.MsgType.NODE_BEAT:  # a node relay's merged heartbeats
        node_beat(ctl, now, ident, body)
        return
    if msg.type is wire.MsgType.NODE_ANSWERS:  # a node relay's merged answers of its ranks
        node_answers(ctl, now, ident, msg)
        return
    incoming = ctl.operators.switches.owns(ident)
    if incoming is not None:  # a hot switch's new process, not the rank yet (control/switch_desk.py)
        ctl.operators.switches.incoming_message(ctl, now, incoming, msg)
        return
    rank = ctl.server.rank_of_ident.get(ident)
    if rank is None or getattr(body, "rank", rank) != rank:
        ctl.codec.rejected["unregistered"] += 1
        log.debug("controller: %s from unregistered peer %r ignored", msg.type.value, ident)
        if rank is None and msg.type is not wire.MsgType.GOODBYE:
            try:  # e.g. a controller restarted: ask the processor to register again
                ctl.server.send(ident, wire.Registered(getattr(body, "rank", -1), False, "unregistered: send REGISTER"))
            except zmq.ZMQError:
                pass
        return
    info = ctl.state.ranks[rank]
    ctl.server.bind_fd(fd, rank)
    info.last_heartbeat = now
    handler = RANK_HANDLERS.get(msg.type)
    if handler is None:
        ctl.codec.rejected["unexpected_type"] += 1
    else:
        handler(ctl, now, rank, info, body)


# ---------------------------------------------------------------------- registration
def register(ctl: "Controller", now: float, ident: bytes, fd: Optional[int], sender: str,
             body: wire.Register) -> None:
    """REGISTER: admit the rank (idempotent for a re-sent REGISTER of the same process),
    answer REGISTERED, and bring a late rank into a stop or drain under way."""
    st = ctl.state
    ok, detail, stale = True, "", False
    if not 0 <= body.rank < ctl.world_size:
        ok, detail = False, f"rank {body.rank} outside world size {ctl.world_size}"
    elif body.world_size != ctl.world_size:
        ok, detail = False, f"world size {body.world_size} != controller's {ctl.world_size}"
    elif not body.switching:
        ok, detail = _current_incarnation(st, body)
        stale = not ok
    if ok and body.switching:  # a hot switch's new process: not the rank until the switch commits
        ok, detail = ctl.operators.switches.register_incoming(ctl, now, ident, fd, sender, body)
        try:
            ctl.server.send(ident, wire.Registered(body.rank, ok, detail))
        except zmq.ZMQError as exc:
            log.warning("controller: cannot answer REGISTER of rank %d's new process: %s", body.rank, exc)
        return
    if ok:
        _admit(ctl, now, ident, fd, sender, body)
    else:
        log.log(logging.WARNING if stale else logging.ERROR, "registration refused: %s", detail)
    try:
        ctl.server.send(ident, wire.Registered(body.rank, ok, detail))
    except zmq.ZMQError as exc:
        log.warning("controller: cannot answer REGISTER of rank %d: %s", body.rank, exc)
    if ok and st.phase is Phase.STOPPING:
        ctl.server.send_to_rank(body.rank, wire.Stop("job is stopping"))
    elif ok and st.phase in (Phase.DRAINING, Phase.PAUSING, Phase.PAUSED):
        ctl.server.send_to_rank(body.rank, wire.Drain(
            "graceful stop" if st.phase is Phase.DRAINING else "graceful pause",
            -1 if st.drain_until is None else st.drain_until, st.phase is not Phase.DRAINING))


def _current_incarnation(st, body: wire.Register) -> Tuple[bool, str]:
    """(True, "") unless ``body`` comes from a process older than the rank's current one (a
    lower incarnation: the process a hot switch or a restart replaced). Such a process may
    still talk while it exits (an unregistered peer is asked to register again): admitting
    it would make the live rank's process a stale one and its GOODBYE the rank's death."""
    cur = st.ranks.get(body.rank)
    if cur is None or body.incarnation >= cur.incarnation:
        return True, ""
    return False, (f"rank {body.rank}: pid {body.pid} is its incarnation {body.incarnation}, replaced by "
                   f"incarnation {cur.incarnation} (pid {cur.pid})")


def _admit(ctl: "Controller", now: float, ident: bytes, fd: Optional[int], sender: str, body: wire.Register) -> None:
    st = ctl.state
    old = st.ranks.get(body.rank)
    if old is not None and old.sender == sender:
        # a re-sent REGISTER (its REGISTERED crossed it, or the connection was made again):
        # answered again, nothing else changes (the roster is not rewritten, nothing logged)
        old.last_heartbeat = now
        if ctl.server.ident.get(body.rank) != ident:
            ctl.server.ident[body.rank] = ident
            ctl.server.rank_of_ident[ident] = body.rank
        ctl.server.bind_fd(fd, body.rank)
        ctl.duplicate_registers += 1
        log.debug("rank %d: REGISTER repeated, answered again", body.rank)
        return
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
    ctl.server.ident[body.rank] = ident
    ctl.server.rank_of_ident[ident] = body.rank
    ctl.server.bind_fd(fd, body.rank)
    if ctl.first_register_at is None:
        ctl.first_register_at = now
    if len(st.ranks) < ctl.world_size:
        if st.registering_until is None and not st.recoveries:  # the job's start-up
            st.registering_until = now + ctl.config.connect_timeout_s
    elif st.registering_until is not None:  # the last one: silence counts from now on, for everyone
        st.registering_until = None
        for other in st.ranks.values():
            other.last_heartbeat = max(other.last_heartbeat, now)
        if ctl.world_size >= FREEZE_HEAP_FROM and not ctl.heap_frozen:
            gc.freeze()  # the job's long-lived state: no full collection walks it again (see FREEZE_HEAP_FROM)
            ctl.heap_frozen = True  # undone when the controller thread ends
    ctl.failover.note_rank(info)
    if not st.run_id:
        st.run_id = body.run_id
    n, world = len(st.ranks), ctl.world_size
    # a line per rank for the first ones and every eighth of the job, the others at DEBUG
    # (16,384 lines at a large job's start cost the I/O thread ~1 s and tell nothing more)
    level = logging.INFO if n <= REGISTER_LINES or n == world or n % max(1, world // 8) == 0 else logging.DEBUG
    log.log(level, "rank %d registered (pid %d on %s, layout %s); %d/%d ranks", body.rank, body.pid,
            body.host, body.layout, n, world)


#: registrations logged one line each at INFO before the log goes to one line per eighth of the job
REGISTER_LINES = 16
#: from this world size on, a round's routine per-rank answers (STOPPED, ACTION_RESULT ok, the
#: FAULT(aborted) of an in-place recovery) are logged at DEBUG: at 16,384 ranks a round is
#: 16,384 lines per step, about 13 us each of the I/O thread; the decisions' own lines
#: summarise them (failures stay at INFO / WARNING)
PER_RANK_LINES_UP_TO = 256


def _per_rank_level(ctl: "Controller", ok: bool = True) -> int:
    return logging.INFO if ctl.world_size <= PER_RANK_LINES_UP_TO or not ok else logging.DEBUG


# ---------------------------------------------------------------------- a registered rank's messages
def _heartbeat(ctl: "Controller", now: float, rank: int, info: RankInfo, body: wire.Heartbeat) -> None:
    pass  # dispatch stamped last_heartbeat already


#: wire string -> its member, read per frame (``OptimizerStatus(s)`` / ``FaultKind(s)`` is a Python-level
#: enum call, about a microsecond, for each of a round's 16,384 answers)
_STATUSES: Dict[str, OptimizerStatus] = {s.value: s for s in OptimizerStatus}
_KINDS: Dict[str, FaultKind] = {k.value: k for k in FaultKind}


def _optimizer_status(value: Any) -> OptimizerStatus:
    """``OptimizerStatus(value)`` (ValueError for an unknown one), a dict lookup for a known one."""
    found = _STATUSES.get(value) if type(value) is str else None
    return found if found is not None else OptimizerStatus(value)


def _status(ctl: "Controller", now: float, rank: int, info: RankInfo, body: Any) -> None:
    was = info.iteration if info.status is OptimizerStatus.UPDATED or info.status is OptimizerStatus.UPDATING else None
    info.status, info.iteration = _optimizer_status(body.status), body.iteration
    info.step = body.step
    if info.status is OptimizerStatus.UPDATED:  # the step time as the controller sees it (metrics, status)
        if was is not None and body.iteration == was and info.updated_at is not None:
            info.step_seconds = now - info.updated_at  # UPDATED(k-1) -> UPDATING(k) -> UPDATED(k)
        info.updated_at = now
        if ctl.subhealth is not None:
            ctl.subhealth.on_progress(now, rank, body.iteration)


def _health(ctl: "Controller", now: float, rank: int, info: RankInfo, body: wire.Health) -> None:
    if ctl.subhealth is not None:  # else a processor with --ha-subhealth and a controller without: ignored
        ctl.subhealth.on_health(now, rank, body)


def _fault(ctl: "Controller", now: float, rank: int, info: RankInfo, body: Any) -> None:
    info.fault = _KINDS.get(body.kind, FaultKind.UNKNOWN) if type(body.kind) is str else (
        FaultKind(body.kind) if body.kind in _FAULT_KINDS else FaultKind.UNKNOWN)
    info.fault_message = body.message
    info.fault_where = body.where
    info.fault_iteration = body.iteration
    info.fault_at = now
    # body.iteration is the iteration being computed, not the optimizer status's:
    # STATUS / STOPPED messages stay the only source of (status, iteration).
    if info.failed_at is None:
        info.failed_at = now
    level = logging.WARNING if info.fault is not FaultKind.ABORTED else _per_rank_level(ctl)
    if log.isEnabledFor(level):  # (its arguments cost even when the line is not written)
        log.log(level, "rank %d: %s fault at iteration %d: %s", rank, info.fault.value, body.iteration, body.message)


def _stopped(ctl: "Controller", now: float, rank: int, info: RankInfo, body: Any) -> None:
    st = ctl.state
    if body.pause_at >= 0 and body.pause_at != st.drain_until:
        # paused at its first-round limit before the target was known: it says so
        # again when DRAIN(target) reaches it, if the target is where it is
        log.debug("rank %d: paused after iteration %d (drain target %s)", rank, body.pause_at, st.drain_until)
        info.paused_after = body.pause_at  # a graceful pause of ranks not started yet agrees on it
        return
    info.stopped = True
    info.status, info.iteration = _optimizer_status(body.status), body.iteration
    info.step = body.step
    level = _per_rank_level(ctl)
    if log.isEnabledFor(level):
        log.log(level, "rank %d: stopped, optimizer %s@%d%s", rank, info.status.value, info.iteration,
                f" (paused after iteration {body.pause_at})" if body.pause_at >= 0 else "")


def _draining(ctl: "Controller", now: float, rank: int, info: RankInfo, body: Any) -> None:
    info.pause_at = body.pause_at
    log.info("rank %d: will pause after iteration %d", rank, body.pause_at)


def _stop_request(ctl: "Controller", now: float, rank: int, info: RankInfo, body: Any) -> None:
    stop_requested(ctl, rank, body.reason, now)


def _action_result(ctl: "Controller", now: float, rank: int, info: RankInfo, body: Any) -> None:
    if ctl.operators.switches.action_result(now, ("rank", rank), body):
        log.info("rank %d: hot switch %s %s", rank, "ok" if body.ok else "FAILED", body.detail)
        return
    p = ctl.state.pending
    if p is not None and p.action_id == body.action_id and p.is_target(rank):
        p.results[rank] = (body.ok, body.detail)
        level = _per_rank_level(ctl, body.ok)
        if log.isEnabledFor(level):
            log.log(level, "rank %d: %s %s %s", rank, p.kind, "ok" if body.ok else "FAILED", body.detail)


def _integrity(ctl: "Controller", now: float, rank: int, info: RankInfo, body: Any) -> None:
    info.integrity = IntegrityReport(body.iteration, body.shard_ok, body.shard_digest, body.model_ok,
                                     body.model_digest, body.detail)
    log.log(logging.INFO if body.shard_ok and body.model_ok else logging.ERROR,
            "rank %d: integrity at iteration %d: shard %s %s, model %s %s%s", rank, body.iteration,
            "ok" if body.shard_ok else "CORRUPT", short_digest(body.shard_digest),
            "ok" if body.model_ok else "CORRUPT", short_digest(body.model_digest),
            f" ({body.detail})" if body.detail else "")


def _goodbye(ctl: "Controller", now: float, rank: int, info: RankInfo, body: Any) -> None:
    info.exit_code = body.exit_code
    ctl.state.mark_dead(rank, f"said goodbye (exit code {body.exit_code})", body.exit_code, now)
    ctl.arbiter.expect_rejoin(rank, body.exit_code, now)  # a rank that said goodbye is not restarted
    ctl.server.send_to_rank(rank, wire.GoodbyeAck(rank))  # only now may its connection close
    log.info("rank %d: goodbye, exit code %d", rank, body.exit_code)


#: message type -> what it does, for the messages of a registered rank
def _pause_task_result(ctl: "Controller", now: float, rank: int, info: RankInfo, body: Any) -> None:
    ctl.operators.tasks.on_result(ctl, now, rank, body)  # a check / relink answered (control/pause_tasks.py)


RANK_HANDLERS: Dict[wire.MsgType, RankHandler] = {
    wire.MsgType.HEARTBEAT: _heartbeat,
    wire.MsgType.STATUS: _status,
    wire.MsgType.FAULT: _fault,
    wire.MsgType.STOPPED: _stopped,
    wire.MsgType.DRAINING: _draining,
    wire.MsgType.STOP_REQUEST: _stop_request,
    wire.MsgType.ACTION_RESULT: _action_result,
    wire.MsgType.INTEGRITY: _integrity,
    wire.MsgType.GOODBYE: _goodbye,
    wire.MsgType.PAUSE_TASK_RESULT: _pause_task_result,
    wire.MsgType.HEALTH: _health,
}


def node_beat(ctl: "Controller", now: float, relay: Any, body: wire.NodeBeat) -> None:
    """NODE_BEAT (schema 13): the node relay on connection ``relay`` heard a valid HEARTBEAT
    of each local connection it names since its previous beat (``control/relay.py``).
    Each ``sub`` counts as a heartbeat of the rank whose connection is ``(relay, sub)`` now,
    if that rank is alive (or of the hot switch's new process on it); a ``sub`` that is no
    rank's connection through this relay is counted (``ctl.beat_unknown``) and ignored.
    O(subs); no rank's frame is decoded."""
    if type(relay) is not bytes:  # a relayed rank's frame cannot speak for a node
        ctl.codec.rejected["unexpected_type"] += 1
        return
    ctl.node_beats += 1
    server, ranks, switches = ctl.server, ctl.state.ranks, ctl.operators.switches
    for sub in body.subs:
        ident = (relay, sub)
        rank = server.rank_of_ident.get(ident)
        if rank is not None and server.ident.get(rank) == ident:
            info = ranks.get(rank)
            if info is not None and info.alive:
                info.last_heartbeat = now
            continue
        incoming = switches.owns(ident)
        if incoming is not None:
            switches.incoming[incoming].info.last_heartbeat = now
        else:
            ctl.beat_unknown += 1


def node_answers(ctl: "Controller", now: float, ident: Any, msg: wire.Message) -> None:
    """NODE_ANSWERS (schema 14): the node relay verified each named rank's answer (STOPPED,
    ACTION_RESULT ok, FAULT aborted) and carried this frame among its ranks' frames, in each
    one's order (``control/relay.py``). Each ``(sub, rank)`` is handled as that rank's own
    frame from connection ``(relay, sub)`` (what :func:`dispatch` does for it): a sub that is
    not the named rank's connection through this relay now is rejected as an unregistered
    peer's frame. Only a relay's own frame, carried in its message with an empty sub, may be
    one (else counted and ignored). O(ranks named); no rank's frame decoded, and no body
    made per rank: the handler of each rank plainly on its connection is given the common
    body (``wire.NodeAnswers.common``, whose ``rank`` is the first one's; the rank is the
    handler's own argument, which is all a handler of a mergeable answer reads of it)."""
    if type(ident) is not tuple or ident[1] != b"":
        ctl.codec.rejected["unexpected_type"] += 1
        return
    relay, body = ident[0], msg.body
    ctl.node_answers += 1
    mtype = wire.MsgType(body.answer)
    handler = RANK_HANDLERS[mtype]
    server, ranks, switches = ctl.server, ctl.state.ranks, ctl.operators.switches
    common, rank_of, bodies = body.common, server.rank_of_ident, None
    for i, (sub, named) in enumerate(zip(body.subs, body.ranks)):
        ident = (relay, sub)
        rank = rank_of.get(ident)
        if rank is None or rank != named or (switches.incoming and switches.owns(ident) is not None):
            # not plainly that rank's connection: the general path decides (and rejects or answers)
            if bodies is None:
                bodies = body.bodies()
            dispatch(ctl, now, ident, None, wire.Message(mtype, msg.seq, msg.sender, bodies[i]))
            continue
        info = ranks[rank]  # what dispatch does for a registered rank's frame (no descriptor: relayed)
        info.last_heartbeat = now
        handler(ctl, now, rank, info, common)


# ---------------------------------------------------------------------- other evidence
def connection_closed(ctl: "Controller", rank: int, now: float) -> None:
    """The socket monitor saw ``rank``'s control connection close: its process is gone
    (unless it said goodbye or its exit was reported first)."""
    info = ctl.state.ranks.get(rank)
    if info is not None and info.alive and info.exit_code is None:
        ctl.state.mark_dead(rank, "control connection closed", None, now)
        log.warning("rank %d: control connection closed", rank)
        ctl.arbiter.expect_rejoin(rank, None, now)


def stop_requested(ctl: "Controller", rank: int, reason: str, at: float) -> None:
    """A graceful stop was asked for (by a rank's STOP_REQUEST or the launcher)."""
    st = ctl.state
    if st.request_stop(at, rank, reason):
        log.warning("graceful stop requested: %s", reason)
    else:
        log.info("graceful stop request ignored (%s): job phase %s%s", reason, st.phase.value,
                 ", a stop was already requested" if st.stop_request else "")


#: what another thread of this process queued (Controller.report_* / request_stop) -> its handler
COMMANDS: Dict[str, Callable[..., None]] = {
    "exit": lambda ctl, *a: ctl.arbiter.rank_exited(*a),
    "abandoned": lambda ctl, *a: ctl.arbiter.restart_abandoned(*a),
    "stop": stop_requested,
    "restart": lambda ctl, *a: ctl.arbiter.rank_restarted(*a),
}


def drain_commands(ctl: "Controller", commands: "queue.SimpleQueue[Any]") -> None:
    """Handle every queued ``(command, args)`` of :data:`COMMANDS`, oldest first."""
    while True:
        try:
            cmd, arg = commands.get_nowait()
        except queue.Empty:
            return
        handler = COMMANDS.get(cmd)
        if handler is not None:
            handler(ctl, *arg)
