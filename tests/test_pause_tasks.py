"""Pause tasks (``mindspeed-ha check | relink``): one mechanism, tested with an in-process
controller and 4 processors whose training threads run a scripted task at their pause point.

The job is left as the operator found it (a running one: pause, task, resume; a paused one
stays paused), the task runs on the training thread (never the I/O thread), codes 0 / 1 / 2
/ 3 reach the operator with per-rank details, ``--on-fault exit`` is the graceful stop of
the paused iteration (75), a budget overrun is 3 naming the silent rank, refusals are 4.
The verdicts (pure) and the rank side (GEMM, memory, the injector's bit flip, the link
switch's pre-flight and switch-back on a 1-rank gloo world) are tested directly.
"""

import hashlib
import json
import os
import subprocess
import sys
import threading

import pytest

from mindspeed_ha import cli
from mindspeed_ha.control import operator, wire
from mindspeed_ha.control.operator_desk import REFUSED
from mindspeed_ha.control.policy import pause_task as verdicts
from mindspeed_ha.control.state import Layout, Phase
from mindspeed_ha.faults import EXIT_DYING_CHECKPOINT_SAVED
from mindspeed_ha.faultspec import FaultSpec

from test_control import KEY, WORLD, _wait_for, closing, job, no_leaks  # noqa: F401 (fixtures)
from test_operator import _ask, _running


def _scripted(j, closing, digest=lambda r: "d", block=None, code=lambda r: 0):
    """Every processor's pause-task hook: a check result with GEMM digest ``digest(rank)``;
    ``block``: (rank, event) whose task waits for the event. Records the thread it ran on."""
    seen, release = {}, threading.Event()
    closing.callback(release.set)

    def make(rank):
        def run(task):
            seen[rank] = (threading.current_thread().name, task)
            if block is not None and block == rank:
                release.wait(30)
            res = {"tests": {"gemm": {"code": 0, "digest": digest(rank), "seconds": 0.01}}, "state_unchanged": True}
            if task.kind == "relink":
                res = {"bound": {"addr": task.params["addr"]} if rank in task.params["ranks"] else None}
            return wire.PauseTaskResult(task.task_id, -1, code(rank), "", res)
        return run

    for r, p in enumerate(j.procs):
        p.set_recovery_hooks(lambda _: None, RuntimeError, lambda _: None, pause_task=make(r))
    return seen


def _check(j, **params):
    params.setdefault("budget_s", 10.0)
    return _ask(j, "check", params=params, timeout_s=30.0)


def test_check_on_a_running_job_pauses_runs_on_the_training_threads_and_resumes(job, closing):
    from prometheus_client import generate_latest

    from mindspeed_ha.control.metrics import JobMetrics

    j = job()
    metrics = JobMetrics(j.ctl.status)
    j.ctl.recorder.add_sink(metrics)
    _running(j, closing)
    seen = _scripted(j, closing)
    _wait_for(lambda: all(i.iteration >= 2 for i in j.ctl.state.ranks.values()), what="iteration 2")
    reply = _check(j, ranks=[1, 2], tests=["gemm", "memory"])
    assert reply.code == 0, reply
    r = reply.result
    assert r["code"] == 0 and r["faulty"] == [] and sorted(r["ranks"]) == ["1", "2"] and r["after"] == "resumed"
    assert sorted(seen) == list(range(WORLD))  # every rank ran it (references for the replicas' comparison)
    assert all(not name.startswith("mindspeed-ha") for name, _ in seen.values())  # the training threads
    task = seen[0][1]
    assert task.params["ranks"] == [1, 2] and task.params["tests"] == ["gemm", "memory"] and task.budget_s == 10.0
    _wait_for(lambda: j.ctl.phase is Phase.RUNNING, what="resumed")
    k = r["iteration"]
    _wait_for(lambda: all(i.iteration > k for i in j.ctl.state.ranks.values()), what="training after the check")
    names = [e.name for e in j.ctl.recorder.events() if e.name in ("PauseRequested", "Paused", "CheckFinished",
                                                                    "Resumed")]
    assert names == ["PauseRequested", "Paused", "CheckFinished", "Resumed"], names
    assert _ask(j, "status").result["pause_tasks"][-1]["code"] == 0
    text = generate_latest(metrics.registry).decode()
    assert 'mindspeed_ha_pause_tasks_total{code="0",kind="check"} 1.0' in text, text


def test_a_flipped_gemm_bit_is_code_2_naming_the_rank_and_on_fault_exit_stops_with_the_checkpoint(job, closing):
    j = job()
    _running(j, closing)
    _scripted(j, closing, digest=lambda r: "bad" if r == 1 else "good")
    reply = _check(j, tests=["gemm"])
    assert reply.code == 1 and reply.result["code"] == 2 and reply.result["faulty"] == [1], reply
    assert "rank 1" in reply.detail and "differs bitwise" in reply.detail
    _wait_for(lambda: j.ctl.phase is Phase.RUNNING, what="report only: resumed")
    reply = _check(j, tests=["gemm"], on_fault="switch")  # the hot switch, raised once the job runs again
    assert reply.result["faulty"] == [1] and reply.result["after"] == (
        "hot switch of ranks [1] requested once training runs again; resumed"), reply
    _wait_for(lambda: j.ctl.phase is Phase.RUNNING and not j.ctl.operators.deferred, what="switch: resumed, raised")
    (verb, switch, _), = [v for k, v in j.ctl.operators.requests.items() if k.startswith("internal-")]
    assert verb == "switch" and switch.code == 4 and "--enable-worker-reboot" in switch.detail, switch  # this job has none
    reply = _check(j, tests=["gemm"], on_fault="exit")
    assert reply.result["faulty"] == [1] and "graceful stop" in reply.result["after"], reply
    out = j.ctl.wait_done(20)
    assert out is not None and out.exit_code == EXIT_DYING_CHECKPOINT_SAVED and out.iteration == reply.result[
        "iteration"], out


def test_a_paused_job_stays_paused_resume_waits_and_a_silent_rank_is_a_timeout(job, closing):
    j = job()
    _running(j, closing)
    _scripted(j, closing, block=3)
    k = _ask(j, "pause").result["iteration"]
    got = {}
    t = threading.Thread(target=lambda: got.update(r=_check(j, budget_s=0.2)))
    t.start()
    closing.callback(t.join, 30)
    _wait_for(lambda: j.ctl.state.pause is not None and j.ctl.state.pause.task == "check", what="task sent")
    busy = _ask(j, "resume")
    assert busy.code == REFUSED and "under way" in busy.detail
    assert _check(j).code == REFUSED  # one task at a time
    t.join(30)
    r = got["r"].result
    assert r["code"] == 3 and r["ranks"]["3"]["code"] == 3 and r["ranks"]["0"]["code"] == 0, r
    assert r["after"].startswith("stays paused: ranks [3]") and j.ctl.phase is Phase.PAUSED and r["iteration"] == k
    assert _ask(j, "resume").code == 0


def test_relink_reply_and_refusals(job, closing):
    j = job()
    _running(j, closing)
    _scripted(j, closing)
    for bad in ({"ranks": [1]}, {"ranks": [1], "addr": "127.0.0.2", "back": True}, {"addr": "127.0.0.2"},
                {"ranks": [9], "addr": "127.0.0.2"}, {"ranks": [1], "addr": "a", "budget_s": 0}):
        r = _ask(j, "relink", params=bad)
        assert r.code == REFUSED and ("--" in r.detail or "relink" in r.detail), (bad, r)
    for bad in ({"tests": ["gemm", "nope"]}, {"on_fault": "reboot"}, {"budget_s": 1e9}, {"node": "elsewhere"},
                {"node": j.ctl.state.ranks[0].host, "ranks": [1]}):
        assert _check(j, **bad).code == REFUSED, bad
    assert j.ctl.phase is Phase.RUNNING  # nothing paused for a refusal
    r = _ask(j, "relink", params={"ranks": [1], "addr": "127.0.0.2"}, timeout_s=30.0)
    assert r.code == 0 and r.result["ranks"]["1"]["bound"] == {"addr": "127.0.0.2"}, r
    assert "rank 1 bound to {'addr': '127.0.0.2'}" in r.detail
    assert [e.name for e in j.ctl.recorder.events()].count("RelinkFinished") == 1


def test_an_internal_check_request_goes_through_the_verb_table(job, closing):
    """What the sub-health detector calls on the controller thread (operator_desk.internal_request,
    params {"ranks": [r]}): no operator connection; the verdict is kept under its request id."""
    from mindspeed_ha.control import operator_desk

    j = job()
    _running(j, closing)
    _scripted(j, closing, digest=lambda r: "x" if r == 2 else "y")
    with j.ctl._lock:
        ok, detail = operator_desk.internal_request(j.ctl, j.ctl.clock(), "check", [2], "test")
    assert ok and "under way" in detail, detail
    _wait_for(lambda: j.ctl.operators.requests["internal-1"][1] is not None, what="the internal check's verdict")
    reply = j.ctl.operators.requests["internal-1"][1]
    assert reply.result["code"] == 2 and reply.result["faulty"] == [2] and reply.result["after"] == "resumed"
    _wait_for(lambda: j.ctl.phase is Phase.RUNNING, what="resumed")
    with j.ctl._lock:  # the same through handle() without a connection
        j.ctl.operators.handle(j.ctl, j.ctl.clock(), None, wire.OperatorRequest("own-1", "check",
                                                                                params={"tests": ["gemm"]}))
    _wait_for(lambda: j.ctl.operators.requests["own-1"][1] is not None, what="the second verdict")
    assert j.ctl.operators.requests["own-1"][1].result["faulty"] == [2]


def test_cli_check_and_relink_usage_codes(job, closing, monkeypatch, capsys):
    j = job()
    _running(j, closing)
    _scripted(j, closing)
    monkeypatch.setenv("MINDSPEED_HA_AUTH_KEY", KEY.hex())
    addr = ["--addr", f"127.0.0.1:{j.ctl.port}"]
    assert cli.main(["check", "--json", "--test", "gemm", "--budget", "5", *addr]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["result"]["code"] == 0 and out["result"]["after"] == "resumed"
    _wait_for(lambda: j.ctl.phase is Phase.RUNNING, what="resumed after the CLI's check")
    assert cli.main(["check", "--json", "--test", "gemm", "--node", j.ctl.state.ranks[0].host, *addr]) == 0
    assert sorted(json.loads(capsys.readouterr().out)["result"]["ranks"]) == ["0", "1", "2", "3"]  # one host
    assert cli.main(["check", "--test", "gemm,nope", *addr]) == 2
    assert cli.main(["check", "--budget", "0", *addr]) == 2
    ctl = ["--controller", f"127.0.0.1:{j.ctl.port}"]
    assert cli.main(["relink", "--addr", "127.0.0.2", *ctl]) == 2  # no --ranks
    assert cli.main(["relink", "--ranks", "1", "--addr", "127.0.0.2", "--back", *ctl]) == 2
    _wait_for(lambda: j.ctl.phase is Phase.RUNNING, what="resumed after the CLI's check")
    assert cli.main(["relink", "--ranks", "1", "--addr", "127.0.0.2", *ctl]) == 0
    assert "rank 1: code 0 bound {'addr': '127.0.0.2'}" in capsys.readouterr().out


def test_a_task_for_a_rank_that_does_not_hold_is_not_run(job, closing):
    j = job()
    got = []
    p = j.procs[0]
    p.set_recovery_hooks(lambda _: None, RuntimeError, lambda _: None, pause_task=lambda t: got.append(t))
    p._proto.outbox.add_locked = lambda body: got.append(body)  # what the I/O thread would send
    p._proto.on_pause_task(wire.PauseTask(7, "check", {}, 1.0))
    assert len(got) == 1 and got[0].code == verdicts.NOT_RUN and "does not hold" in got[0].detail


# --------------------------------------------------------------------------- the verdicts (pure)
def _res(digest, code=0, seconds=0.01):
    return (code, "", {"tests": {"gemm": {"code": 0, "digest": digest, "seconds": seconds}}})


def test_gemm_replicas_majority_tie_broken_by_the_job_and_slow_reported():
    lay = {r: Layout(tp_rank=r % 2, dp_rank=r // 2) for r in range(4)}  # (tp0: 0, 2), (tp1: 1, 3)
    v = verdicts.check_verdict({0: _res("a"), 1: _res("a"), 2: _res("a"), 3: _res("b")}, lay, [0, 1, 2, 3])
    assert v.code == 2 and v.faulty == [3] and "[1]" in v.ranks[3]["reasons"][0]  # tie 1:1, job majority "a"
    v = verdicts.check_verdict({0: _res("a"), 1: _res("b")}, {0: Layout(), 1: Layout()}, [0, 1])
    assert v.code == 2 and v.faulty == [0, 1] and "no majority" in v.ranks[0]["reasons"][0]
    v = verdicts.check_verdict({r: _res("a", seconds=1.0 if r == 2 else 0.1) for r in range(4)}, lay, [2])
    assert v.code == 0 and v.ranks[2]["slow"] and sorted(v.ranks) == [2]
    v = verdicts.check_verdict({0: _res("a"), 1: _res("a", code=3)}, lay, [0, 1, 2], missing=[2])
    assert v.code == 3 and v.ranks[2]["code"] == 3
    assert verdicts.worst([0, 1, 3, 2]) == 2 and verdicts.worst([0, 1]) == 1 and verdicts.worst([]) == 1


def test_relink_verdict_names_the_switch_back():
    v = verdicts.relink_verdict({0: (0, "", {}), 1: (2, "rebuild failed", {"switched_back": True})}, [1], [0, 1])
    assert v.code == 2 and "switched back by itself on ranks [1]" in v.detail


def test_the_check_injector_spec_parses_and_refuses_mixtures():
    s = FaultSpec.parse("rank=1,iteration=2,point=check,fault=corrupt,what=gemm,how=bitflip")
    assert (s.point, s.what, s.how) == ("check", "gemm", "bitflip")
    for bad in ("rank=1,iteration=2,point=check,fault=kill", "rank=1,iteration=2,point=between,fault=corrupt,what=gemm",
                "rank=1,iteration=2,point=check,fault=corrupt,what=param"):
        with pytest.raises(ValueError):
            FaultSpec.parse(bad)


# --------------------------------------------------------------------------- the rank side
def test_gemm_is_seeded_the_bit_flip_changes_the_digest_and_memory_passes():
    import torch

    from mindspeed_ha.runtime import online_check
    from mindspeed_ha.testing.injector import corrupt

    rng = torch.get_rng_state()
    a, b = online_check.gemm(torch.device("cpu")), online_check.gemm(torch.device("cpu"))
    assert a["digest"] == b["digest"] and a["code"] == 0
    flipped = online_check.gemm(torch.device("cpu"), flip=lambda t: corrupt(t, "gemm", "bitflip"))
    assert flipped["digest"] != a["digest"]
    assert torch.equal(torch.get_rng_state(), rng)  # the training RNG is not touched
    m = online_check.memory(torch.device("cpu"), limit_bytes=1 << 20)
    assert m["code"] == 0 and m["errors"] == 0 and m["bytes"] == 1 << 20
    assert hashlib.sha256(b"").hexdigest() != a["digest"]


_LINK_SCRIPT = r"""
import datetime, json, torch, torch.distributed as dist
from mindspeed_ha.recovery import link_switch
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
out = {}
out["bad"] = link_switch.switch_links(0, [0], {"addr": "192.0.2.1"}, 10, timeout_s=5)
out["ok"] = link_switch.switch_links(0, [0], {"addr": "127.0.0.2"}, 12, timeout_s=5)
out["current"] = link_switch.current()
out["failed"] = link_switch.switch_links(0, [0], None, 14, timeout_s=5, inject_failure=True)
from mindspeed_ha.recovery import groups
groups.rebuild_process_groups(16)  # an in-place recovery after the relink: the binding stays
out["after_recovery"] = sorted({lo[0] for st, lo, _ in link_switch.tcp_endpoints() if st == "LISTEN"})
t = torch.ones(2); dist.all_reduce(t); out["works"] = t.tolist()
print(json.dumps(out))
"""


def test_link_switch_preflight_refuses_a_foreign_address_and_a_failed_rebuild_switches_back():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", _LINK_SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    code, detail, res = out["bad"]
    assert code == 2 and "cannot bind" in detail and res["rebuilt"] is False
    assert out["ok"][0] == 0 and out["ok"][2]["bound"] == {"addr": "127.0.0.2"} and out["current"] == {
        "addr": "127.0.0.2"}
    assert "127.0.0.2" in out["ok"][2]["listen_addrs"], out["ok"]  # the new groups' gloo device
    code, detail, res = out["failed"]
    assert code == 2 and res["switched_back"] and res["bound"] == {"addr": "127.0.0.2"}, out["failed"]
    assert out["after_recovery"] == ["127.0.0.2"], out["after_recovery"]
    assert out["works"] == [1.0, 1.0]
