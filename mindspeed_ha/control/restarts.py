"""Node agents and restart arbitration (``--enable-worker-reboot``, ARF).

A node's launcher (its agent) restarts a dead worker only when the controller allows
it (:meth:`RestartArbiter.refused`); the policy then waits for the new process
(``ClusterState.rejoin_wait``, armed by :meth:`RestartArbiter.expect_rejoin` when the
death is seen) instead of starting the dying checkpoint. The agent on the controller's
node asks in process (``Controller.restart_refused`` / ``report_*``); agents of other
nodes send AGENT_HELLO / RESTART_QUERY / AGENT_REPORT over the control port
(:mod:`mindspeed_ha.control.agent_link`), handled by :data:`AGENT_HANDLERS` with the
same decisions.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, AbstractSet, Any, Callable, Dict, List, Optional, Set, Tuple

import zmq

from mindspeed_ha.control import job_events, wire
from mindspeed_ha.control.policy import ActionKind
from mindspeed_ha.control.state import Phase

if TYPE_CHECKING:
    from mindspeed_ha.control.controller import Controller

log = logging.getLogger("mindspeed_ha.control.controller")

#: END_WORKER to another node's agent: seconds between two for the same hung process, and at most how many
END_WORKER_RESEND_S = 2.0
END_WORKER_SENDS = 5
#: exit codes that are a verdict (75-79) or a clean end (0): their worker is never restarted
_NOT_RESTARTED = frozenset({0, *range(75, 80)})


class RestartArbiter:
    """Whether a dead rank may be restarted, and the record of restarts.

    Runs on the controller's I/O thread under its lock (``Controller.restart_refused``
    takes the lock for callers of other threads).

    Args:
        ctl: the controller (its ``state``, ``config``, ``world_size``, ``stepped_down``
            and ``failover.takeover_at`` are read).
    """

    def __init__(self, ctl: "Controller"):
        self.ctl = ctl
        #: report_rank_restart, in order: rank, incarnation, pid, exit_code, at
        self.restarts: List[Dict[str, Any]] = []
        self.abandoned: Set[int] = set()  # ranks the agent will not restart again
        #: ranks declared hung for ARF (:meth:`note_hung`): rank -> (pid of the hung process, why)
        self.hung: Dict[int, Tuple[int, str]] = {}
        #: global rank -> the connection of the other node's agent that last spoke for it
        #: (AGENT_HELLO, RESTART_QUERY, AGENT_REPORT): where END_WORKER goes
        self.agent_of: Dict[int, bytes] = {}
        self._end_sent: Dict[int, Tuple[float, int]] = {}  # rank -> (last END_WORKER sent at, how many)

    def refused(self, rank: int) -> Optional[str]:
        """None while the agent may restart a dead ``rank``, else why not (see
        ``Controller.restart_refused``)."""
        st = self.ctl.state
        if self.ctl.stepped_down is not None:
            return f"this controller stepped down ({self.ctl.stepped_down})"
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

    def expect_rejoin(self, rank: int, code: Optional[int], at: float) -> None:
        """ARF: a rank whose process died with a code its agent restarts (not 0, not a
        verdict 75-79; None: its control connection closed, the agent says more), while
        the job runs or recovers, and whose processor said it can rejoin: the policy
        waits for its new process (``ClusterState.rejoin_wait``) until the agent reports
        it abandoned or the wait's deadline."""
        st = self.ctl.state
        info = st.ranks.get(rank)
        if not self.ctl.config.worker_reboot:
            return
        if code is not None and code in _NOT_RESTARTED:
            st.rejoin_wait.pop(rank, None)
            return
        if info is None or not info.rejoins or st.stop_request is not None or rank in self.abandoned:
            return
        pending = st.pending
        if st.phase is Phase.RUNNING or (st.phase is Phase.RECOVERING and
                                          (pending is None or pending.kind != ActionKind.RETRY.value)):
            if rank not in st.rejoin_wait:
                st.rejoin_wait[rank] = at
                log.info("rank %d: its agent may restart it: the new process is awaited to rejoin", rank)

    def note_hung(self, now: float, hosted: AbstractSet[int]) -> List[int]:
        """ARF for a hang: a rank of ``hosted`` (the workers of this controller's own
        launcher and those of the other nodes' agents that spoke to this controller,
        :attr:`agent_of`: the launchers that can end them) whose heartbeats stopped for longer than
        ``heartbeat_timeout_s`` (a SIGSTOPped process, a deadlock that holds every thread)
        while it may be restarted is declared dead now: its launcher SIGKILLs that process
        (this node: :meth:`Controller.unresponsive_ranks`; another node: END_WORKER over
        its agent's link, :meth:`end_remote`), its agent restarts it,
        and the policy waits for the new process to rejoin (``rejoin_wait``) as after a
        crash, instead of taking the dying checkpoint. A job whose every rank is silent
        keeps the silent-rank path; the controller calls this only when its previous
        decision step is less than half a heartbeat timeout old (after a stall of its own,
        every rank would look hung). Returns the ranks declared hung now.
        """
        ctl, st = self.ctl, self.ctl.state
        declared: List[int] = []
        if not ctl.config.worker_reboot or not hosted:
            return declared
        limit = ctl.config.heartbeat_timeout_s
        if not any(i.alive and now - i.last_heartbeat <= limit for i in st.ranks.values()):
            return declared  # every rank silent: not one hung process (the silent-rank path decides)
        for r in sorted(hosted):
            info = st.ranks.get(r)
            if (info is None or not info.alive or info.exit_code is not None or now - info.last_heartbeat <= limit
                    or r in self.abandoned or self.refused(r) is not None):
                continue
            why = (f"no heartbeat for {now - info.last_heartbeat:.1f} s (> {limit} s): hung; its launcher ends "
                   "the process and restarts it (--enable-worker-reboot)")
            st.mark_dead(r, why, None, info.last_heartbeat)
            self.hung[r] = (info.pid, why)
            self.expect_rejoin(r, None, now)
            declared.append(r)
            log.warning("rank %d (pid %d): %s", r, info.pid, why)
        return declared

    def end_remote(self, now: float, remote: AbstractSet[int]) -> None:
        """END_WORKER to the agent of each hung rank (:attr:`hung`) that another node hosts
        (``remote``, :attr:`agent_of`): that launcher SIGKILLs the hung process and restarts
        it (ARF). Sent again every ``END_WORKER_RESEND_S``, at most ``END_WORKER_SENDS``
        times, until a new process of the rank registered (the agent ends only that pid:
        a repeat is harmless). I/O thread."""
        st = self.ctl.state
        for r, (pid, why) in sorted(self.hung.items()):
            info = st.ranks.get(r)
            if r not in remote or info is None or info.pid != pid or r in self.abandoned:
                continue
            last, sent = self._end_sent.get(r, (None, 0))
            if sent >= END_WORKER_SENDS or (last is not None and now - last < END_WORKER_RESEND_S):
                continue
            self._end_sent[r] = (now, sent + 1)
            try:
                self.ctl.server.send(self.agent_of[r], wire.EndWorker(r, pid, why[:512]))
            except (zmq.ZMQError, wire.WireError) as exc:
                log.warning("rank %d: cannot ask its node's agent to end pid %d: %s", r, pid, exc)

    def hung_processes(self) -> Dict[int, Tuple[int, str]]:
        """rank -> (pid, why) of the hung processes still to be ended: a rank drops out once
        a new process of it registered (another pid)."""
        st = self.ctl.state
        for r in [r for r, (pid, _) in self.hung.items() if r in st.ranks and st.ranks[r].pid != pid]:
            del self.hung[r]
        return dict(self.hung)

    # ------------------------------------------------------------------ agent reports
    def rank_exited(self, rank: int, code: int, at: float) -> None:
        if self.ctl.state.mark_dead(rank, f"process exited with code {code} (agent report)", code, at):
            log.warning("rank %d: process exited with code %d (agent report)", rank, code)
        self.expect_rejoin(rank, code, at)

    def restart_abandoned(self, rank: int, why: str, at: float) -> None:
        self.abandoned.add(rank)  # its exit, reported after this, must not re-arm the wait
        if self.ctl.state.rejoin_wait.pop(rank, None) is not None:
            log.warning("rank %d: its agent will not restart it (%s): not waiting for it to rejoin", rank, why)

    def rank_restarted(self, rank: int, incarnation: int, pid: int, code: int, at: float) -> None:
        self.restarts.append({"rank": rank, "incarnation": incarnation, "pid": pid, "exit_code": code, "at": at})
        log.warning("rank %d: restarted by its agent as pid %d (incarnation %d; the previous one exited "
                    "with %d)", rank, pid, incarnation, code)
        job_events.note(self.ctl.recorder, "WorkerRestarted", None, ranks=[rank],
                        reason=f"the previous process exited with {code}", incarnation=incarnation, pid=pid,
                        exit_code=code)

    def welcome(self, body: wire.AgentHello) -> wire.AgentWelcome:
        """Which incarnation each of ``body.ranks`` starts as: 0 for a rank that never
        registered (the job's first start), its last incarnation + 1 for a rank whose
        process is gone and may rejoin (a lost node's replacement launcher)."""
        ctl, st = self.ctl, self.ctl.state
        ranks = list(body.ranks)
        bad = [r for r in ranks if not 0 <= r < ctl.world_size]
        if bad or not ranks or len(set(ranks)) != len(ranks):
            return wire.AgentWelcome(body.query_id, False, [], f"ranks {ranks}: expected distinct ranks in "
                                                               f"0..{ctl.world_size - 1}")
        incarnations = []
        takeover_at = ctl.failover.takeover_at
        for r in ranks:
            info = st.ranks.get(r)
            if info is None:
                incarnations.append(0)
                continue
            if info.alive and info.sender == "" and takeover_at is not None:
                # a successor still waits for it to register again: a launcher replacing its node says it is gone
                st.mark_dead(r, "its node's launcher was replaced (lost with the previous leader's node)", None,
                             takeover_at)
                self.expect_rejoin(r, None, takeover_at)
            if info.alive:
                return wire.AgentWelcome(body.query_id, False, [], f"rank {r} is alive (pid {info.pid} on "
                                                                   f"{info.host})", wait=True)
            why = self.refused(r)
            if why is None and r not in st.rejoin_wait:
                why = f"rank {r} is not awaited to rejoin (it exited with {info.exit_code})"
            if why is not None:
                return wire.AgentWelcome(body.query_id, False, [], why)
            incarnations.append(info.incarnation + 1)
        return wire.AgentWelcome(body.query_id, True, incarnations)


# ---------------------------------------------------------------------- agents of other nodes
def _hello(ctl: "Controller", now: float, body: Any) -> Any:
    reply = ctl.arbiter.welcome(body)
    log.log(logging.INFO if reply.accepted else logging.WARNING, "node %d's launcher (pid %d on %s), ranks "
            "%s: %s", body.node_rank, body.pid, body.host, list(body.ranks),
            f"incarnations {list(reply.incarnations)}" if reply.accepted else f"refused: {reply.detail}")
    return reply


def _restart_query(ctl: "Controller", now: float, body: Any) -> Any:
    if 0 <= body.rank < ctl.world_size:
        return wire.RestartAnswer(body.rank, body.query_id, ctl.arbiter.refused(body.rank) or "")
    return wire.RestartAnswer(body.rank, body.query_id, f"rank {body.rank} outside world size {ctl.world_size}")


#: AGENT_REPORT event -> (arbiter, body, now) -> None
_REPORTS: Dict[str, Callable[[RestartArbiter, Any, float], None]] = {
    "exit": lambda a, b, now: a.rank_exited(b.rank, b.exit_code, now),
    "restarted": lambda a, b, now: a.rank_restarted(b.rank, b.incarnation, b.pid, b.exit_code, now),
    "abandoned": lambda a, b, now: a.restart_abandoned(b.rank, b.detail, now),
    # hot switch (control/switch_desk.py): that node's agent, as the controller's own calls it in process
    "switch_started": lambda a, b, now: a.ctl.operators.switches.agent_report("started", b.rank, b.pid),
    "switch_gone": lambda a, b, now: a.ctl.operators.switches.agent_report("gone", b.rank, b.detail),
    "switched": lambda a, b, now: a.ctl.operators.switches.agent_report("switched", b.rank, b.pid),
    "spare": lambda a, b, now: a.ctl.operators.switches.node_spare(a.ctl, b.rank, b.pid, b.detail),
}


def _report(ctl: "Controller", now: float, body: Any) -> Any:
    if not 0 <= body.rank < ctl.world_size:
        ctl.codec.rejected["bad_body"] += 1
        return None
    handler = _REPORTS.get(body.event)
    if handler is None:
        ctl.codec.rejected["unexpected_type"] += 1
    else:
        handler(ctl.arbiter, body, now)
    return None


#: agent message type -> (controller, now, body) -> the reply to send, or None
AGENT_HANDLERS: Dict[wire.MsgType, Callable[["Controller", float, Any], Any]] = {
    wire.MsgType.AGENT_HELLO: _hello,
    wire.MsgType.RESTART_QUERY: _restart_query,
    wire.MsgType.AGENT_REPORT: _report,
}


def agent_message(ctl: "Controller", now: float, ident: bytes, msg: wire.Message) -> None:
    """A message of another node's launcher (``mindspeed_ha.control.agent_link``): the
    same decisions as the hooks this node's agent calls in process; the reply, if any,
    goes back to its connection."""
    handler = AGENT_HANDLERS.get(msg.type)
    if handler is None:
        ctl.codec.rejected["bad_body"] += 1
        return
    body = msg.body
    if not isinstance(body, wire.AgentHello) and 0 <= body.rank < ctl.world_size:
        ctl.arbiter.agent_of[body.rank] = ident  # before the handler: a ``spare`` report is that node's
    reply = handler(ctl, now, body)
    if isinstance(body, wire.AgentHello) and reply.accepted:
        for r in body.ranks:
            if 0 <= r < ctl.world_size:
                ctl.arbiter.agent_of[r] = ident
    if reply is not None:
        try:
            ctl.server.send(ident, reply)
        except (zmq.ZMQError, wire.WireError) as exc:
            log.warning("controller: cannot answer %s of an agent: %s", msg.type.value, exc)
