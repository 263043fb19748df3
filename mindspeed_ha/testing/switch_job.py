"""A tiny 4-rank job (the built-in trainer, ``mindspeed-ha-run``, gloo) that meets a schedule
of hot switches, driven through the operator channel: ``tests/test_switch_job.py`` and
``scripts/bench_switch.py``.

Schedule entries: ``"R"`` switches rank R (expects code 0); ``"node"`` switches every rank
of the job's one host (``switch --node HOST``); ``"kill:R"`` switches rank R and
SIGKILLs its new process as soon as the agent reports its pid (expects code 1: abandoned
before the commit point, training goes on on the old ranks); ``"detector:R"`` sends no
request: it releases the holds after iteration 1 (the release file
``MINDSPEED_HA_INJECT_RELEASE``, always set to ``<workdir>/release``: the job's
``fault=hold`` waits for it, :func:`mindspeed_ha.testing.injector.release`) and waits for the
switch of rank R that the controller asked itself (the sub-health detector's ``switch``
action), then takes the metrics (``--ha-metrics-port``); ``"detector:R@H"``: the same, the
holds up to H released once the job is pausing for that switch (a hold of rank R's first
process after H keeps the job from training on while the new process starts, once it has
trained to H). ``"R@H"``, ``"node@H"``, ``"kill:R@H"``: the same switch at a fixed iteration:
asked once every rank has completed iteration H (a ``fault=hold`` after H in the job's
environment keeps it there, see :func:`holds`), the holds up to H released once the job is
pausing for it (or the switch ended), so that the new processes' start-up costs no
iterations. Between entries the driver waits for a warm spare to be parked again (not after
the last) and for two more iterations (after an entry ``@H``: until iteration H + 3, so the
next entry's hold comes at H + 3 or later); then it releases every hold (a hold of the job
after its last entry keeps it from ending before that wait).
Synchronisation is on the job's observable state (``status``, files), never on time.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

from mindspeed_ha import env as ha_env
from mindspeed_ha.control import operator
from mindspeed_ha.testing.injector import release as release_holds
from mindspeed_ha.testing.harness import TRAINER_MODULE, end_run, free_port, launcher_command, losses_from_log, \
    read_loss_log, tiny_gpt_args

#: long enough for three switches on two loaded cores (the job then trains to the end)
TRAIN_ITERS = 400
#: seconds between two ``status`` requests while waiting for a state (each request is a new
#: operator connection: a tight loop would meet the controller's per-peer budgets and burn
#: the CPU the job needs; the wait is a poll interval, the condition is the job's state)
POLL_S = 0.25


@dataclasses.dataclass
class SwitchRun:
    """What a scheduled run gave."""

    returncode: Optional[int]
    replies: List[Dict[str, Any]]
    pids_before: List[int]
    pids_after: List[int]
    #: every rank's PID after each schedule entry (training went on two iterations after it)
    pids_each: List[List[int]]
    losses: Dict[int, str]
    grad_norms: Dict[int, Any]
    output: str
    events: List[Dict[str, Any]]
    #: the metrics (``(name, sorted labels) -> value``) a ``"detector:R"`` entry took, else empty
    metrics: Dict[Any, float] = dataclasses.field(default_factory=dict)


def job_args(loss_log: str, train_iters: int = TRAIN_ITERS, extra: Sequence[str] = ()) -> List[str]:
    """The training arguments: the tiny GPT (TP1 PP1 DP4) with HA and worker reboot on."""
    return [*tiny_gpt_args(train_iters=train_iters), "--enable-high-availability", "--enable-worker-reboot",
            "--loss-log", loss_log, *extra]


class Operator:
    """The operator channel of a running job (``job``: its launcher, whose end stops a wait)."""

    def __init__(self, port: int, key: bytes, job: subprocess.Popen):
        self.target, self.key, self.job = operator.Target("127.0.0.1", port), key, job
        self.pause = threading.Event()  # never set: its wait() is the poll interval

    def __call__(self, verb: str, **kw) -> operator.wire.OperatorReply:
        kw.setdefault("timeout_s", 600.0)
        return operator.request(verb, key=self.key, target=self.target, env={}, **kw)

    def status_until(self, cond, what: str) -> Dict[str, Any]:
        last = None
        while True:
            if self.job.poll() is not None:
                raise RuntimeError(f"the job ended ({self.job.returncode}) while waiting for {what}; last status: "
                                   f"{last}")
            try:
                reply = self("status", timeout_s=30.0)
            except operator.OperatorError as exc:
                if exc.code == operator.EXIT_UNREACHABLE:  # not listening yet
                    self.pause.wait(POLL_S)
                    continue
                raise
            last = reply.result
            if reply.code == 0 and cond(reply.result):
                return reply.result
            self.pause.wait(POLL_S)


def _iterations(s: Dict[str, Any]) -> List[int]:
    return [r.get("iteration", -1) for r in s["ranks"]]


def _ready_for_next(s: Dict[str, Any], after: int, spare: bool = True) -> bool:
    return (s["phase"] == "running" and (bool(s.get("spares")) or not spare)
            and len(s["by_state"]["healthy"]) == len(s["ranks"]) and not s.get("switching")
            and min(_iterations(s)) >= after)


def holds(rank: int, iterations: Sequence[int], incarnations: Sequence[int] = (0, 1, 2)) -> str:
    """``MINDSPEED_HA_INJECT`` specs: ``rank`` holds after each of ``iterations`` (``fault=hold``
    at ``between``), in whichever of its processes ``incarnations`` runs then (a switch
    gives the rank a new incarnation)."""
    return ";".join(f"rank={rank},iteration={k},point=between,fault=hold,incarnation={n}"
                    for k in iterations for n in incarnations)


def _switch_killing_the_spare(op: Operator, rank: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.setdefault("reply", op("switch", params={"ranks": [rank]})), daemon=True)
    t.start()
    s = op.status_until(lambda s: s["switches"] and s["switches"][-1]["phase"] in ("starting", "ready", "pausing")
                        and str(rank) in s["switches"][-1]["started"], f"the new process of rank {rank}")
    pid = s["switches"][-1]["started"][str(rank)]
    os.kill(pid, signal.SIGKILL)
    t.join()
    return {"killed_pid": pid, **_reply(out["reply"])}


def _switch_by_the_controller(op: Operator, rank: int, release: str, held: Optional[int] = None) -> Dict[str, Any]:
    release_holds(release, 1)
    ended = ("done", "aborted", "failed")

    def over(s):
        return any(w["ranks"] == [rank] and w["phase"] in ended for w in s["switches"])

    if held is not None:  # the job holds after ``held`` (at the latest) while the new process starts
        op.status_until(lambda s: s["phase"] in ("pausing", "paused") or over(s),
                        f"the pause of the controller's own switch of rank {rank}")
        release_holds(release, held)
    s = op.status_until(over, f"the controller's own switch of rank {rank}")
    sw = [w for w in s["switches"] if w["ranks"] == [rank] and w["phase"] in ended][-1]
    return {"code": 0 if sw["phase"] == "done" else 1, "detail": sw["reason"], "result": sw}


def _metrics(events_file: str) -> Dict[Any, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    url = [e for e in read_loss_log(events_file) if e["type"] == "ControllerStarted"][-1]["detail"]["metrics_url"]
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return {(m.name, tuple(sorted(m.labels.items()))): m.value
                for f in text_string_to_metric_families(resp.read().decode()) for m in f.samples}


def switch_while_held(op: Operator, rank: int, release: str, ready: Callable[[Dict[str, Any]], bool],
                      at_hold: Optional[Callable[[], None]] = None, through: Optional[int] = None) -> Dict[str, Any]:
    """Wait until ``ready(status)`` (the job held by a ``fault=hold``), call ``at_hold``, ask
    the switch of ``rank``, release the holds up to ``through`` (every one: None) once the job
    is pausing for it (or the switch ended; whatever happens), and return the reply (code,
    detail, result)."""
    return _while_held(op, release, through, ready, lambda: _reply(op("switch", params={"ranks": [rank]})),
                       f"the job held, the spare for rank {rank} parked", at_hold)


def _while_held(op: Operator, release: str, through: Optional[int], ready: Callable[[Dict[str, Any]], bool],
                ask: Callable[[], Dict[str, Any]], what: str,
                at_hold: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    op.status_until(ready, what)
    if at_hold is not None:
        at_hold()
    out: Dict[str, Any] = {}

    def asking():
        try:
            out["reply"] = ask()
        except BaseException as exc:  # noqa: BLE001 - raised below, on the driver's thread
            out["reply"] = exc

    t = threading.Thread(target=asking, daemon=True)
    t.start()
    try:
        op.status_until(lambda s: s["phase"] in ("pausing", "paused") or "reply" in out, "the switch's pause")
    finally:
        release_holds(release, through)
    t.join()
    if isinstance(out["reply"], BaseException):
        raise out["reply"]
    return out["reply"]


def _reply(r) -> Dict[str, Any]:
    return {"code": r.code, "detail": r.detail, "result": r.result}


def run(workdir: str, schedule: Sequence[str], train_iters: int = TRAIN_ITERS, extra_args: Sequence[str] = (),
        env: Optional[Dict[str, str]] = None, timeout_s: float = 900.0) -> SwitchRun:
    """One job meeting ``schedule`` (see the module doc); returns when it ended."""
    key = secrets.token_bytes(32)
    port, loss_log = free_port(), os.path.join(workdir, "loss.jsonl")
    run_env = dict(os.environ, OMP_NUM_THREADS="1", **{
        ha_env.TTP_PORT: str(port), ha_env.AUTH_KEY: key.hex(), ha_env.WARM_SPARES: "1"}, **(env or {}))
    release = run_env[ha_env.INJECT_RELEASE] = os.path.join(workdir, "release")
    metrics: Dict[Any, float] = {}
    events_file = os.path.join(workdir, "events.jsonl")
    cmd = [*launcher_command(4), "--log-dir", os.path.join(workdir, "torchrun"), "-m", TRAINER_MODULE,
           *job_args(loss_log, train_iters, extra_args), "--ha-events-file", events_file]
    out_path = os.path.join(workdir, "job.out")
    replies: List[Dict[str, Any]] = []
    with open(out_path, "w") as out:
        job = subprocess.Popen(cmd, env=run_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        op = Operator(port, key, job)
        # a "detector:R" schedule's job holds after iteration 1 until that entry releases it
        first = 1 if schedule and schedule[0].startswith("detector:") else 2
        s = op.status_until(lambda s: _ready_for_next(s, first), "every rank training, a warm spare parked")
        pids_before, pids_each = [r["pid"] for r in s["ranks"]], []
        for i, entry in enumerate(schedule):
            body, _, held = entry.partition("@")
            if body.startswith("detector:"):
                replies.append(dict(entry=entry, **_switch_by_the_controller(
                    op, int(body[9:]), release, int(held) if held else None)))
                metrics.update(_metrics(events_file))  # training goes on: the controller still serves them
                ask = None
            elif body.startswith("kill:"):
                ask = lambda r=int(body[5:]): _switch_killing_the_spare(op, r)  # noqa: E731
            elif body == "node":
                ask = lambda h=s["ranks"][0]["host"]: _reply(op("switch", params={"node": h}))  # noqa: E731
            else:
                ask = lambda r=int(body): _reply(op("switch", params={"ranks": [r]}))  # noqa: E731
            if ask is not None and held:
                replies.append(dict(entry=entry, **_while_held(
                    op, release, int(held), lambda s, k=int(held): _ready_for_next(s, k), ask,
                    f"the job held after iteration {held}, a warm spare parked")))
            elif ask is not None:
                replies.append(dict(entry=entry, **ask()))
            # two more iterations: after the pause that followed the hold at the latest
            after = int(held) + 3 if held else max(_iterations(op("status", timeout_s=30.0).result)) + 2
            last = i == len(schedule) - 1  # no spare needed after the last entry
            s = op.status_until(lambda s: _ready_for_next(s, after, spare=not last), f"training after {entry!r}")
            pids_each.append([r["pid"] for r in s["ranks"]])
        pids_after = [r["pid"] for r in s["ranks"]]
        release_holds(release)  # every hold: the job trains to its end
        rc: Optional[int] = job.wait(timeout=timeout_s)
    finally:
        if os.path.exists(release):
            os.unlink(release)
        if job.poll() is None:  # the launcher and every process under it (workers have sessions of their own)
            end_run(job.pid)
            job.wait()
    with open(out_path) as f:
        output = f.read()
    records = read_loss_log(loss_log)
    events = read_loss_log(events_file)  # JSON lines too
    return SwitchRun(rc, replies, pids_before, pids_after, pids_each, losses_from_log(loss_log),
                     {int(r["iteration"]): r["grad_norm"] for r in records}, output, events, metrics)


def baseline(workdir: str, train_iters: int = TRAIN_ITERS, extra_args: Sequence[str] = (),
             timeout_s: float = 600.0):
    """The same job without switches (same seed): a :class:`~mindspeed_ha.testing.harness.RunResult`."""
    from mindspeed_ha.testing.harness import launch

    loss_log = os.path.join(workdir, "baseline.jsonl")
    args = job_args(loss_log, train_iters, extra_args)
    i = args.index("--loss-log")
    return launch(4, args[:i] + args[i + 2:], launcher=launcher_command(4), loss_log=loss_log, timeout_s=timeout_s,
                  env={ha_env.TTP_PORT: str(free_port())})


__all__ = ["Operator", "SwitchRun", "TRAIN_ITERS", "baseline", "holds", "job_args", "run", "switch_while_held"]


if __name__ == "__main__":  # pragma: no cover - a manual run
    import json
    import tempfile

    d = tempfile.mkdtemp(prefix="mindspeed_ha_switch_")  # kept: the logs are there
    r = run(d, sys.argv[1:] or ["1", "0", "kill:2"])
    print(d)
    print(json.dumps(dataclasses.asdict(r) | {"output": r.output[-3000:]}, indent=1, default=str))
