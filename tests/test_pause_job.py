"""The operator's graceful pause and hot switch on Megatron-LM's own pretrain_gpt.py (core_v0.12.1,
unmodified, unpacked from ../shared/third_party) on 4 CPU/gloo ranks (TP1 PP2 DP2), through
``mindspeed-ha-run``.

One job, driven from the real ``mindspeed-ha`` console entry (subprocesses) in sequence, each
step at a fixed iteration: rank 0 holds after the iteration :data:`HOLDS` names for the step
(the injector's ``fault=hold``) until the job is pausing for it (the pause comes after the next
iteration, hold + 1), so that the operator's steps cost no iterations however slow the machine
(the waits in between poll the job's ``status`` in-process):
``switch --ranks 3`` (the hot switch of the last pipeline stage's rank, which logs the losses:
code 0, only rank 3's PID changed, to its new process's; this job runs with
``--enable-worker-reboot`` and ``MINDSPEED_HA_WARM_SPARES=1``; held at iteration
:data:`HELD` while the new process starts); ``pause`` (every rank holds after one iteration K1;
``status --json`` shows every
rank at K1), the CLI with a wrong key (exit 6, the job unaffected: still paused at K1, same
PIDs), ``resume``; the pause tasks, each one command on the running job (pause, task, resume):
``check`` of every test on every rank (code 0, the training state digests equal before and
after on every rank), ``check`` of rank 1 whose GEMM result the injector flips one bit of
(code 2 naming rank 1), ``relink --ranks 1 --addr 127.0.0.2`` (rank 1's new groups' gloo device
listens on 127.0.0.2, seen in its process's sockets) and ``relink --ranks 1 --back`` (127.0.0.2 gone);
``pause --max 1`` (resumes by itself: ``status`` shows the job running again and
the pause's held seconds). The job then trains to :data:`END` (Megatron-LM's ``--exit-interval``, the
iteration after the last hold:
its own checkpoint of END, written with rank 3's new process) and exits 0, its switched-out
process having exited 0 and no process restarted.
Then the same job again with ``--load`` (a second job: the scheduler's requeue): it trains on
from END, is paused at K4 (rank 0 held after its first iteration, END + 1, until then) and
``stop``-ped while every rank holds: the checkpoint of K4 (no step lost), exit 75.
Standard of proof: the per-iteration losses of 1..END (the switch, two pauses and resumes among them)
and END+1..K4 (after --load, nothing re-run, nothing past K4) (and grad norms; the two checks
and the two relinks among 1..END) are bitwise
equal to an uninterrupted run of the same job, HA off, stopped at K4 by Megatron-LM's
``--exit-interval`` (started by the fork server, nvidia-modelopt hidden: neither changes a number,
tests/test_stock_megatron_lm.py's ``test_flags_off_equals_ha_on_without_fault``). Synchronisation
is on the job's observable state (``status`` output), never on time.
(A SIGKILL of a rank while every rank held in a third pause used to end the first job (the
dying checkpoint, exit 75, loaded by the second job): a fault during a pause is
tests/test_operator.py's (the dying checkpoint of the iteration held at), a SIGKILLed rank of
stock pretrain_gpt.py tests/test_stock_megatron_lm.py's (the dying checkpoint, --load bitwise).)
"""

import json
import os
import secrets
import subprocess
import sys
import threading

import psutil
import pytest

from mindspeed_ha.control import operator
from mindspeed_ha.faults import EXIT_DYING_CHECKPOINT_SAVED
from mindspeed_ha.launch.proctree import end_tree
from mindspeed_ha.testing import megatron_lm as mlm
from mindspeed_ha.testing import switch_job
from mindspeed_ha.testing.harness import free_port, launcher_command, read_rank_loss_logs
from mindspeed_ha.testing.injector import release as release_holds

#: the injector's test double: rank 1's second online check gets one bit of its GEMM result flipped
CHECK_FLIP = "rank=1,iteration=2,point=check,fault=corrupt,what=gemm,how=bitflip"
#: the rank the hot switch moves: the last pipeline stage (its new process logs the losses after the switch)
SWITCHED = 3
#: rank 0 holds after each of these iterations (``fault=hold``) until the job is pausing for the
#: step (the pause after the next iteration: hold + 1); a step's wait for training after its pause
#: ends at the next hold; "end": held until the test saw training after ``pause --max 1``
HOLDS = {"switch": 2, "pause": 5, "check": 8, "check_rank_1": 10, "relink": 12, "relink_back": 14, "pause_max": 16,
         "end": 19}
HELD = HOLDS["switch"]
#: the first job's end (``--exit-interval``): the iteration after the last hold; ITERS: the
#: schedule's length (the second job trains on from END)
END, ITERS = HOLDS["end"] + 1, 400
#: seconds the new process of the switch may take to be READY (``--ha-connect-timeout``): it replays
#: the start-up of stock pretrain_gpt.py, over the default 60 s at load 25-40
SPARE_READY_S = 180
pytestmark = pytest.mark.timeout(900)  # three stock start-ups: 3 min each at load 45-60


def _cli():
    exe = os.path.join(os.path.dirname(sys.executable), "mindspeed-ha")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "mindspeed_ha.cli"]


class Operator:
    """The CLI on the job (``op(verb, *flags)``); ``status_until`` polls ``status`` in-process
    (:class:`mindspeed_ha.testing.switch_job.Operator`: a poll interval, no interpreter per poll)."""

    def __init__(self, port, key, job):
        self.addr, self.key, self.job = f"127.0.0.1:{port}", key, job
        self.poll = switch_job.Operator(port, bytes.fromhex(key), job)

    def __call__(self, verb, *flags, key=None):
        env = dict(os.environ, MINDSPEED_HA_AUTH_KEY=key or self.key)
        # --controller (every verb's alias of --addr): relink's --addr is the ranks' new address
        # --timeout: a switch's reply waits for its new process to be READY (SPARE_READY_S) too
        p = subprocess.run([*_cli(), verb, "--json", "--controller", self.addr, "--timeout", str(SPARE_READY_S + 120),
                            *flags], env=env, capture_output=True, text=True, timeout=SPARE_READY_S + 180)
        out = json.loads(p.stdout) if p.stdout.strip() else {}
        return p.returncode, out

    def status_until(self, cond, what):
        """``status`` again and again until ``cond(status)`` holds (the job must still run)."""
        return self.poll.status_until(cond, what)

    def held(self, step, verb, *flags, release):
        """``verb`` once rank 0 holds after ``HOLDS[step]`` (every rank completed it), that hold
        released (``release``: the job's release file) once the job is pausing for it (or the
        command ended); returns (code, output)."""
        self.status_until(lambda s: min(_iterations(s)) >= HOLDS[step], f"the hold after iteration {HOLDS[step]}")
        return self.releasing(release, HOLDS[step], verb, *flags)

    def releasing(self, release, through, verb, *flags):
        """``verb`` (its own thread); the holds up to ``through`` (every one: None) released once
        the job is pausing for it (or the command ended); returns (code, output)."""
        asked = {}

        def ask():
            try:
                asked["reply"] = self(verb, *flags)
            except BaseException as exc:  # noqa: BLE001 - raised below, on the test's thread
                asked["reply"] = exc

        t = threading.Thread(target=ask, daemon=True)
        t.start()
        try:
            self.status_until(lambda s: s["phase"] in ("pausing", "paused") or "reply" in asked, f"{verb}'s pause")
        finally:
            release_holds(release, through)
        t.join()
        if isinstance(asked["reply"], BaseException):
            raise asked["reply"]
        return asked["reply"]


def _iterations(s):
    return [r.get("iteration", -1) for r in s["ranks"]]


def _start(root, args, env, out_path):
    with open(out_path, "w") as out:
        return subprocess.Popen([*launcher_command(4), "--log-dir", str(out_path) + ".torchrun",
                                 os.path.join(root, "pretrain_gpt.py"), *args, "--enable-high-availability"],
                                env=env, cwd=root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _tracker(save):
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read())


def _losses_and_norms(loss_log):
    records, losses = read_rank_loss_logs(loss_log)
    return losses, {int(r["iteration"]): r["grad_norm"] for r in records if "lm loss" in r["loss"]}


def _rank_addrs(pid):
    """The local addresses of the process's listening and established TCP sockets."""
    return {c.laddr.ip for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status in (psutil.CONN_ESTABLISHED, psutil.CONN_LISTEN)}


def _pause_tasks(op, pids, release):
    """check (clean), check (rank 1's GEMM bit flipped), relink rank 1 to 127.0.0.2 and back:
    each one command on the running job (pause, task, resume), each at its hold."""
    code, out = op.held("check", "check", "--test", "gemm,memory,p2p,allreduce", "--budget", "120", release=release)
    r = out["result"]
    assert code == 0 and r["code"] == 0 and r["after"] == "resumed", out
    assert sorted(r["ranks"]) == ["0", "1", "2", "3"] and all(v["state_unchanged"] for v in r["ranks"].values())
    assert {t for v in r["ranks"].values() for t in v["tests"]} == {"gemm", "memory", "p2p", "allreduce"}
    assert len({v["tests"]["gemm"]["digest"] for v in r["ranks"].values()}) == 1
    print("check seconds per test:", {k: {t: v["tests"][t].get("seconds") for t in v["tests"]}
                                      for k, v in r["ranks"].items()}, "pause window", r["pause_seconds"])
    code, out = op.held("check_rank_1", "check", "--ranks", "1", "--test", "gemm", "--budget", "120",
                        release=release)
    r = out["result"]
    assert code == operator.EXIT_FAILED and r["code"] == 2 and r["faulty"] == [1], out
    assert "rank 1" in out["detail"] and r["after"] == "resumed"
    assert "127.0.0.2" not in _rank_addrs(pids[1])
    code, out = op.held("relink", "relink", "--ranks", "1", "--addr", "127.0.0.2", "--budget", "120", release=release)
    r = out["result"]
    assert code == 0 and r["code"] == 0 and r["ranks"]["1"]["bound"] == {"addr": "127.0.0.2"}, out
    # gloo: rank 1's new groups' device listens on 127.0.0.2, the address its peers reach it at
    # (on loopback its own connections start from 127.0.0.1: gloo binds only the listener)
    assert "127.0.0.2" in r["ranks"]["1"]["listen_addrs"], r["ranks"]["1"]
    assert all("127.0.0.2" not in r["ranks"][x]["listen_addrs"] + r["ranks"][x]["local_addrs"] for x in "023")
    assert "127.0.0.2" in _rank_addrs(pids[1])  # seen from outside too
    code, out = op.held("relink_back", "relink", "--ranks", "1", "--back", "--budget", "120", release=release)
    r = out["result"]
    assert code == 0 and r["code"] == 0 and r["ranks"]["1"]["bound"] is None, out
    assert "127.0.0.2" not in r["ranks"]["1"]["listen_addrs"] + r["ranks"]["1"]["local_addrs"], r["ranks"]["1"]
    assert "127.0.0.2" not in _rank_addrs(pids[1])
    code, out = op("status")
    assert [t["kind"] for t in out["result"]["pause_tasks"]][-4:] == ["check", "check", "relink", "relink"]
    assert out["result"]["phase"] == "running" and [x["pid"] for x in out["result"]["ranks"]] == pids


def _switch(op, pids, rank, release):
    """``switch --ranks rank`` once a warm spare is parked and the job holds after iteration
    :data:`HELD` (rank 0's ``fault=hold``), which ``release`` ends once the job is pausing for
    the switch: code 0, only that rank's PID changed, to its new process's; returns the PIDs
    after it."""
    op.status_until(lambda s: s["phase"] == "running" and s.get("spares") and not s.get("switching"),
                    "a warm spare parked")
    code, out = op.held("switch", "switch", "--ranks", str(rank), release=release)
    r = out["result"]
    assert code == 0 and r["phase"] == "done", out
    assert {"spare_ready", "pause", "rebuild", "transfer", "pause_window"} <= set(r["phase_seconds"]), r
    k = r["iteration"]
    assert k + 2 <= HOLDS["pause"], (k, HOLDS)  # the pause after the hold
    s = op.status_until(lambda s: s["phase"] == "running" and not s.get("switching") and min(_iterations(s)) >= k + 2,
                        "training after the switch")
    after = [x["pid"] for x in s["ranks"]]
    assert after[rank] == int(r["spares"][str(rank)]) != pids[rank], (pids, after, r)
    assert [p for i, p in enumerate(after) if i != rank] == [p for i, p in enumerate(pids) if i != rank]
    print("switch phase seconds", r["phase_seconds"])
    return after


def test_switch_pause_status_wrong_key_resume_max_exit_0_then_stop_while_paused(tmp_path, megatron_lm_tarball,
                                                                                as_users_run):
    root = mlm.unpack(megatron_lm_tarball, str(tmp_path / "megatron_lm"))
    key = secrets.token_hex(32)
    save, loss_log = str(tmp_path / "ckpt"), str(tmp_path / "loss.jsonl")
    args = mlm.stock_gpt_args(tp=1, pp=2, train_iters=ITERS) + ["--save", save, "--save-interval", "100000"]

    def env(port, loss_log, **extra):
        return dict(os.environ, **mlm.stock_env({"TTP_PORT": str(port), "MINDSPEED_HA_AUTH_KEY": key,
                                                  "MINDSPEED_HA_LOSS_LOG": loss_log, **extra}))

    port, out_path, release = free_port(), tmp_path / "job.out", str(tmp_path / "release")
    # the first job also has what a hot switch needs: worker reboot and a warm spare; it ends at END
    holds = ";".join(f"rank=0,iteration={k},point=between,fault=hold" for k in HOLDS.values())
    job = _start(root, args + ["--enable-worker-reboot", "--exit-interval", str(END)],
                 env(port, loss_log, MINDSPEED_HA_INJECT=f"{CHECK_FLIP};{holds}", MINDSPEED_HA_INJECT_RELEASE=release,
                     MINDSPEED_HA_WARM_SPARES="1", MINDSPEED_HA_CONNECT_TIMEOUT=str(SPARE_READY_S)), out_path)
    try:
        op = Operator(port, key, job)
        s = op.status_until(lambda s: s["phase"] == "running" and min(_iterations(s)) >= HELD, f"iteration {HELD}")
        pids = [r["pid"] for r in s["ranks"]]
        switched_out, pids = pids[SWITCHED], _switch(op, pids, SWITCHED, release)

        code, out = op.held("pause", "pause", release=release)
        assert code == 0, out
        k1 = out["result"]["iteration"]
        assert k1 + 2 <= HOLDS["check"], (k1, HOLDS)
        code, out = op("status")
        s = out["result"]
        assert code == 0 and s["phase"] == "paused" and s["pause"]["iteration"] == k1
        assert _iterations(s) == [k1] * 4 and s["by_state"]["healthy"] == [0, 1, 2, 3]
        pids = [r["pid"] for r in s["ranks"]]

        for verb in ("status", "resume"):  # a CLI without the job's key is refused like any peer
            code, out = op(verb, key=secrets.token_hex(32))
            assert code == operator.EXIT_AUTH, out
        code, out = op("status")
        assert out["result"]["phase"] == "paused" and _iterations(out["result"]) == [k1] * 4
        assert [r["pid"] for r in out["result"]["ranks"]] == pids

        code, out = op("resume")
        assert code == 0, out
        s = op.status_until(lambda s: min(_iterations(s)) >= k1 + 2, "training after resume")
        _pause_tasks(op, pids, release)

        code, out = op.held("pause_max", "pause", "--max", "1", release=release)
        assert code == 0, out
        k2 = out["result"]["iteration"]
        assert k1 < k2 and k2 + 2 <= HOLDS["end"], (k1, k2, HOLDS)
        op.status_until(lambda s: s["phase"] == "running" and s["pauses"][-1]["held_seconds"] is not None,
                        "the pause's end (--max 1)")

        op.status_until(lambda s: min(_iterations(s)) >= k2 + 2, "training after the automatic resume")
        release_holds(release)  # every hold: the last one ("end")
        rc = job.wait(timeout=300)  # trains to END
    finally:
        end_tree(job.pid, include_root=True)
        job.wait()
    log = out_path.read_text()
    assert rc == 0, log[-6000:]
    # the switched-out process ended by itself with exit 0, its new one took its place (no restart)
    assert (f"worker rank {SWITCHED} (pid {switched_out}) switched out with exit 0; pid {pids[SWITCHED]}"
            in log), log[-6000:]
    assert "restarted alone as pid" not in log
    assert _tracker(save) == END  # Megatron-LM's own save at --exit-interval

    # the same job again from its checkpoint of END (--load): trains on, is paused at K4,
    # then stopped while paused: the checkpoint of K4 (no step lost), exit 75
    loss_log2, out_path2, release2 = str(tmp_path / "resumed.jsonl"), tmp_path / "resumed.out", str(tmp_path / "r2")
    port2 = free_port()
    job2 = _start(root, args + ["--load", save], env(
        port2, loss_log2, MINDSPEED_HA_INJECT=f"rank=0,iteration={END + 1},point=between,fault=hold",
        MINDSPEED_HA_INJECT_RELEASE=release2), out_path2)
    try:
        op2 = Operator(port2, key, job2)
        # paused as soon as every rank registered: before the ranks started their first
        # iteration (K4 = END + 1) or while rank 0 holds after it (K4 = END + 2)
        op2.status_until(lambda s: s["phase"] == "running" and s["by_state"]["healthy"] == [0, 1, 2, 3],
                         "every rank registered (--load)")
        code, out = op2.releasing(release2, None, "pause")
        assert code == 0, out
        k4 = out["result"]["iteration"]
        assert END < k4 <= END + 2, k4
        code, out = op2("status")
        assert code == 0 and out["result"]["phase"] == "paused" and _iterations(out["result"]) == [k4] * 4, out
        code, out = op2("stop")  # while every rank holds at K4
        assert code == 0, out
        rc2 = job2.wait(timeout=300)
    finally:
        end_tree(job2.pid, include_root=True)
        job2.wait()
    assert rc2 == EXIT_DYING_CHECKPOINT_SAVED, out_path2.read_text()[-6000:]
    assert _tracker(save) == k4
    assert not [n for n in os.listdir(save) if n.startswith(".")], os.listdir(save)  # no staging left

    paused, norms = _losses_and_norms(loss_log)
    resumed, norms2 = _losses_and_norms(loss_log2)
    assert sorted(paused) == list(range(1, END + 1))
    assert sorted(resumed) == list(range(END + 1, k4 + 1))  # nothing re-run, nothing past K4
    # the reference started as the suite's other jobs are (tests/conftest.py, _job_environment)
    hidden = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hidden")
    base = mlm.launch_stock(root, mlm.stock_gpt_args(tp=1, pp=2, train_iters=ITERS) + ["--exit-interval", str(k4)],
                            env={"PYTHONPATH": os.pathsep.join(p for p in (hidden, os.environ.get("PYTHONPATH")) if p),
                                 "MINDSPEED_HA_FORKSERVER": "1"}, timeout_s=300)
    assert base.returncode == 0, base.stderr[-4000:]
    assert sorted(base.losses) == list(range(1, k4 + 1))
    assert paused == {i: base.losses[i] for i in range(1, END + 1)}
    assert norms == {i: base.grad_norms[i] for i in range(1, END + 1)}
    assert resumed == {i: base.losses[i] for i in range(END + 1, k4 + 1)}
    assert norms2 == {i: base.grad_norms[i] for i in range(END + 1, k4 + 1)}
