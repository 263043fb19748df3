"""``MINDSPEED_HA_FORKSERVER=1``: the workers of ``mindspeed-ha-run`` forked from one
pre-imported process (mindspeed_ha/forkserver.py, mindspeed_ha/launch/forked.py).

Each test runs the real launcher on a tiny script with 2 local workers: what a worker sees
(parent, command line, rank env, its own log), its exit status as the launcher reports it,
and what is left after the job (no fork server, no worker)."""

import json
import os
import subprocess
import sys

import psutil
import pytest

from mindspeed_ha import forkserver

pytestmark = pytest.mark.timeout(300)

SCRIPT = """
import json, os, sys
import psutil
me = psutil.Process()
row = {"rank": int(os.environ["RANK"]), "pid": os.getpid(), "ppid": os.getppid(), "cmdline": " ".join(me.cmdline()),
       "argv": sys.argv[1:], "sid": os.getsid(0), "torch": "torch" in sys.modules}
with open(os.path.join(sys.argv[1], f"worker.{row['rank']}.json"), "w") as f:
    json.dump(row, f)
print(f"worker {row['rank']} wrote its row", flush=True)
sys.exit(int(os.environ.get("EXIT_" + os.environ["RANK"], "0")))
"""


def _launch(tmp_path, env):
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    logs = tmp_path / "logs"
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    proc = subprocess.Popen([sys.executable, "-m", "mindspeed_ha.launcher", "--standalone", "--nproc-per-node", "2",
                             "--log-dir", str(logs), "--redirects", "3", str(script), str(tmp_path), "x y"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=run_env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    rows = {}
    for r in (0, 1):
        path = tmp_path / f"worker.{r}.json"
        if path.exists():
            rows[r] = json.loads(path.read_text())
    return proc, out, err, rows


def _gone(rows, extra=()):
    pids = [row["pid"] for row in rows.values()] + list(extra)
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_workers_are_forked_children_of_the_launcher_and_read_as_torchruns(tmp_path):
    """Forked: each worker is the launcher's child in a session of its own, imported torch
    before its script ran (the fork server's), its command line is torchrun's worker's
    (``mindspeed_ha.boot`` + the script and its args), its argv and RANK its own, and a
    worker's exit status (3) is the launcher's failure record."""
    proc, out, err, rows = _launch(tmp_path, {"MINDSPEED_HA_FORKSERVER": "1", "EXIT_1": "3"})
    assert proc.returncode != 0, err[-3000:]
    assert sorted(rows) == [0, 1], err[-3000:]
    for rank, row in rows.items():
        assert row["ppid"] == proc.pid, row
        assert row["sid"] == row["pid"], row  # its own session, as torch's Popen(start_new_session=True)
        assert row["torch"], row  # imported before the script: the fork server's
        assert "-m mindspeed_ha.boot" in row["cmdline"] and "w.py" in row["cmdline"], row
        assert row["argv"] == [str(tmp_path), "x y"], row
    assert "exitcode  : 3" in err, err[-3000:]
    assert "fork server started" in err, err[-3000:]
    assert not _gone(rows)
    assert not [p for p in psutil.process_iter(["cmdline"]) if "mindspeed_ha.forkserver" in " ".join(
        p.info["cmdline"] or ()) and str(tmp_path) in " ".join(p.info["cmdline"] or ())]
    logs = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "logs") for f in fs if f == "stdout.log"]
    assert sorted(open(p).read().strip() for p in logs) == ["worker 0 wrote its row", "worker 1 wrote its row"]


def test_a_fork_server_with_threads_does_not_fork(tmp_path):
    """An OpenMP pool in the fork server (``OMP_NUM_THREADS=2``: torch's import starts it) makes
    forking unsafe: the server says so and the launcher starts the workers as torchrun does
    (fresh interpreters, command lines of their own), and the job succeeds."""
    proc, out, err, rows = _launch(tmp_path, {"MINDSPEED_HA_FORKSERVER": "1", "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, err[-3000:]
    assert "threads after the imports: not forking" in err, err[-3000:]
    assert sorted(rows) == [0, 1]
    for row in rows.values():
        assert row["ppid"] == proc.pid and not row["torch"], row


def test_preload_names_are_checked():
    assert forkserver.preload_names(" megatron.training, a.b ,") == ["megatron.training", "a.b"]
    with pytest.raises(ValueError, match="MINDSPEED_HA_FORKSERVER_PRELOAD"):
        forkserver.preload_names("megatron/training")


def test_a_bad_switch_is_refused_before_anything_starts(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mindspeed_ha.launcher", "--standalone", "--nproc-per-node", "1",
                        str(tmp_path / "none.py")], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, MINDSPEED_HA_FORKSERVER="yes"))
    assert r.returncode == 2 and "MINDSPEED_HA_FORKSERVER='yes': accepted 0 or 1" in r.stderr, r.stderr
