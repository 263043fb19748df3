"""The controller's side of the operator channel: OPERATOR_REQUEST -> verb -> OPERATOR_REPLY.

An operator (``mindspeed-ha status | pause | resume | stop | switch``, :mod:`.operator`) is one more
peer kind on the controller's ROUTER socket: a CURVE client with the job's key (one
without it never gets a frame through, see :mod:`.auth`), its frames HMAC-checked,
versioned and size-limited like a rank's (:mod:`.wire`). Its requests are handled on the
controller thread under the controller's lock, like every rank frame (:func:`handle`,
from :func:`.handlers.dispatch`); they change ``ClusterState`` (a pause, resume or stop
request) and decide nothing: the pause plan is :mod:`.policy.pause`.

Replies: ``status`` and the refusals at once; ``resume`` and ``stop`` once the request is
recorded; ``pause`` when every rank holds (PAUSED, with the iteration) or the pause
failed (the job left PAUSING another way: a fault, a stop, ranks that did not answer).
Codes: 0 done, 1 the action failed, 4 refused in the job's current state.

Idempotency: the reply of each ``request_id`` is kept (the last :data:`KEEP_REQUESTS`, a pending
request kept until it is answered); a
repeated id (a CLI retrying after a timeout or a controller failover, or an operator
repeating ``--request-id``) gets the first request's reply, or waits with it while it is
pending, and never acts twice.
"""

from __future__ import annotations

import collections
import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import zmq

from mindspeed_ha.control import job_events, snapshot, switch_desk, wire
from mindspeed_ha.control.pause_tasks import PauseTasks
from mindspeed_ha.control.policy.pause import PAUSE_FAILED
from mindspeed_ha.control.state import PauseRequest, Phase

if TYPE_CHECKING:
    from mindspeed_ha.control.controller import Controller

log = logging.getLogger("mindspeed_ha.control.controller")

#: reply codes (the CLI's exit codes, see :mod:`.operator`)
DONE, FAILED, REFUSED = 0, 1, 4
#: request ids whose reply is kept for repeats
KEEP_REQUESTS = 256
#: the longest request id accepted
MAX_REQUEST_ID = 64
#: the longest ``--max`` accepted, seconds (a week)
MAX_PAUSE_S = 7 * 24 * 3600.0
#: recoveries listed by ``status``
STATUS_RECOVERIES = 5


class OperatorDesk:
    """The operator requests of one controller: kept replies, pending ones, the pause's times.

    Owned by the controller thread (no lock of its own: it runs under the controller's).
    """

    def __init__(self) -> None:
        #: request_id -> (verb, reply or None while pending, connections waiting for it)
        self.requests: "collections.OrderedDict[str, Tuple[str, Optional[wire.OperatorReply], List[bytes]]]" = \
            collections.OrderedDict()
        self._phase: Optional[Phase] = None
        self._pause_asked_at: Optional[float] = None
        self._paused_at: Optional[float] = None
        #: (iteration, seconds from the request to every rank paused, seconds held) of each pause
        self.pauses: List[Dict[str, Any]] = []
        #: the pause tasks (check, relink): :mod:`.pause_tasks`
        self.tasks = PauseTasks()
        #: requests the controller raised itself so far (:func:`internal_request`)
        self.internal = 0
        #: the hot switches (``switch`` verb)
        self.switches = switch_desk.SwitchDesk()
        #: (verb, ranks, reason) the controller raises itself once the job runs again (a check's
        #: ``--on-fault switch``: the switch needs a running job, the check ends paused)
        self.deferred: List[Tuple[str, List[int], str]] = []

    # ------------------------------------------------------------------ requests
    def handle(self, ctl: "Controller", now: float, ident: Optional[bytes], body: wire.OperatorRequest) -> None:
        """One OPERATOR_REQUEST: answer a repeat from the kept reply, else run its verb.

        ``ident`` None: an internal request (e.g. a sub-health detector's ``check`` with
        ``params={"ranks": [...]}``, on the controller thread under its lock): acted on like
        an operator's, its reply kept under ``request_id`` (``requests``) and logged, sent to nobody."""
        rid = body.request_id
        if not 0 < len(rid) <= MAX_REQUEST_ID:
            self._send(ctl, ident, wire.OperatorReply(rid[:MAX_REQUEST_ID], REFUSED,
                                                      f"request_id: 1..{MAX_REQUEST_ID} characters"))
            return
        kept = self.requests.get(rid)
        if kept is not None:
            verb, reply, waiting = kept
            if reply is not None:
                self._send(ctl, ident, reply)
            elif ident is not None and ident not in waiting:
                waiting.append(ident)
            log.info("operator: %s request %s repeated: %s", verb, rid, "answered again" if reply else "pending")
            return
        verb = VERBS.get(body.verb)
        if verb is None:
            reply: Optional[wire.OperatorReply] = wire.OperatorReply(
                rid, REFUSED, f"unknown verb {body.verb!r}: one of {', '.join(wire.OPERATOR_VERBS)}")
        else:
            reply = verb(ctl, now, body)
        log.info("operator: %s request %s%s", body.verb, rid,
                 "" if reply is None else f": code {reply.code} {reply.detail}")
        self.requests[rid] = (body.verb, reply, [ident] if ident is not None else [])
        self.trim()
        if reply is not None and ident is not None:
            self._send(ctl, ident, reply)

    def settle(self, ctl: "Controller", now: float) -> None:
        """After the decision step: note the pause's times, answer pending pause requests."""
        st = ctl.state
        phase, self._phase = st.phase, st.phase
        if phase is Phase.PAUSED and self._paused_at is None:
            self._paused_at = now
            took = now - (self._pause_asked_at if self._pause_asked_at is not None else now)
            self.pauses.append({"iteration": st.drain_until, "pause_seconds": took, "held_seconds": None})
            job_events.note(ctl.recorder, "Paused", st.drain_until, ranks=st.alive_ranks(),
                            reason="operator's graceful pause", phase_seconds={"pausing": took}, purpose="pause")
            log.warning("controller: every rank holds after iteration %s (%.3f s after the pause request)",
                        st.drain_until, took)
        elif phase is not Phase.PAUSED and self._paused_at is not None:
            held = now - self._paused_at
            self.pauses[-1]["held_seconds"] = held
            self._paused_at = None
            job_events.note(ctl.recorder, "Resumed", self.pauses[-1]["iteration"], phase_seconds={"pause": held},
                            reason="training goes on" if phase is Phase.RUNNING else f"pause ended: {phase.value}",
                            phase=phase.value)
        if phase not in (Phase.PAUSING, Phase.PAUSED):
            self._pause_asked_at = None
        for rid, (verb, reply, waiting) in list(self.requests.items()):
            if reply is not None or verb != "pause":
                continue
            if phase is Phase.PAUSED:
                reply = wire.OperatorReply(rid, DONE, f"paused after iteration {st.drain_until}",
                                           {"iteration": st.drain_until, "seconds": self.pauses[-1]["pause_seconds"]})
            elif phase is not Phase.PAUSING:
                last = ctl.events[-1].reason if ctl.events else ""
                reply = wire.OperatorReply(rid, FAILED, f"{PAUSE_FAILED}: job phase {phase.value}: {last}")
            else:
                continue
            self._answer(ctl, rid, reply)
        for reply in self.tasks.settle(ctl, now):
            self._answer(ctl, reply.request_id, reply)
        for rid, reply in self.switches.settle(ctl, now):
            self._answer(ctl, rid, reply, "switch")
        self.switches.push_views(ctl, now)
        while self.deferred and phase is Phase.RUNNING and st.pause is None:
            verb, ranks, reason = self.deferred.pop(0)
            internal_request(ctl, now, verb, ranks, reason)

    def _answer(self, ctl: "Controller", rid: str, reply: wire.OperatorReply, verb: str = "") -> None:
        """Keep ``reply`` as request ``rid``'s and send it to every connection waiting for it."""
        kept = self.requests.get(rid)
        waiting = kept[2] if kept is not None else []
        self.requests[rid] = (kept[0] if kept is not None else verb, reply, [])
        for ident in waiting:
            self._send(ctl, ident, reply)

    def trim(self) -> None:
        """Keep the last :data:`KEEP_REQUESTS` requests, the oldest answered ones dropped first:
        a pending one (a switch, a pause, a task under way) only when nothing else is left, or
        its reply would reach nobody (a one-minute switch outlived 256 ``status`` polls of a
        monitor asking four times a second)."""
        excess = len(self.requests) - KEEP_REQUESTS
        if excess <= 0:
            return
        answered = [rid for rid, kept in self.requests.items() if kept[1] is not None]
        for rid in answered[:excess]:
            del self.requests[rid]
        while len(self.requests) > KEEP_REQUESTS:
            self.requests.popitem(last=False)

    def pause_asked(self, now: float) -> None:
        self._pause_asked_at = now

    @staticmethod
    def _send(ctl: "Controller", ident: Optional[bytes], reply: wire.OperatorReply) -> None:
        if ident is None:  # an internal request: its reply is kept, nobody to send it to
            return
        try:
            try:
                ctl.server.send(ident, reply)
            except wire.WireError as exc:  # e.g. the status of a huge job: over the frame limit
                ctl.server.send(ident, wire.OperatorReply(reply.request_id, FAILED, f"the answer does not fit one "
                                                          f"control frame ({exc}): raise the job's frame limit"))
        except (zmq.ZMQError, wire.WireError) as exc:  # the operator went away: its repeat gets the reply
            log.info("operator: cannot answer request %s: %s", reply.request_id, exc)


# ---------------------------------------------------------------------- the verbs
def _refused(body: wire.OperatorRequest, why: str) -> wire.OperatorReply:
    return wire.OperatorReply(body.request_id, REFUSED, why)


def _ask_pause(ctl: "Controller", now: float, max_s: float, then_stop: bool, reason: str) -> Optional[str]:
    """Record the operator's graceful pause of a RUNNING job; why it is refused, or None."""
    st = ctl.state
    if st.phase in (Phase.PAUSING, Phase.PAUSED):
        return f"the job is already {st.phase.value} (after iteration {st.drain_until})"
    if st.phase is not Phase.RUNNING:
        return f"the job is {st.phase.value}" + (f" ({ctl.events[-1].reason})" if ctl.events else "")
    if st.fault is not None or any(i.fault is not None for i in st.ranks.values()):
        return "a fault is being handled"
    if st.stop_request is not None:
        return f"a graceful stop was requested ({st.stop_request.reason})"
    missing = st.world_size - len(st.ranks)
    if missing > 0:
        return f"{missing} of {st.world_size} ranks have not registered yet"
    dead = [r for r, i in sorted(st.ranks.items()) if not i.alive]
    if dead:
        return f"ranks {dead} are gone"
    st.pause = PauseRequest(now, float(max_s), bool(then_stop))
    ctl.operators.pause_asked(now)
    job_events.note(ctl.recorder, "PauseRequested", None, reason=reason, max_s=float(max_s), then_stop=bool(then_stop))
    log.warning("operator: graceful pause requested%s", f" for at most {max_s:g} s" if max_s else "")
    return None


def _pause(ctl: "Controller", now: float, body: wire.OperatorRequest) -> Optional[wire.OperatorReply]:
    if not (math.isfinite(body.max_s) and 0 <= body.max_s <= MAX_PAUSE_S):
        return _refused(body, f"--max {body.max_s}: accepted range 0..{MAX_PAUSE_S:g} seconds (0: until resume)")
    why = _ask_pause(ctl, now, body.max_s, body.then_stop, "operator")
    return _refused(body, why) if why else None  # answered by settle(): PAUSED, or the pause failed


def _pause_task(ctl: "Controller", now: float, body: wire.OperatorRequest) -> Optional[wire.OperatorReply]:
    """``check`` / ``relink``: a pause task (:mod:`.pause_tasks`), answered once it ran."""
    return ctl.operators.tasks.submit(ctl, now, body, lambda: _ask_pause(ctl, now, 0.0, False, body.verb))


def _resume(ctl: "Controller", now: float, body: wire.OperatorRequest) -> Optional[wire.OperatorReply]:
    st = ctl.state
    if st.phase not in (Phase.PAUSING, Phase.PAUSED) or st.pause is None:
        return _refused(body, f"the job is not paused (phase {st.phase.value})")
    if st.stop_request is not None:
        return _refused(body, f"a graceful stop is under way ({st.stop_request.reason})")
    if ctl.operators.tasks.current is not None:  # it resumes (or not) as its request asked
        return _refused(body, f"a {ctl.operators.tasks.current.kind} is under way: the job resumes after it "
                        "unless it was asked to stay paused")
    if st.pause.resume_at is None:
        st.pause.resume_at = now
    log.warning("operator: resume requested (job %s after iteration %s)", st.phase.value, st.drain_until)
    return wire.OperatorReply(body.request_id, DONE, f"resuming after iteration {st.drain_until}",
                              {"iteration": st.drain_until})


def _stop(ctl: "Controller", now: float, body: wire.OperatorRequest) -> Optional[wire.OperatorReply]:
    st = ctl.state
    if not st.request_stop(now, -1, "the operator's stop"):
        return _refused(body, f"the job cannot stop gracefully now (phase {st.phase.value}"
                        + (", a stop was already requested)" if st.stop_request else ")"))
    log.warning("operator: graceful stop requested (checkpoint of the last completed iteration, exit 75)")
    return wire.OperatorReply(body.request_id, DONE, "graceful stop under way: the checkpoint of the last "
                              "completed iteration is written, then the job exits 75")


def _status(ctl: "Controller", now: float, body: wire.OperatorRequest) -> Optional[wire.OperatorReply]:
    return wire.OperatorReply(body.request_id, DONE, "", status(ctl, now))


VERBS: Dict[str, Callable[["Controller", float, wire.OperatorRequest], Optional[wire.OperatorReply]]] = {
    "status": _status,
    "pause": _pause,
    "resume": _resume,
    "stop": _stop,
    "check": _pause_task,
    "relink": _pause_task,
    "switch": switch_desk.request,
}


def internal_request(ctl: "Controller", now: float, verb: str, ranks: Any, reason: str) -> Tuple[bool, str]:
    """Run operator verb ``verb`` for ``ranks`` as the controller's own request (the
    sub-health detector's ``check`` / ``switch``, a check's ``--on-fault switch``): the same
    function an operator's request reaches, without a socket; its reply is kept like an
    operator's (request id ``internal-N``). Returns (ok, detail): not ok when there is no
    such verb (``detail`` says so), or the verb refused or failed.
    Controller thread, under its lock."""
    fn = VERBS.get(verb)
    if fn is None:
        return False, f"no operator verb {verb!r} in this controller (verbs: {', '.join(sorted(VERBS))})"
    ranks = [int(r) for r in ranks]
    desk = ctl.operators
    desk.internal += 1
    rid = f"{switch_desk.INTERNAL_REQUEST}{desk.internal}"
    reply = fn(ctl, now, wire.OperatorRequest(request_id=rid, verb=verb, params={"ranks": ranks, "reason": reason}))
    desk.requests[rid] = (verb, reply, [])
    log.warning("controller: %s of ranks %s requested by itself (%s)%s", verb, ranks, reason,
                "" if reply is None else f": code {reply.code} {reply.detail}")
    if reply is None:
        return True, f"{verb} under way (request {rid})"
    return reply.code == DONE, f"code {reply.code}: {reply.detail} (request {rid})"


# ---------------------------------------------------------------------- status
def _recovery(rec: Dict[str, Any]) -> Dict[str, Any]:
    """One in-place recovery with its phase seconds (controller clock)."""
    marks = [("detect", "evidence_at", "stop_at"), ("observe", "stop_at", "abort_at"),
             ("abort", "abort_at", "retry_at"), ("recover", "retry_at", "done_at")]
    seconds = {name: round(rec[b] - rec[a], 6) for name, a, b in marks
               if rec.get(a) is not None and rec.get(b) is not None}
    if rec.get("done_at") is not None:
        seconds["total"] = round(rec["done_at"] - rec["evidence_at"], 6)
    return {"iteration": rec["iteration"], "kind": rec["kind"], "mode": rec.get("mode"), "rank": rec["rank"],
            "done": rec.get("done_at") is not None, "phase_seconds": seconds}


def status(ctl: "Controller", now: float) -> Dict[str, Any]:
    """The job's status as the controller sees it (JSON-able; ``mindspeed-ha status``)."""
    st, cfg = ctl.state, ctl.config
    ranks, by_state = [], {k: [] for k in snapshot.RANK_STATES}
    for r in range(st.world_size):
        info, state = st.ranks.get(r), snapshot.rank_state_of(st, r, now, cfg.heartbeat_timeout_s)
        by_state[state].append(r)
        row: Dict[str, Any] = {"rank": r, "state": state}
        if info is not None:
            row.update(iteration=info.iteration, optimizer=info.status.value, step=info.step, pid=info.pid,
                       host=info.host, heartbeat_age_s=round(now - info.last_heartbeat, 3),
                       incarnation=info.incarnation)
            if info.dead_reason:
                row["dead_reason"] = info.dead_reason
        ranks.append(row)
    term = getattr(getattr(ctl.leadership, "term", None), "term", None)
    features = [name for name, on in (("ha", cfg.enabled), ("replica", cfg.replica_count > 1 and not cfg.no_replica),
                                      ("hbm_repair", cfg.hbm_repair), ("worker_reboot", cfg.worker_reboot),
                                      ("distributed_optimizer", cfg.distributed_optimizer),
                                      ("controller_failover", ctl.lease is not None)) if on]
    pause = None
    if st.pause is not None or st.phase in (Phase.PAUSING, Phase.PAUSED):
        pause = {"iteration": st.drain_until, "since_s": round(now - st.phase_since, 3),
                 "max_s": st.pause.max_s if st.pause is not None else 0.0}
    return {
        "phase": st.phase.value, "phase_since_s": round(now - st.phase_since, 3), "term": term,
        "world_size": st.world_size, "run_id": st.run_id, "ranks": ranks, "by_state": by_state,
        "recoveries": [_recovery(r) for r in st.recoveries[-STATUS_RECOVERIES:]],
        "restarts": [dict(r) for r in ctl.arbiter.restarts][-STATUS_RECOVERIES:],
        "spares": switch_desk.spares_listed(ctl), "features": features, "pause": pause,
        "pauses": ctl.operators.pauses[-5:],
        "pause_tasks": ctl.operators.tasks.done,
        "switches": ctl.operators.switches.status(), "switching": ctl.operators.switches.busy_ranks(),
        "stop_requested": st.stop_request.reason if st.stop_request is not None else None,
        "exit_code": st.exit_code, "exit_reason": st.exit_reason,
        "subhealth": ctl.subhealth.snapshot() if ctl.subhealth is not None else None,
    }


__all__ = ["DONE", "FAILED", "REFUSED", "OperatorDesk", "VERBS", "internal_request", "status"]
