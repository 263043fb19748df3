"""Pause tasks: work the ranks run on their training threads while the job holds in a
graceful pause (``mindspeed-ha check``, ``mindspeed-ha relink``).

One mechanism for both (and for what comes next): the operator's verb (or an internal
request, e.g. a sub-health detector through ``OperatorDesk.handle(ctl, now, None, request)``)
records a :class:`Task`; a RUNNING job is paused first (the operator's graceful pause,
:mod:`.policy.pause`), a PAUSED one is used as it is. Once every rank holds at K the
controller sends PAUSE_TASK(task_id, kind, params, budget_s) to every live rank
(:mod:`.wire`: versioned msgpack, HMAC, size-limited; never pickled); each rank's
I/O thread hands it to its training thread, which runs it at its pause point
(``runtime/pause_tasks.py``) and answers PAUSE_TASK_RESULT. While a task runs the pause
holds (``PauseRequest.task``: ``resume`` and ``--max`` wait; a fault or a stop do not).
When every rank answered, or ``budget_s`` + ``heartbeat_timeout_s`` passed, the verdict
(:mod:`.policy.pause_task`, pure) is the operator's reply, an event (``CheckFinished``,
``RelinkFinished``) and its metrics; then the job

* stays paused when a rank did not answer within the budget (it may still be inside the
  task, in its collectives: resuming the others under it could pair their training
  collectives with its check's); the operator stops or resumes;
* else resumes if the task paused it (default: the job is left as the operator found it, so
  ``mindspeed-ha check`` on a running job is pause, check, resume in one command);
  ``stay`` (``--stay-paused``) keeps it paused, the operator ends it with ``resume``;
* a check with code 2 and ``on_fault`` ``exit``: the graceful stop of a paused job (the
  checkpoint of K, exit 75); ``switch``: :func:`switch_hook` (the hot switch; not
  available yet: logged); ``report`` (default): nothing more.

A job that leaves the pause while a task is pending (a fault: the dying checkpoint) ends
the task: code 1 (not run) for the ranks without a result.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from mindspeed_ha.control import job_events, wire
from mindspeed_ha.control.policy import pause_task as verdicts
from mindspeed_ha.control.state import Phase

if TYPE_CHECKING:
    from mindspeed_ha.control.controller import Controller

log = logging.getLogger("mindspeed_ha.control.controller")

#: the longest budget accepted, seconds
MAX_BUDGET_S = 3600.0
DEFAULT_BUDGET_S = 60.0
ON_FAULT = ("report", "exit", "switch")
#: finished tasks kept for ``status``
KEEP_DONE = 5


@dataclasses.dataclass
class Task:
    """One pause task: the request, where it stands, the ranks' results."""

    request_id: str
    kind: str
    params: Dict[str, Any]
    targets: List[int]
    budget_s: float
    resume_after: bool
    asked_at: float
    task_id: int = 0
    sent_at: Optional[float] = None
    sent_to: List[int] = dataclasses.field(default_factory=list)
    results: Dict[int, wire.PauseTaskResult] = dataclasses.field(default_factory=dict)


def switch_hook(ctl: "Controller", ranks: Sequence[int], why: str) -> str:
    """A fault found by a check, with ``--on-fault switch``: the hot switch of ``ranks``
    (:mod:`.switch_desk`), raised by the controller itself once the job runs again (a switch
    needs a running job; refused like an operator's without worker reboot or a spare, see
    the events). Returns what happens, in words."""
    ctl.operators.deferred.append(("switch", [int(r) for r in ranks], f"check found {why}"))
    log.warning("controller: check found %s on ranks %s: their hot switch is requested once training runs again",
                why, list(ranks))
    return f"hot switch of ranks {list(ranks)} requested once training runs again"


def _ranks(params: Dict[str, Any], world: int, name: str = "ranks") -> List[int]:
    raw = params.get(name)
    if raw in (None, []):
        return list(range(world))
    if not isinstance(raw, (list, tuple)) or not all(isinstance(r, int) and 0 <= r < world for r in raw):
        raise ValueError(f"--{name} {raw!r}: global ranks in 0..{world - 1}")
    return sorted(set(int(r) for r in raw))


def validate(kind: str, params: Dict[str, Any], world: int) -> Tuple[List[int], float, Dict[str, Any]]:
    """(targets, budget_s, params for the ranks) of a ``check`` / ``relink`` request.

    Raises:
        ValueError: naming the flag and its accepted range.
    """
    budget = params.get("budget_s", DEFAULT_BUDGET_S)
    if not isinstance(budget, (int, float)) or not (math.isfinite(budget) and 0 < budget <= MAX_BUDGET_S):
        raise ValueError(f"--budget {budget!r}: accepted range (0, {MAX_BUDGET_S:g}] seconds")
    targets = _ranks(params, world)
    if kind == "check":
        tests = params.get("tests") or list(verdicts.CHECK_TESTS)
        if not isinstance(tests, (list, tuple)) or not tests or any(t not in verdicts.CHECK_TESTS for t in tests):
            raise ValueError(f"--test {tests!r}: a comma-separated subset of {','.join(verdicts.CHECK_TESTS)}")
        on_fault = params.get("on_fault", "report")
        if on_fault not in ON_FAULT:
            raise ValueError(f"--on-fault {on_fault!r}: one of {', '.join(ON_FAULT)}")
        return targets, float(budget), {"ranks": targets, "tests": [t for t in verdicts.CHECK_TESTS if t in tests],
                                        "on_fault": on_fault}
    back = bool(params.get("back", False))
    addr, iface = str(params.get("addr") or ""), str(params.get("iface") or "")
    if "ranks" not in params or not params["ranks"]:
        raise ValueError("--ranks: relink needs the ranks to move")
    if back == bool(addr or iface) or (addr and iface):
        raise ValueError("relink: give one of --addr A, --iface I, --back")
    if len(addr) > 255 or len(iface) > 64:
        raise ValueError("--addr / --iface: too long")
    return targets, float(budget), {"ranks": targets, "addr": addr, "iface": iface, "back": back}


class PauseTasks:
    """The controller's pause tasks: one at a time (owned by the controller thread, under its lock)."""

    def __init__(self) -> None:
        self.current: Optional[Task] = None
        #: the last :data:`KEEP_DONE` finished tasks (kind, code, detail, seconds), for ``status``
        self.done: List[Dict[str, Any]] = []
        self._next_id = int(time.time() * 1000) % 10**12  # distinct across controllers: names group generations

    def submit(self, ctl: "Controller", now: float, body: wire.OperatorRequest,
               ask_pause: Callable[[], Optional[str]]) -> Optional[wire.OperatorReply]:
        """A ``check`` / ``relink`` request: a refusal (code 4) now, or None (answered by :meth:`settle`).
        ``ask_pause()``: the operator's pause of a RUNNING job (a refusal's reason, or None)."""
        st = ctl.state
        raw = dict(body.params)
        node = raw.pop("node", None)
        if node is not None:  # --node HOST: the ranks whose processes registered from that host
            on = sorted(r for r, i in st.ranks.items() if i.host == node)
            if not on or raw.get("ranks"):
                return wire.OperatorReply(body.request_id, 4, f"--node {node!r}: " + (
                    "give --ranks or --node, not both" if on else
                    f"no rank registered from it (hosts: {sorted({i.host for i in st.ranks.values()})})"))
            raw["ranks"] = on
        try:
            targets, budget, params = validate(body.verb, raw, st.world_size)
        except ValueError as exc:
            return wire.OperatorReply(body.request_id, 4, str(exc))
        if self.current is not None:
            return wire.OperatorReply(body.request_id, 4, f"a {self.current.kind} is under way "
                                      f"(request {self.current.request_id})")
        stay = bool(body.params.get("stay", False))
        if st.phase is Phase.RUNNING:
            refused = ask_pause()
            if refused:
                return wire.OperatorReply(body.request_id, 4, refused)
            resume_after = not stay
        elif st.phase in (Phase.PAUSING, Phase.PAUSED) and st.stop_request is None:
            resume_after = False  # paused by someone else: it stays paused
        else:
            return wire.OperatorReply(body.request_id, 4, f"the job is {st.phase.value}: a {body.verb} needs a "
                                      "running or paused job")
        self._next_id += 1
        if body.verb == "relink":  # the groups' generation (a failed one switches back with generation + 1)
            params["generation"] = 2 * self._next_id
        self.current = Task(body.request_id, body.verb, params, targets, budget, resume_after, now, self._next_id)
        log.warning("operator: %s of ranks %s requested (budget %.0f s)%s", body.verb, targets, budget,
                    "" if st.phase is not Phase.RUNNING else ": pausing the job first")
        return None

    def on_result(self, ctl: "Controller", now: float, rank: int, body: wire.PauseTaskResult) -> None:
        """PAUSE_TASK_RESULT from ``rank`` (a late one, of an earlier task, is ignored)."""
        task = self.current
        if task is None or task.task_id != body.task_id or task.sent_at is None:
            log.info("controller: pause task result #%d from rank %d ignored (no such task pending)",
                     body.task_id, rank)
            return
        task.results[rank] = body

    def settle(self, ctl: "Controller", now: float) -> List[wire.OperatorReply]:
        """After the decision step: send the pending task once PAUSED, finish it once every
        rank answered or its budget passed; returns the replies to send."""
        task, st = self.current, ctl.state
        if task is None:
            return []
        if task.sent_at is None:
            if st.phase is Phase.PAUSED and st.pause is not None:
                task.sent_to = st.alive_ranks()
                task.sent_at = now
                st.pause.task = task.kind
                sent = ctl.server.send_to_ranks(task.sent_to, wire.PauseTask(task.task_id, task.kind, task.params,
                                                                             task.budget_s))
                log.warning("controller: pause task %s #%d sent to %d ranks (paused after iteration %s)", task.kind,
                            task.task_id, sent, st.drain_until)
                return []
            if st.phase is Phase.PAUSING:
                return []
            return [self._finish(ctl, now, f"not run: the pause did not come (job {st.phase.value})")]
        answered = set(task.results)
        if answered >= set(task.sent_to):
            return [self._finish(ctl, now, None)]
        if st.phase is not Phase.PAUSED:
            return [self._finish(ctl, now, f"the job left the pause ({st.phase.value}) during the {task.kind}")]
        if now - task.sent_at > task.budget_s + ctl.config.heartbeat_timeout_s:
            return [self._finish(ctl, now, None, missing=sorted(set(task.sent_to) - answered))]
        return []

    def _finish(self, ctl: "Controller", now: float, why: Optional[str],
                missing: Sequence[int] = ()) -> wire.OperatorReply:
        task, st = self.current, ctl.state
        assert task is not None
        self.current = None
        if st.pause is not None:
            st.pause.task = ""
        results = {r: (b.code, b.detail, b.result) for r, b in task.results.items()}
        if task.kind == "check":
            layouts = {r: i.layout for r, i in st.ranks.items()}
            v = verdicts.check_verdict(results, layouts, task.targets, missing)
        else:
            v = verdicts.relink_verdict(results, task.targets, task.sent_to or task.targets, missing)
        if why is not None and v.code != verdicts.FAULT:
            v = verdicts.Verdict(verdicts.NOT_RUN if not missing else v.code, f"{why}; {v.detail}", v.ranks)
        seconds = round(now - (task.sent_at if task.sent_at is not None else now), 6)
        held = st.phase is Phase.PAUSED
        after = self._after(ctl, now, task, v, missing) if held else f"job {st.phase.value}"
        result = {"kind": task.kind, "task_id": task.task_id, "iteration": st.drain_until, "seconds": seconds,
                  "pause_seconds": round(now - task.asked_at, 6), "after": after, **v.to_result()}
        self.done = (self.done + [{k: result[k] for k in ("kind", "task_id", "code", "faulty", "iteration",
                                                              "seconds", "after")}])[-KEEP_DONE:]
        job_events.note(ctl.recorder, "CheckFinished" if task.kind == "check" else "RelinkFinished",
                        st.drain_until, ranks=v.faulty or task.targets, reason=v.detail,
                        phase_seconds={task.kind: seconds}, severity="Warning" if v.code else None,
                        code=v.code, after=after, targets=task.targets)
        log.warning("controller: %s #%d: code %d (%s); %s", task.kind, task.task_id, v.code, v.detail, after)
        return wire.OperatorReply(task.request_id, 0 if v.code == verdicts.OK else 1, v.detail, result)

    def _after(self, ctl: "Controller", now: float, task: Task, v: verdicts.Verdict, missing: Sequence[int]) -> str:
        """What the job does next (see the module doc); returns it in words."""
        st = ctl.state
        if missing:  # a rank may still be inside the task (its collectives): never resume under it
            return (f"stays paused: ranks {list(missing)} did not answer within the budget (stop, or resume once "
                    "they are known to be out of the task)")
        if task.kind == "check" and v.code == verdicts.FAULT:
            on_fault = task.params.get("on_fault", "report")
            if on_fault == "exit" and st.request_stop(now, -1, f"check found a fault on ranks {v.faulty}"):
                return f"graceful stop: checkpoint of iteration {st.drain_until}, exit 75"
            if on_fault == "switch":
                switched = switch_hook(ctl, v.faulty, "a fault")
                if task.resume_after and st.pause is not None:
                    st.pause.resume_at = now
                    return f"{switched}; resumed"
                return f"{switched}; stays paused"
        if task.resume_after and st.pause is not None:
            st.pause.resume_at = now
            return "resumed"
        return "stays paused"


__all__ = ["DEFAULT_BUDGET_S", "MAX_BUDGET_S", "ON_FAULT", "PauseTasks", "Task", "switch_hook", "validate"]
