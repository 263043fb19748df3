"""Preemption (SIGTERM/SIGINT) and loss of the controller, on real 4-rank jobs (gloo, real
megatron-core). Signals are sent by the fault injector at a named iteration (the rank sends
it and goes on): ``term`` (SIGTERM to itself), ``term_launcher`` (SIGTERM to its parent, the
launcher), ``kill_launcher`` (SIGKILL to the launcher, which hosts the controller; the
workers stay, in their own sessions).

Standard of proof: the exit status, the order of the controller's decisions (report), the
checkpoint holds the last iteration every rank completed (the signal came after iteration
3 completed on the signalling rank: nothing before it is lost) and, where it says so,
``--load`` resumes with per-iteration losses bit for bit equal to the uninterrupted run.
No latency is asserted; every run has a timeout, far below the 31 minutes gloo would wait.
"""

import json
import os
import signal

import psutil
import pytest

from mindspeed_ha import faults
from mindspeed_ha.config import ConfigError, HAConfig
from mindspeed_ha.control import job_events
from mindspeed_ha.testing import megatron_lm as mlm
from mindspeed_ha.testing.harness import launch, launcher_command, tiny_gpt_args

#: iterations: the controller-loss case trains on for about heartbeat_timeout_s / 2 after
#: the launcher dies (~10 tiny iterations) before every rank pauses
ITERS = 40
SIGNAL_AT = 3
HB = ["--ha-heartbeat-interval", "0.5", "--ha-heartbeat-timeout", "2"]

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("flag,env,value", [
    ("--ha-preemption-deadline", None, "0"), ("--ha-preemption-deadline", None, "3601"),
    (None, "MINDSPEED_HA_PREEMPTION_DEADLINE", "soon"), (None, "MINDSPEED_HA_PREEMPTION_DEADLINE", "nan")])
def test_preemption_deadline_is_validated_naming_the_source_and_range(flag, env, value):
    import argparse

    ns = argparse.Namespace(enable_high_availability=True, ha_preemption_deadline=value if flag else None)
    with pytest.raises(ConfigError) as err:
        HAConfig.from_args(ns, {env: value} if env else {})
    assert (flag or env) in str(err.value) and "(0, 3600]" in str(err.value)
    assert HAConfig.from_args(argparse.Namespace(), {}).preemption_deadline_s == 20.0  # under a 30 s grace


def test_launcher_refuses_a_bad_deadline_before_starting_workers():
    import subprocess

    r = subprocess.run([*launcher_command(4), "-m", "mindspeed_ha.testing.trainer.pretrain_gpt",
                        *_args("--ha-preemption-deadline", "-1")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--ha-preemption-deadline" in r.stderr and "(0, 3600]" in r.stderr, r.stderr[-2000:]


def _args(*extra):
    return tiny_gpt_args(pp=2, train_iters=ITERS) + ["--enable-high-availability", "--ha-controller-port", "0",
                                                     *HB, *extra]


def _tracker(save):
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read())


@pytest.fixture
def no_stray_workers(tmp_path):
    """Workers outlive a killed launcher (torchrun starts them in their own sessions): end any
    process of this test (its tmp_path is in every worker's command line) when it ends."""
    yield
    mine = str(tmp_path)
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(mine in a for a in p.info["cmdline"] or ()):
                p.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def _run(tmp_path, args, inject=None, name="run"):
    env = {"MINDSPEED_HA_REPORT": str(tmp_path / f"{name}.json")}
    if inject:
        env["MINDSPEED_HA_INJECT"] = inject
    r = launch(4, args, launcher=launcher_command(4), env=env, timeout_s=300,
               loss_log=str(tmp_path / f"{name}.loss.jsonl"))
    assert not r.timed_out, r.stderr[-6000:]
    report = tmp_path / f"{name}.json"
    r.report = json.loads(report.read_text()) if report.exists() else None
    return r


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("baseline")
    r = _run(tmp, _args())
    assert r.returncode == 0, r.stderr[-4000:]
    assert sorted(r.losses) == list(range(1, ITERS + 1))
    return r.losses


def _actions(report):
    return [e["action"] for e in report["events"] if e["action"] != "noop"]


def _check_checkpoint_and_resume(tmp_path, r, base, save):
    """The checkpoint holds an iteration at or after the signal, nothing was lost before it,
    nothing is left half-written, and --load resumes bitwise."""
    k = _tracker(save)
    assert SIGNAL_AT <= k < ITERS, k
    assert not [n for n in os.listdir(save) if n.startswith(".")], os.listdir(save)  # no staging left
    assert {i: r.losses[i] for i in range(1, k)} == {i: base[i] for i in range(1, k)}
    resumed = _run(tmp_path, _args("--save", save, "--load", save), name="resumed")
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert sorted(resumed.losses) == list(range(k + 1, ITERS + 1))
    assert resumed.losses == {i: base[i] for i in range(k + 1, ITERS + 1)}
    return k


def test_sigint_to_the_launcher_stops_gracefully(tmp_path):
    """Ctrl-C (SIGINT) to mindspeed-ha-run: the same graceful stop as SIGTERM, exit 75."""
    save, events = str(tmp_path / "ckpt"), str(tmp_path / "events.jsonl")
    r = _run(tmp_path, _args("--save", save, "--ha-events-file", events),
             f"rank=1,iteration={SIGNAL_AT},point=between,fault=int_launcher")
    assert r.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, r.stderr[-6000:]
    assert "SIGINT to the launcher" in r.report["stop_request"]["reason"] and r.report["fault_rank"] is None
    assert _actions(r.report) == ["drain", "drain", "verify", "dump", "assemble", "commit", "exit"]
    assert _tracker(save) == r.report["iteration"] >= SIGNAL_AT
    lines = job_events.read(events)  # the events file: requested, every rank paused, saved, exit 75
    assert [e["type"] for e in lines] == ["ControllerStarted", "StopRequested", "Paused", "DyingCheckpointCommitted",
                                          "JobExit"], lines
    assert "SIGINT" in lines[1]["reason"] and lines[2]["phase_seconds"]["drain"] > 0 and lines[2]["ranks"] == [0, 1, 2, 3]
    assert lines[2]["iteration"] == lines[3]["iteration"] == r.report["iteration"]


def test_sigterm_to_the_launcher_stops_gracefully_and_resumes_bitwise(tmp_path, baseline):
    """The scheduler's SIGTERM to the launcher: every rank finishes its iteration and pauses
    after the same one, the checkpoint of it is written with no dead rank, exit 75."""
    save = str(tmp_path / "ckpt")
    r = _run(tmp_path, _args("--save", save), f"rank=0,iteration={SIGNAL_AT},point=between,fault=term_launcher")
    assert r.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, r.stderr[-6000:]
    rep = r.report
    assert rep["fault_rank"] is None and "SIGTERM to the launcher" in rep["stop_request"]["reason"]
    # two drain rounds (where each rank pauses; the agreed iteration), then the dying checkpoint
    assert _actions(rep) == ["drain", "drain", "verify", "dump", "assemble", "commit", "exit"], rep["events"]
    assert rep["exit_code"] == faults.EXIT_DYING_CHECKPOINT_SAVED
    k = _check_checkpoint_and_resume(tmp_path, r, baseline, save)
    assert rep["iteration"] == k
    assert "graceful stop (SIGTERM to the launcher" in r.stderr and f"continue from iteration {k}" in r.stderr


@pytest.mark.parametrize("ranks", [(2,), (0, 1, 2, 3)], ids=["one_worker", "every_worker"])
def test_sigterm_to_workers_stops_the_job_gracefully(tmp_path, ranks):
    """SIGTERM to a single worker: it asks the controller for a graceful stop; the whole job
    ends with a checkpoint (75), no worker is killed, nobody waits for torchrun's 30 s. To
    every worker (a scheduler signalling every process): the first request wins."""
    save = str(tmp_path / "ckpt")
    inject = ";".join(f"rank={r},iteration={SIGNAL_AT},point=between,fault=term" for r in ranks)
    r = _run(tmp_path, _args("--save", save), inject)
    assert r.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, r.stderr[-6000:]
    rep = r.report
    req = rep["stop_request"]
    assert req["rank"] in ranks and f"SIGTERM to rank {req['rank']}" in req["reason"]
    assert rep["fault_rank"] is None
    assert _actions(rep) == ["drain", "drain", "verify", "dump", "assemble", "commit", "exit"], rep["events"]
    k = _tracker(save)
    assert k == rep["iteration"] and k >= SIGNAL_AT
    for rank in range(4):
        assert f"worker rank {rank} exited with 75" in r.stderr
    assert "closing signal" not in r.stderr  # torchrun never had to end anyone


def test_graceful_stop_past_the_deadline_exits_77_and_publishes_nothing(tmp_path, no_stray_workers):
    """Past --ha-preemption-deadline the save is abandoned: a saver hangs (SIGSTOP) while it
    writes; at the deadline the controller sends EXIT(77) (the others remove the staging
    dir, the tracker is never written); the hung saver, still there after the deadline and
    the launcher's margin, is SIGKILLed; the launcher exits 77."""
    save = str(tmp_path / "ckpt")
    hang = ";".join(f"rank=2,iteration={k},point=dying,fault=stop" for k in range(SIGNAL_AT, SIGNAL_AT + 6))
    r = _run(tmp_path, _args("--save", save, "--ha-preemption-deadline", "3", "--ha-heartbeat-timeout", "30"),
             f"rank=0,iteration={SIGNAL_AT},point=between,fault=term_launcher;{hang}")
    assert r.returncode == faults.EXIT_FAULT_UNRECOVERABLE, r.stderr[-6000:]
    rep = r.report
    assert _actions(rep)[-1] == "exit" and rep["exit_code"] == faults.EXIT_FAULT_UNRECOVERABLE
    assert "preemption deadline of 3 s" in rep["reason"], rep["reason"]
    assert "still running 5 s after the preemption deadline: SIGKILL" in r.stderr
    assert not os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt"))
    assert not [n for n in os.listdir(save) if n.startswith(".")], os.listdir(save)


def test_controller_lost_ranks_write_the_checkpoint_themselves(tmp_path, baseline, no_stray_workers):
    """The launcher (and the controller thread in it) is SIGKILLed, the workers stay: each
    notices over its control connection, logs it once, and the ranks agree among themselves
    (the start-up gloo group) on the iteration, write its checkpoint and exit 75."""
    save = str(tmp_path / "ckpt")
    r = _run(tmp_path, _args("--save", save), f"rank=0,iteration={SIGNAL_AT},point=between,fault=kill_launcher")
    assert r.returncode == -signal.SIGKILL  # the launcher itself
    err = r.stderr
    for rank in range(4):
        assert err.count(f"rank {rank}: CONTROLLER LOST") == 1, err[-6000:]
    assert err.count("exiting with code 75: controller lost; the ranks committed the checkpoint") == 4, err[-6000:]
    k = _check_checkpoint_and_resume(tmp_path, r, baseline, save)
    assert err.count(f"every rank pauses after iteration {k}") == 4


def test_controller_and_a_rank_lost_exit_78_without_waiting(tmp_path, no_stray_workers):
    """The controller's host takes a rank with it: the survivors cannot agree without every
    rank (no controller, no store), so they exit 78 (controller lost), write nothing, and
    do not wait on the dead controller (the old failure: 31 minutes)."""
    save = str(tmp_path / "ckpt")
    inject = (f"rank=0,iteration={SIGNAL_AT},point=between,fault=kill_launcher;"
              f"rank=1,iteration={SIGNAL_AT + 1},point=between,fault=kill")
    r = _run(tmp_path, _args("--save", save), inject)
    assert r.returncode == -signal.SIGKILL
    for rank in (0, 2, 3):
        assert f"rank {rank}: CONTROLLER LOST" in r.stderr, r.stderr[-6000:]
        assert f"exiting with code {faults.EXIT_CONTROLLER_LOST}" in r.stderr
    assert not os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt"))
    assert not [n for n in os.listdir(save) if n.startswith(".")] if os.path.isdir(save) else True


# ----------------------------------------------------------------------------- stock Megatron-LM
STOCK_ITERS = 8


def test_stock_pretrain_gpt_sigterm_to_the_launcher(tmp_path_factory, tmp_path, megatron_lm_tarball):
    """Megatron-LM's own pretrain_gpt.py (core_v0.12.1, unmodified, torch_dist): SIGTERM to
    mindspeed-ha-run -> exit 75, checkpoint of the last completed iteration, stock --load
    resumes with losses and grad norms bitwise equal to the uninterrupted run."""
    root = mlm.unpack(megatron_lm_tarball, str(tmp_path_factory.mktemp("megatron_lm")))

    def args(**kw):
        return mlm.stock_gpt_args(pp=2, train_iters=STOCK_ITERS, ckpt_format="torch_dist",
                                  enable_high_availability=True, ha_controller_port=0, **kw)

    base = mlm.launch_stock(root, args())
    assert base.returncode == 0 and not base.timed_out, base.stderr[-4000:]
    save = str(tmp_path / "ckpt")
    r = mlm.launch_stock(root, args(save=save, load=save, save_interval=1000), env={
        "MINDSPEED_HA_INJECT": f"rank=0,iteration={SIGNAL_AT},point=between,fault=term_launcher"})
    assert r.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, r.stderr[-6000:]
    k = _tracker(save)
    assert SIGNAL_AT <= k < STOCK_ITERS, k
    assert os.path.exists(os.path.join(save, f"iter_{k:07d}", "metadata.json"))
    assert not [n for n in os.listdir(save) if n.startswith(".")], os.listdir(save)
    resumed = mlm.launch_stock(root, args(save=save, load=save, save_interval=1000))
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert sorted(resumed.losses) == list(range(k + 1, STOCK_ITERS + 1))
    for i in range(k + 1, STOCK_ITERS + 1):
        assert (resumed.losses[i], resumed.grad_norms[i]) == (base.losses[i], base.grad_norms[i]), i
