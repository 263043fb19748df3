"""A tiny 4-rank job (the built-in trainer, ``mindspeed-ha-run``, gloo) that meets a schedule
of hot switches, driven through the operator channel: ``tests/test_switch_job.py`` and
``scripts/bench_switch.py``.

Schedule entries: ``"R"`` switches rank R (expects code 0); ``"node"`` switches every rank
of the job's one host (``switch --node HOST``); ``"kill:R"`` switches rank R and
SIGKILLs its new process as soon as the agent reports its pid (expects code 1: abandoned
before the commit point, training goes on on the old ranks); ``"detector:R"`` sends no
request: it creates the hold release file (``MINDSPEED_HA_INJECT_RELEASE``, always set to
``<workdir>/release``: the job's ``fault=hold`` waits for it) and waits for the switch of
rank R that the controller asked itself (the sub-health detector's ``switch`` action), then
removes the file again and takes the metrics (``--ha-metrics-port``); ``"held:R@H"`` waits until every rank has completed iteration H (a
``fault=hold`` after H keeps the job there), takes the metrics (``--ha-metrics-port``), asks
the switch of rank R and creates the release file once the job is pausing for it (or the
switch ended). Between entries the driver waits for a warm spare to be parked again and for
two more iterations. Synchronisation is on the job's observable state (``status``, files),
never on time.
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
    #: the metrics (``(name, sorted labels) -> value``) a ``"held:R@H"`` entry took, else empty
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


def _ready_for_next(s: Dict[str, Any], after: int) -> bool:
    return (s["phase"] == "running" and bool(s.get("spares")) and len(s["by_state"]["healthy"]) == len(s["ranks"])
            and not s.get("switching") and min(_iterations(s)) >= after)


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


def _switch_by_the_controller(op: Operator, rank: int, release: str) -> Dict[str, Any]:
    open(release, "w").close()
    ended = ("done", "aborted", "failed")
    s = op.status_until(lambda s: any(w["ranks"] == [rank] and w["phase"] in ended for w in s["switches"]),
                        f"the controller's own switch of rank {rank}")
    os.unlink(release)  # rank R's old process is past its hold: it handed over or went on
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
                      at_hold: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """Wait until ``ready(status)`` (the job held by a ``fault=hold``), call ``at_hold``, ask
    the switch of ``rank``, create ``release`` once the job is pausing for it (or the switch
    ended; whatever happens), and return the reply (code, detail, result)."""
    op.status_until(ready, f"the job held, the spare for rank {rank} parked")
    if at_hold is not None:
        at_hold()
    out: Dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.setdefault("reply", op("switch", params={"ranks": [rank]})), daemon=True)
    t.start()
    try:
        op.status_until(lambda s: s["phase"] in ("pausing", "paused") or "reply" in out, "the switch's pause")
    finally:
        open(release, "w").close()
    t.join()
    return _reply(out["reply"])


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
        for entry in schedule:
            if entry.startswith("detector:"):
                replies.append(dict(entry=entry, **_switch_by_the_controller(op, int(entry[9:]), release)))
                metrics.update(_metrics(events_file))  # training goes on: the controller still serves them
            elif entry.startswith("held:"):
                rank, _, held = entry[5:].partition("@")
                replies.append(dict(entry=entry, **switch_while_held(
                    op, int(rank), release, lambda s, k=int(held): _ready_for_next(s, k),
                    lambda: metrics.update(_metrics(events_file)))))
            elif entry.startswith("kill:"):
                replies.append(dict(entry=entry, **_switch_killing_the_spare(op, int(entry[5:]))))
            elif entry == "node":
                replies.append(dict(entry=entry, **_reply(op("switch", params={"node": s["ranks"][0]["host"]}))))
            else:
                replies.append(dict(entry=entry, **_reply(op("switch", params={"ranks": [int(entry)]}))))
            after = max(_iterations(op("status", timeout_s=30.0).result)) + 2
            s = op.status_until(lambda s: _ready_for_next(s, after), f"training after {entry!r}")
            pids_each.append([r["pid"] for r in s["ranks"]])
        pids_after = [r["pid"] for r in s["ranks"]]
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


__all__ = ["Operator", "SwitchRun", "TRAIN_ITERS", "baseline", "job_args", "run", "switch_while_held"]


if __name__ == "__main__":  # pragma: no cover - a manual run
    import json
    import tempfile

    d = tempfile.mkdtemp(prefix="mindspeed_ha_switch_")  # kept: the logs are there
    r = run(d, sys.argv[1:] or ["1", "0", "kill:2"])
    print(d)
    print(json.dumps(dataclasses.asdict(r) | {"output": r.output[-3000:]}, indent=1, default=str))
