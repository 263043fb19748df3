"""``mindspeed-ha-run --enable-worker-reboot``: a dead worker is restarted alone (mindspeed_ha.agent).

Real launcher, real torchrun agent and rendezvous, two plain Python workers (no
Megatron, no torch.distributed): each writes what it is (pid, env) to a file, and
rank 1 SIGKILLs itself. The workers never register with the controller, so its
policy stays RUNNING and only the agent acts; the controller records the restarts
(``MINDSPEED_HA_REPORT``). Workers synchronise through the files they write, each wait
bounded.
"""

import glob
import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

WORKER = r'''
import json, os, signal, sys, time

# rank 1 SIGKILLs itself in incarnations 0..kill_until-1; rank 0 ends once rank 1's incarnation wait_inc runs;
# with "spares": rank 1 records the warm spare before it dies, rank 0 the next spare before it ends
out, kill_until, wait_inc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
spares = "spares" in sys.argv[4:]
rank, inc = int(os.environ["RANK"]), int(os.environ.get("MINDSPEED_HA_INCARNATION", "0"))
KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_USE_AGENT_STORE", "MINDSPEED_HA_INCARNATION")


def put(name, obj):
    tmp = os.path.join(out, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, os.path.join(out, name))


def wait_for(name, timeout_s=60.0):  # bounded: the test fails, it does not hang
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(os.path.join(out, name)):
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.01)


def spare_pids():  # the parked mindspeed_ha.spare processes of this test (its dir is on their command line)
    import psutil

    here = os.path.dirname(os.path.abspath(__file__))
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "mindspeed_ha.spare" in cmd and here in cmd:
            found.append(p.info["pid"])
    return sorted(found)


def wait_for_spare(other_than, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        pids = [p for p in spare_pids() if p not in other_than]
        if pids:
            return pids
        if time.monotonic() > deadline:
            sys.exit(4)
        time.sleep(0.01)


put(f"rank{rank}.inc{inc}.json", {"pid": os.getpid(), "env": {k: os.environ.get(k) for k in KEYS}})
print(f"worker rank {rank} incarnation {inc} pid {os.getpid()}", flush=True)
if rank == 1 and inc < kill_until:
    wait_for("rank0.inc0.json")  # rank 0 runs before the kill: its pid is the one that must not change
    if spares:
        put("spare1.json", {"pids": wait_for_spare(())})
    os.kill(os.getpid(), signal.SIGKILL)
if rank == 0:
    wait_for(f"rank1.inc{wait_inc}.json")  # the restarted rank 1 runs while this process still does
    if spares:  # the spare started for the next restart (the adopted one is rank 1 now)
        with open(os.path.join(out, f"rank1.inc{wait_inc}.json")) as f:
            put("spare2.json", {"pids": wait_for_spare((json.load(f)["pid"],))})
    put("rank0.end.json", {"pid": os.getpid()})
'''


@pytest.fixture
def no_stray_workers(tmp_path):
    """Workers run in their own sessions (torchrun's Popen): end any process of this test
    (its tmp_path is in every worker's command line) whatever happened."""
    yield
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(str(tmp_path) in a for a in p.info["cmdline"] or ()):
                p.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def _run(tmp_path, kill_until, wait_inc, launcher_flags=(), extra_env=None, worker_args=()):
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    report = tmp_path / "report.json"
    env = dict(os.environ, MINDSPEED_HA_REPORT=str(report), TTP_PORT="0", OMP_NUM_THREADS="1", **(extra_env or {}))
    cmd = [sys.executable, "-m", "mindspeed_ha.launcher", "--standalone", "--nproc-per-node=2",
           "--monitor-interval=0.05", "--log-dir", str(tmp_path / "logs"), "--tee=3", *launcher_flags,
           str(script), str(out), str(kill_until), str(wait_inc), *worker_args,
           "--enable-high-availability", "--enable-worker-reboot"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"launcher timed out:\n{stderr[-6000:]}")
    files = {os.path.basename(p)[:-5]: json.loads(open(p).read()) for p in glob.glob(str(out / "*.json"))}
    return proc.returncode, stdout, stderr, files, json.loads(report.read_text())


@pytest.mark.timeout(200)
def test_dead_worker_restarted_alone_with_its_rank(tmp_path, no_stray_workers):
    """Rank 1 SIGKILLs itself: it runs again with the same rank and env plus
    MINDSPEED_HA_INCARNATION=1, rank 0's process runs on (one pid from start to end),
    the job ends 0, the controller's report lists the restart, the new process's output
    goes to torchrun's log dir (per-incarnation file) and, with --tee, to the console."""
    code, stdout, stderr, files, report = _run(tmp_path, kill_until=1, wait_inc=1)
    assert code == 0, stderr[-6000:]
    assert sorted(files) == ["rank0.end", "rank0.inc0", "rank1.inc0", "rank1.inc1"], sorted(files)
    assert files["rank0.end"]["pid"] == files["rank0.inc0"]["pid"]  # rank 0 was never restarted
    first, again = files["rank1.inc0"], files["rank1.inc1"]
    assert again["pid"] != first["pid"]
    assert first["env"].pop("MINDSPEED_HA_INCARNATION") is None and again["env"].pop("MINDSPEED_HA_INCARNATION") == "1"
    assert again["env"] == first["env"] and again["env"]["RANK"] == "1", (first, again)
    assert [(r["rank"], r["incarnation"], r["pid"], r["exit_code"]) for r in report["restarts"]] == \
        [(1, 1, again["pid"], -signal.SIGKILL)], report["restarts"]
    assert report["fault_rank"] is None, report  # the controller took no decision: restarts are recorded only
    logs = glob.glob(str(tmp_path / "logs" / "*" / "attempt_0" / "1" / "stdout.incarnation1.log"))
    assert len(logs) == 1 and f"worker rank 1 incarnation 1 pid {again['pid']}" in open(logs[0]).read()
    assert f"worker rank 1 incarnation 1 pid {again['pid']}" in stdout  # --tee, as torchrun's TailLog prints


@pytest.mark.timeout(200)
def test_warm_spare_takes_the_dead_workers_place(tmp_path, no_stray_workers):
    """MINDSPEED_HA_WARM_SPARES=1: the parked spare (running before rank 1 died) becomes
    rank 1's incarnation 1 (same pid), with rank 1's env and MINDSPEED_HA_INCARNATION=1,
    its output in stdout.incarnation1.log and on the console; a new spare is started for
    the next restart; the job ends 0 and the agent's shutdown leaves no spare behind."""
    code, stdout, stderr, files, report = _run(tmp_path, kill_until=1, wait_inc=1,
                                               extra_env={"MINDSPEED_HA_WARM_SPARES": "1"}, worker_args=("spares",))
    assert code == 0, stderr[-6000:]
    first, again = files["rank1.inc0"], files["rank1.inc1"]
    assert files["spare1"]["pids"] == [again["pid"]], (files["spare1"], again)  # one spare, parked before the death
    assert files["rank0.end"]["pid"] == files["rank0.inc0"]["pid"]
    assert first["env"].pop("MINDSPEED_HA_INCARNATION") is None and again["env"].pop("MINDSPEED_HA_INCARNATION") == "1"
    assert again["env"] == first["env"] and again["env"]["RANK"] == "1", (first, again)
    assert [(r["rank"], r["incarnation"], r["pid"]) for r in report["restarts"]] == [(1, 1, again["pid"])]
    assert f"restarted alone as pid {again['pid']} (warm spare)" in stderr, stderr[-6000:]
    logs = glob.glob(str(tmp_path / "logs" / "*" / "attempt_0" / "1" / "stdout.incarnation1.log"))
    assert len(logs) == 1 and f"worker rank 1 incarnation 1 pid {again['pid']}" in open(logs[0]).read()
    assert f"worker rank 1 incarnation 1 pid {again['pid']}" in stdout
    next_spares = files["spare2"]["pids"]
    assert len(next_spares) == 1 and next_spares[0] != again["pid"], files["spare2"]
    for pid in files["spare1"]["pids"] + next_spares:  # the launcher has exited: nothing of it is left
        try:
            left = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            left = False
        assert not left, f"pid {pid} still runs after the launcher exited"


@pytest.mark.timeout(200)
def test_restart_limit_per_rank_then_the_job_fails(tmp_path, no_stray_workers):
    """A rank that always dies is restarted --max-restarts times (2), then the agent gives
    up as torchrun does: the launcher exits non-zero, there is no third restart, rank 0
    kept its one process."""
    code, _, stderr, files, report = _run(tmp_path, kill_until=99, wait_inc=2, launcher_flags=("--max-restarts=2",))
    assert code != 0, stderr[-6000:]
    ranks1 = sorted(k for k in files if k.startswith("rank1."))
    assert ranks1 == ["rank1.inc0", "rank1.inc1", "rank1.inc2"], sorted(files)
    assert [(r["rank"], r["incarnation"], r["pid"]) for r in report["restarts"]] == \
        [(1, 1, files["rank1.inc1"]["pid"]), (1, 2, files["rank1.inc2"]["pid"])], report["restarts"]
    assert "not restarted: restarted 2 times already" in stderr, stderr[-6000:]
    assert "rank0.inc1" not in files


@pytest.mark.timeout(30)
def test_controller_refuses_a_restart_it_cannot_take_back():
    """The gate the agent asks (no thread, no socket: the controller is not started):
    a rank that never registered may restart while the job runs; a registered rank (no
    rejoin yet), a verdict under way or a graceful stop refuse it."""
    from mindspeed_ha.config import HAConfig
    from mindspeed_ha.control.controller import Controller
    from mindspeed_ha.control.state import Layout, Phase, RankInfo

    ctl = Controller(HAConfig(enabled=True, worker_reboot=True, auth_key=b"k" * 32), world_size=2)
    assert ctl.restart_refused(1) is None
    ctl.state.ranks[0] = RankInfo(rank=0, layout=Layout())
    assert "registered" in ctl.restart_refused(0) and ctl.restart_refused(1) is None
    ctl.state.request_stop(0.0, -1, "SIGTERM")
    assert "graceful stop" in ctl.restart_refused(1)
    ctl.state.stop_request = None
    ctl.state.set_phase(Phase.STOPPING, 0.0)
    assert "phase stopping" in ctl.restart_refused(1)
