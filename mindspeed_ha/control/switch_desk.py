"""The controller's side of the hot switch (``mindspeed-ha switch --ranks R | --node HOST``):
requests, the spares, the commit, events and replies. The decisions before the commit point are
:mod:`.policy.switch` (pure); this module does what they say, on the controller thread
under the controller's lock, like :mod:`.operator_desk`.

Entry points:

* :func:`request` (the ``switch`` verb of :data:`.operator_desk.VERBS`, and any internal
  caller such as a sub-health policy, with the ranks as its parameter): refused at once with
  a reason (code REFUSED) or recorded (STARTING); the reply waits for the switch's end.
* the agent of the controller's launcher (its thread; :meth:`SwitchDesk.agent_wanted`,
  :meth:`SwitchDesk.agent_report`, under a lock of their own): per rank, start a new
  process, keep it, or (committed) put it in the old process's place once that one exited 0
  (not counted as a restart); a rank no longer listed: end its new process. The agent
  reports the pid it started, a new process that died, and the place taken.
* the new process (REGISTER with ``switching``, :meth:`SwitchDesk.register_incoming`): it
  is not the rank yet; its frames come here (:meth:`SwitchDesk.owns`,
  :meth:`SwitchDesk.incoming_message`): FAULT ``where=rejoin`` is READY (parked at its
  rejoin point), ACTION_RESULT its part of the commit, GOODBYE its end.
* :meth:`SwitchDesk.settle` (after each decision step, from ``OperatorDesk.settle``): runs
  :func:`.policy.switch.step` and acts: PAUSE asks the graceful pause
  (``ClusterState.pause``); ABORT releases a pause this switch asked for (training goes on
  on the old ranks), ends the new processes and answers FAILED with the reason; COMMIT
  sends the plan (ACTION ``switch`` to every paused rank, RETRY(mode ``switch``) to each
  new process, :mod:`mindspeed_ha.recovery.switch`); every answer ok -> the new process
  becomes the rank (RankInfo, connection), EXIT 0 to the old one, RELEASE: DONE.
  A failed answer after the commit point: FAILED, the graceful stop of the job (its
  checkpoint of K).
* :meth:`SwitchDesk.claim_deaths` (before each decision step): the replica fallback
  (:mod:`.switch_commit`): an outgoing process that died in its handoff while a replica
  holder of its state lives is the switch's, not a fault of the job; its new process is
  repaired from the holder (REPAIR: a second plan, mode ``switch_repair``), then DONE as above.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

import zmq

from mindspeed_ha.control import job_events, wire
from mindspeed_ha.control.policy import ActionKind
from mindspeed_ha.control.policy import switch as policy
from mindspeed_ha.control.policy.recovery import RecoveryMode, RecoveryPlan
from mindspeed_ha.control.policy.switch import Switch, SwitchAction, SwitchPhase
from mindspeed_ha.control.state import OptimizerStatus, PauseRequest, Phase, RankInfo, summarise_ranks
from mindspeed_ha.control.switch_commit import FALLBACK_STAGES, SWITCH_STAGES, Answers, ReplicaFallback, old_pid
from mindspeed_ha.faults import FaultKind

if TYPE_CHECKING:
    from mindspeed_ha.control.controller import Controller

log = logging.getLogger("mindspeed_ha.control.controller")

#: reply codes (as :mod:`.operator_desk`'s)
DONE, FAILED, REFUSED = 0, 1, 4
#: request ids of the controller's own requests start so (:func:`.operator_desk.internal_request`)
INTERNAL_REQUEST = "internal-"
#: ended switches kept for ``status``
KEEP_SWITCHES = 5
#: seconds between two SWITCH_VIEW of the same content to another node's agent (while not empty)
VIEW_RESEND_S = 1.0


@dataclasses.dataclass
class Incoming:
    """A switched rank's new process, registered (not the rank yet)."""

    ident: bytes
    fd: Optional[int]
    info: RankInfo


class SwitchDesk:
    """The hot switches of one controller: the one under way and the last ended ones."""

    def __init__(self) -> None:
        self.current: Optional[Switch] = None
        self.ended: List[Switch] = []
        #: switched rank -> why its spare is gone (cleared with each new switch)
        self.spares_gone: Dict[int, str] = {}
        #: switched rank -> its new process, once registered
        self.incoming: Dict[int, Incoming] = {}
        self._paused_by_switch = False
        #: the answers the plan out waits for (the switch's, then its replica fallback's)
        self.answers = Answers()
        self.fallback = ReplicaFallback()
        # the agent's side (its thread): guarded by _mail
        self._mail = threading.Lock()
        #: global rank -> what its agent does: "start" a new process, "keep" it (parked or
        #: starting), "commit" (put it in the old process's place once that one exits 0);
        #: a rank not listed: end its new process, if any
        self._agent_view: Dict[int, str] = {}
        self._reports: List[Tuple[str, int, Any]] = []
        #: other nodes (agent connection) -> (the view last sent, when); controller thread
        self._pushed: Dict[bytes, Tuple[Dict[int, str], float]] = {}
        #: other nodes' parked warm spares: node -> {"host", "pid", "node"} (AGENT_REPORT ``spare``)
        self.remote_spares: Dict[str, Dict[str, Any]] = {}

    # ------------------------------------------------------------------ the agent (its thread)
    def agent_wanted(self) -> Dict[int, str]:
        """Global rank -> ``start`` | ``keep`` | ``commit`` (see ``_agent_view``)."""
        with self._mail:
            return dict(self._agent_view)

    def agent_report(self, what: str, rank: int, value: Any) -> None:
        """``started`` (value: pid), ``gone`` (value: why) or ``switched`` (value: pid: the new
        process took the old one's place) for the new process of ``rank``."""
        with self._mail:
            self._reports.append((what, int(rank), value))
            if what == "started" and self._agent_view.get(int(rank)) == "start":
                self._agent_view[int(rank)] = "keep"
            elif what in ("gone", "switched"):
                self._agent_view.pop(int(rank), None)

    # ------------------------------------------------------------------ inputs
    def request(self, ctl: "Controller", now: float, request_id: str, ranks: Sequence[int],
                node: Optional[str] = None, requested_by: str = "operator") -> Optional[wire.OperatorReply]:
        """A switch of ``ranks``, or of every rank registered from host ``node`` (``--node``:
        one switch, one pause, every group rebuilt once): the refusal (REFUSED, nothing else
        happens), or None (the reply comes with the switch's end, from :meth:`settle`).
        ``requested_by``: the SwitchRequested event's ``reason`` (``operator``, or the
        controller's own reason, e.g. the sub-health detector's flag)."""
        ranks = [int(r) for r in ranks]
        if node is not None:
            if ranks:
                return wire.OperatorReply(request_id, REFUSED, f"--node {node!r}: give --ranks or --node, not both")
            ranks, why = policy.node_ranks(ctl.state, str(node))
            if why is not None:
                log.warning("operator: hot switch refused: %s", why)
                return wire.OperatorReply(request_id, REFUSED, why)
        switching = self.busy_ranks()
        why = policy.refuse(ctl.state, ctl.config, ranks, spares_by_node(ctl), switching, node_of(ctl))
        if why is not None:
            log.warning("operator: hot switch of ranks %s refused: %s", ranks, why)
            return wire.OperatorReply(request_id, REFUSED, why)
        self.current = sw = Switch(request_id, tuple(sorted(ranks)), now)
        self.spares_gone, self.incoming = {}, {}
        self.answers, self.fallback = Answers(), ReplicaFallback()
        with self._mail:
            self._reports = []
            self._agent_view.update({r: "start" for r in sw.ranks})
        job_events.note(ctl.recorder, "SwitchRequested", None, ranks=sw.ranks, reason=requested_by,
                        request_id=request_id, **({"node": str(node)} if node is not None else {}))
        log.warning("operator: hot switch of ranks %s: new processes starting (training goes on)", list(sw.ranks))
        return None

    def spare_ready(self, ctl: "Controller", now: float, rank: int, pid: int) -> bool:
        """The new process of switched ``rank`` is parked at its rejoin point. False when no
        switch of that rank is starting."""
        sw = self.current
        if sw is None or rank not in sw.ranks or sw.phase is not SwitchPhase.STARTING:
            return False
        sw.ready[rank] = int(pid)
        log.warning("hot switch: the new process of rank %d (pid %d) is READY", rank, pid)
        if all(r in sw.ready for r in sw.ranks):
            sw.transition(SwitchPhase.READY, now, "every new process is READY")
            job_events.note(ctl.recorder, "SwitchReady", None, ranks=sw.ranks,
                            phase_seconds=policy.phase_seconds(sw.marks), pids=dict(sw.ready))
        return True

    def spare_gone(self, rank: int, why: str) -> None:
        """The new process of switched ``rank`` died (before the commit point: the switch aborts)."""
        if self.current is not None and rank in self.current.ranks:
            self.spares_gone.setdefault(rank, why)

    def wanted(self) -> Dict[int, Tuple[str, int]]:
        """Switched rank -> (request id, 0) for each new process still to be READY."""
        sw = self.current
        if sw is None or sw.phase is not SwitchPhase.STARTING:
            return {}
        return {r: (sw.request_id, 0) for r in sw.ranks if r not in sw.ready and r not in self.spares_gone}

    # ------------------------------------------------------------------ the new process's frames
    def register_incoming(self, ctl: "Controller", now: float, ident: bytes, fd: Optional[int], sender: str,
                          body: wire.Register) -> Tuple[bool, str]:
        """REGISTER with ``switching``: admitted as the incoming process of its rank while a
        switch of that rank is starting (a repeat is answered again)."""
        sw = self.current
        if sw is None or body.rank not in sw.ranks or sw.phase is not SwitchPhase.STARTING:
            return False, f"no hot switch of rank {body.rank} is starting"
        old = self.incoming.get(body.rank)
        if old is not None and old.info.sender == sender:
            old.ident, old.fd = ident, fd
            return True, ""
        info = RankInfo(rank=body.rank, layout=body.layout, last_heartbeat=now, pid=body.pid, host=body.host,
                        save_dir=body.save_dir, sender=sender)
        info.incarnation, info.rejoins, info.verifies = body.incarnation, body.rejoins, body.verifies
        self.incoming[body.rank] = Incoming(ident, fd, info)
        log.info("hot switch: the new process of rank %d registered (pid %d, incarnation %d)", body.rank, body.pid,
                 body.incarnation)
        return True, ""

    def owns(self, ident: bytes) -> Optional[int]:
        """The rank whose new process speaks on connection ``ident``, or None."""
        for rank, inc in self.incoming.items():
            if inc.ident == ident:
                return rank
        return None

    def incoming_message(self, ctl: "Controller", now: float, rank: int, msg: wire.Message) -> None:
        """A frame of the new process of ``rank`` (see the module doc)."""
        inc, body = self.incoming[rank], msg.body
        inc.info.last_heartbeat = now
        if msg.type is wire.MsgType.FAULT and body.where == "rejoin":
            sw = self.current
            if sw is not None and sw.phase is SwitchPhase.COMMITTED:  # its handoff failed: parked again
                self.fallback.parked_again.add(rank)
            else:
                self.spare_ready(ctl, now, rank, inc.info.pid)
        elif msg.type is wire.MsgType.ACTION_RESULT:
            self.action_result(now, ("incoming", rank), body)
        elif msg.type is wire.MsgType.GOODBYE:
            self.spare_gone(rank, f"its new process ended (exit code {getattr(body, 'exit_code', '?')})")

    def action_result(self, now: float, who: Tuple[str, int], body: Any) -> bool:
        """An answer to the commit's actions; False when it is not one."""
        return self.answers.note(who, body.action_id, body.ok, body.detail)

    # ------------------------------------------------------------------ the controller's turn
    def claim_deaths(self, ctl: "Controller", now: float) -> None:
        """Before the decision step: an outgoing process that died in its handoff, where
        :func:`.policy.switch.committed` says FALLBACK, is taken by the switch (its new process
        stands for the rank) before the pause's decision would take it for a fault of the job."""
        sw = self.current
        if sw is None or sw.phase is not SwitchPhase.COMMITTED or sw.fallback:
            return
        decision = policy.committed(now, sw, ctl.state, self.spares_gone, self.answers.failed(), self.answers.late(),
                                    _due(self.answers, now), self.fallback.parked_again)
        if decision.action is SwitchAction.FALLBACK:
            self.fallback.claim(ctl, now, sw, decision, {r: self.incoming[r].info for r in decision.sources})

    def settle(self, ctl: "Controller", now: float) -> List[Tuple[str, wire.OperatorReply]]:
        """After the decision step: act for the switch under way; returns the replies of
        switches that ended (request id, reply)."""
        sw = self.current
        if sw is None:
            return []
        self._read_mail(ctl, now, sw)
        st = ctl.state
        if sw.phase is SwitchPhase.COMMITTED:
            return self._committing(ctl, now, sw)
        if sw.phase is SwitchPhase.PAUSING and st.phase is Phase.PAUSED:
            sw.iteration = st.drain_until
            sw.mark("paused", now)
        decision = policy.step(now, sw, st, ctl.config, self.spares_gone)
        if decision.action is SwitchAction.PAUSE:
            if sw.phase is SwitchPhase.STARTING:
                sw.transition(SwitchPhase.READY, now, "every new process is READY")
            st.pause = PauseRequest(now, 0.0, False)
            self._paused_by_switch = True
            ctl.operators.pause_asked(now)
            sw.transition(SwitchPhase.PAUSING, now, decision.reason)
            job_events.note(ctl.recorder, "PauseRequested", None, reason="hot switch", max_s=0.0, then_stop=False)
        elif decision.action is SwitchAction.COMMIT:
            self._commit(ctl, now, sw, decision.reason)
        elif decision.action is SwitchAction.ABORT:
            return self._abort(ctl, now, decision.reason)
        return []

    def _read_mail(self, ctl: "Controller", now: float, sw: Switch) -> None:
        with self._mail:
            reports, self._reports = self._reports, []
        for what, rank, value in reports:
            if what == "started":
                sw.started[rank] = int(value)
                log.warning("hot switch: the agent started the new process of rank %d: pid %d", rank, value)
            elif what == "gone":
                self.spare_gone(rank, str(value))

    def _commit(self, ctl: "Controller", now: float, sw: Switch, why: str) -> None:
        """The commit point: the switch plan to every paused rank and every new process."""
        st = ctl.state
        k = int(st.drain_until)
        generation = 1 + max([int(r.get("generation") or 0) for r in st.recoveries] + [0])
        plan = RecoveryPlan(iteration=k, generation=generation, kind=FaultKind.PROCESS, fault_rank=sw.ranks[0],
                            repairs={r: r for r in sw.ranks}, mode=RecoveryMode.SWITCH, rejoin=sw.ranks,
                            reason=f"hot switch of ranks {list(sw.ranks)} after iteration {k}")
        params = plan.to_params()
        st.recoveries.append({"iteration": k, "kind": "switch", "mode": "switch", "rank": sw.ranks[0],
                              "generation": generation, "repairs": params["repairs"], "evidence_at": sw.at,
                              "stop_at": sw.marks.get("paused"), "abort_at": None, "retry_at": now,
                              "done_at": None, "ranks": {}})
        ctl.failover.roster_dirty = True
        sw.transition(SwitchPhase.COMMITTED, now, why)
        self.answers = _send_plan(ctl, now, range(st.world_size), [self.incoming[r] for r in sw.ranks], params)
        log.warning("hot switch of ranks %s: the plan goes out (generation %d, iteration %d)", list(sw.ranks),
                    generation, k)

    def _committing(self, ctl: "Controller", now: float, sw: Switch) -> List[Tuple[str, wire.OperatorReply]]:
        answers = self.answers
        decision = policy.committed(now, sw, ctl.state, self.spares_gone, answers.failed(), answers.late(),
                                    _due(answers, now), self.fallback.parked_again)
        if decision.action is SwitchAction.WAIT:
            return []
        if decision.action is SwitchAction.FAIL:
            return self._fail(ctl, now, sw, decision.reason, decision.stop)
        stages = answers.stage_seconds(FALLBACK_STAGES if "repair" in sw.marks else SWITCH_STAGES, sw.stage_seconds)
        if decision.action is SwitchAction.FALLBACK:
            self.fallback.claim(ctl, now, sw, decision, {r: self.incoming[r].info for r in decision.sources})
            return []
        if decision.action is SwitchAction.REPAIR:  # the replica fallback's plan: holders send, new processes receive
            params = self.fallback.plan(ctl.state, sw, decision).to_params()
            sw.stage_seconds = stages  # the switch's plan's (rebuild)
            sw.mark("repair", now)
            staying = [r for r in range(ctl.state.world_size) if r not in sw.ranks]
            self.answers = _send_plan(ctl, now, staying, [self.incoming[r] for r in sorted(decision.sources)], params)
            log.warning("hot switch of ranks %s: the replica fallback's plan goes out (ranks %s from %s)",
                        list(sw.ranks), summarise_ranks(sorted(decision.sources)), dict(decision.sources))
            return []
        sw.mark("answered", now)
        old_pids = {r: old_pid(ctl.state, self.fallback, r) for r in sw.ranks}
        for r in sw.ranks:
            self._take_place(ctl, now, r, sw.iteration)
        self.fallback = ReplicaFallback()
        ctl.state.recoveries[-1]["done_at"] = now
        if ctl.state.pause is not None:
            ctl.state.pause.resume_at = now  # RELEASE: training resumes at K+1
        self._paused_by_switch = False
        sw.mark("resumed", now)
        sw.stage_seconds = stages
        sw.transition(SwitchPhase.DONE, now, f"ranks {list(sw.ranks)} moved from pids "
                      f"{[old_pids[r] for r in sw.ranks]} to {[ctl.state.ranks[r].pid for r in sw.ranks]}" + (
                          f" (the replica fallback: {decision.reason})" if sw.fallback else ""))
        return [self._end(ctl, sw, DONE, f"hot switch of ranks {list(sw.ranks)} done after iteration "
                          f"{sw.iteration}: {sw.reason}", "SwitchFinished")]

    def _take_place(self, ctl: "Controller", now: float, rank: int, k: Optional[int]) -> None:
        """The new process becomes ``rank``; the old one is told EXIT 0 (switched out)."""
        st, server = ctl.state, ctl.server
        inc = self.incoming.pop(rank)
        old_ident = server.ident.get(rank)
        info = inc.info
        info.status, info.iteration, info.last_heartbeat = OptimizerStatus.UPDATED, int(k if k is not None else -1), now
        st.ranks[rank] = info
        if old_ident is not None:
            server.rank_of_ident.pop(old_ident, None)
        server.forget_rank(rank)  # the old connection's close is not this rank's death
        server.ident[rank] = inc.ident
        server.rank_of_ident[inc.ident] = rank
        server.bind_fd(inc.fd, rank)
        ctl.failover.roster_dirty = True
        with self._mail:
            self._agent_view[rank] = "commit"
        self.push_views(ctl, now)  # another node's agent knows before its old process exits 0
        if old_ident is not None and rank not in self.fallback.claimed:  # (a claimed one is dead)
            self._send(ctl, old_ident, wire.Action(next(ctl.action_ids), ActionKind.EXIT.value, {
                "code": 0, "reason": f"hot switch: rank {rank} goes on in pid {info.pid}"}))

    def _fail(self, ctl: "Controller", now: float, sw: Switch, why: str, stop: bool = True
              ) -> List[Tuple[str, wire.OperatorReply]]:
        """After the commit point: the new processes end; the graceful stop of the job (the
        checkpoint of K) when ``stop``, else the fault handling under way decides (the
        outgoing processes the replica fallback took are dead ranks again for it)."""
        self.fallback.restore(ctl.state)
        for r, inc in sorted(self.incoming.items()):
            self._send(ctl, inc.ident, wire.Action(next(ctl.action_ids), ActionKind.EXIT.value, {
                "code": 1, "reason": f"hot switch failed: {why}"}))
        self.incoming = {}
        if stop:
            ctl.state.request_stop(now, -1, f"hot switch failed after its commit point: {why}")
        self._paused_by_switch = False
        sw.transition(SwitchPhase.FAILED, now, why)
        then = (f"the job stops gracefully (checkpoint of iteration {sw.iteration})" if stop else
                f"the job's fault handling goes on (dying checkpoint of iteration {sw.iteration} where a replica "
                "holds each dead rank's state)")
        return [self._end(ctl, sw, FAILED, f"hot switch of ranks {list(sw.ranks)} failed after its commit point: "
                          f"{why}; {then}", "SwitchAborted")]

    def _abort(self, ctl: "Controller", now: float, why: str) -> List[Tuple[str, wire.OperatorReply]]:
        sw = self.current
        assert sw is not None
        st = ctl.state
        if self._paused_by_switch and st.pause is not None and st.phase in (Phase.PAUSING, Phase.PAUSED):
            st.pause.resume_at = now  # the pause plan releases every rank: training goes on
        self._paused_by_switch = False
        for r, inc in sorted(self.incoming.items()):  # each new process ends; its agent reports it gone
            self._send(ctl, inc.ident, wire.Action(next(ctl.action_ids), ActionKind.EXIT.value, {
                "code": 0, "reason": f"hot switch abandoned: {why}"}))
        self.incoming = {}
        sw.transition(SwitchPhase.ABORTED, now, why)
        return [self._end(ctl, sw, FAILED, f"hot switch of ranks {list(sw.ranks)} abandoned: {why}",
                          "SwitchAborted")]

    def _end(self, ctl: "Controller", sw: Switch, code: int, detail: str, event: str
             ) -> Tuple[str, wire.OperatorReply]:
        seconds = policy.phase_seconds(sw.marks, sw.stage_seconds)
        job_events.note(ctl.recorder, event, sw.iteration, ranks=sw.ranks, reason=sw.reason, phase_seconds=seconds,
                        outcome=sw.phase.value, request_id=sw.request_id)
        self.ended.append(sw)
        del self.ended[:-KEEP_SWITCHES]
        self.current = None
        with self._mail:  # the new processes not switched in end (their agent ends them)
            for r in sw.ranks:
                if self._agent_view.get(r) != "commit":
                    self._agent_view.pop(r, None)
        self.answers = Answers()
        return sw.request_id, wire.OperatorReply(sw.request_id, code, detail, describe(sw))

    @staticmethod
    def _send(ctl: "Controller", ident: bytes, body: Any) -> None:
        try:
            ctl.server.send(ident, body)
        except (zmq.ZMQError, wire.WireError) as exc:
            log.warning("hot switch: cannot send %s: %s", type(body).__name__, exc)

    # ------------------------------------------------------------------ other nodes' agents
    def push_views(self, ctl: "Controller", now: float) -> None:
        """SWITCH_VIEW to each other node's agent whose ranks' view changed since the last one
        sent, or again after :data:`VIEW_RESEND_S` while not empty (controller thread; after
        every decision step, from ``OperatorDesk.settle``)."""
        agents = ctl.arbiter.agent_of
        if not agents:
            return
        with self._mail:
            view = dict(self._agent_view)
        sw = self.current if self.current is not None else (self.ended[-1] if self.ended else None)
        rid = sw.request_id if sw is not None else ""
        by_agent: Dict[bytes, Dict[int, str]] = {}
        for r, ident in agents.items():
            if r not in ctl.hosted_ranks:
                mine = by_agent.setdefault(ident, {})
                if r in view:
                    mine[r] = view[r]
        for ident, mine in by_agent.items():
            last = self._pushed.get(ident)
            if (last is None and not mine) or (last is not None and last[0] == mine
                                               and (not mine or now - last[1] < VIEW_RESEND_S)):
                continue
            self._pushed[ident] = (mine, now)
            self._send(ctl, ident, wire.SwitchView(rid, sorted(mine), [mine[r] for r in sorted(mine)]))

    def node_spare(self, ctl: "Controller", rank: int, pid: int, host: str) -> None:
        """Another node's agent (that of ``rank``) reports its parked warm spare ``pid`` (0: none)."""
        node = node_of(ctl).get(int(rank))
        if node is None:
            return
        if pid:
            self.remote_spares[node] = {"host": str(host), "pid": int(pid), "node": node}
        else:
            self.remote_spares.pop(node, None)

    # ------------------------------------------------------------------ status
    def busy_ranks(self) -> List[int]:
        """The ranks of the switch under way and those whose switched-out process has not
        exited yet (a new switch of any rank waits for them)."""
        with self._mail:
            return sorted(set(self.current.ranks if self.current is not None else ())
                          | {r for r, v in self._agent_view.items() if v == "commit"})

    def status(self) -> List[Dict[str, Any]]:
        """The switch under way and the last ended ones (``mindspeed-ha status``)."""
        rows = [describe(s) for s in self.ended]
        if self.current is not None:
            rows.append(describe(self.current))
        return rows


def describe(sw: Switch) -> Dict[str, Any]:
    """One switch as ``status`` and the operator's reply show it (JSON-able)."""
    return {"ranks": list(sw.ranks), "phase": sw.phase.value, "iteration": sw.iteration, "reason": sw.reason,
            "started": {str(r): p for r, p in sorted(sw.started.items())},
            "spares": {str(r): p for r, p in sorted(sw.ready.items())},
            "phase_seconds": policy.phase_seconds(sw.marks, sw.stage_seconds),
            **({"fallback": {str(r): s for r, s in sorted(sw.fallback.items())}} if sw.fallback else {})}


def _due(answers: Answers, now: float) -> float:
    return answers.deadline if answers.deadline is not None else now


def _send_plan(ctl: "Controller", now: float, ranks: Sequence[int], incoming: Sequence[Incoming],
               params: Dict[str, Any]) -> Answers:
    """ACTION ``switch`` with the plan ``params`` to ``ranks``, RETRY to each new process of
    ``incoming``; returns the answers it waits for (due 2 x ``--ha-action-timeout`` from ``now``)."""
    answers = Answers(now + 2 * ctl.config.action_timeout_s)
    aid = next(ctl.action_ids)
    for r in ranks:
        answers.expect(("rank", r), aid)
    ctl.server.send_to_ranks(ranks, wire.Action(aid, ActionKind.SWITCH.value, params))
    for inc in incoming:
        raid = next(ctl.action_ids)
        answers.expect(("incoming", inc.info.rank), raid)
        SwitchDesk._send(ctl, inc.ident, wire.Action(raid, ActionKind.RETRY.value, params))
    return answers


def node_of(ctl: "Controller") -> Dict[int, str]:
    """Global rank -> its node, for the ranks of other nodes' launchers (``agent`` and the
    routing id of their agent link, e.g. ``agent a1-0c4f...``); the ranks not listed run
    under the launcher hosting the controller (:data:`.policy.switch.LOCAL_NODE`)."""
    hosted = ctl.hosted_ranks
    return {int(r): f"agent {ident.decode('ascii', 'replace')}" for r, ident in ctl.arbiter.agent_of.items()
            if r not in hosted}


def spares_by_node(ctl: "Controller") -> Optional[Dict[str, int]]:
    """Node -> warm spares parked there (None: no launcher reported one): the hosting
    launcher's (``ctl.spares``) and the other nodes' (AGENT_REPORT ``spare``)."""
    desk = ctl.operators.switches
    if ctl.spares is None and not desk.remote_spares:
        return None
    out = {policy.LOCAL_NODE: len(ctl.spares or ())}
    out.update({node: 1 for node in desk.remote_spares})
    return out


def spares_listed(ctl: "Controller") -> Optional[List[Dict[str, Any]]]:
    """Every node's parked warm spare (``status``): None when no launcher reported one."""
    remote = list(ctl.operators.switches.remote_spares.values())
    if ctl.spares is None and not remote:
        return None
    return list(ctl.spares or ()) + remote


def request(ctl: "Controller", now: float, body: wire.OperatorRequest) -> Optional[wire.OperatorReply]:
    """The ``switch`` verb (:data:`.operator_desk.VERBS`): ``body.params["ranks"]`` (or every
    rank registered from host ``body.params["node"]``) to new processes; the controller's
    own request (:func:`.operator_desk.internal_request`) gives its reason in
    ``body.params["reason"]``."""
    node = body.params.get("node")
    internal = body.request_id.startswith(INTERNAL_REQUEST)
    by = str(body.params.get("reason") or "controller") if internal else "operator"
    return ctl.operators.switches.request(ctl, now, body.request_id, list(body.params.get("ranks") or ()),
                                          None if node is None else str(node), by)


__all__ = ["Incoming", "SwitchDesk", "describe", "node_of", "request", "spares_by_node", "spares_listed"]
