"""Clean exits: SIGINT / SIGTERM to the demo or to ``mindspeed-ha-run``, also repeated, leave no
process behind (issue 21: Ctrl-C to the demo left its 4 workers running, orphaned to init).

Every descendant is read with psutil once the workers exist (polled: an observable state),
before the signals; afterwards none may still run. Whatever a failing test leaves is SIGKILLed.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

POLL_S = 0.05  # polling observable state (processes, a file), never a synchronisation sleep


def _wait_for(what, predicate, proc, timeout_s):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}"
        time.sleep(POLL_S)
    raise AssertionError(f"timed out waiting for {what}")


def _descendants(pid):
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _workers(pid, marker, n):
    """The descendants of ``pid`` whose command line contains ``marker``, once there are ``n``."""
    found = []
    for p in _descendants(pid):
        try:
            if any(marker in part for part in p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found if len(found) >= n else None


def _running(procs):
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            continue
    return alive


def _kill_all(procs):
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


@pytest.mark.timeout(300)
def test_demo_sigint_twice_then_sigterm_leaves_no_process(tmp_path):
    """``mindspeed-ha demo``: once its 4 workers exist, SIGINT, SIGINT, SIGTERM back to back.
    The demo exits 130 (the first signal) and none of its descendants (the launcher, the
    workers in their own sessions) survives. On the code before the fix the 4 workers kept
    running."""
    proc = subprocess.Popen([sys.executable, "-m", "mindspeed_ha.cli", "demo", "--train-iters", "4",
                             "--kill-iteration", "2", "--workdir", str(tmp_path / "work")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    tree = []
    try:
        _wait_for("the 4 workers", lambda: _workers(proc.pid, "mindspeed_ha.boot", 4), proc, 240)
        tree = _descendants(proc.pid)
        for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
            os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=60)
        _wait_for_gone(tree)
        assert proc.returncode == 130, out[-3000:]
        assert "interrupted by signal 2" in out and "Traceback" not in out, out[-3000:]
    finally:
        _kill_all(tree)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _wait_for_gone(tree):
    """Every process of ``tree`` gone or a zombie; a killed process can take a moment to be
    reaped by its new parent, so this polls (bounded) before it names the survivors."""
    end = time.monotonic() + 10
    alive = _running(tree)
    while alive and time.monotonic() < end:
        time.sleep(POLL_S)
        alive = _running(alive)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


WORKER = """
import os, signal, sys
def note(signum, frame):  # a worker that does not stop on torchrun's SIGTERM: it only notes it
    open(os.path.join(sys.argv[1], "signalled." + os.environ["LOCAL_RANK"]), "w").close()
signal.signal(signal.SIGTERM, note)
signal.signal(signal.SIGINT, note)
open(os.path.join(sys.argv[1], "ready." + os.environ["LOCAL_RANK"]), "w").close()
while True:
    signal.pause()
"""


def _said(err_path):
    """The launcher's lines that say a signal began something it goes on with (a graceful
    stop, torchrun's shutdown): the next signal may follow."""
    text = err_path.read_text()
    return text.count(": graceful stop") + text.count(": stopping every worker")


def _signal_until_exit(proc, err_path, limit):
    """SIGTERM to the launcher, each time once its effect is seen (:func:`_said` grew) or the
    launcher ended; at most ``limit`` signals. Returns how many were sent.

    Only the launcher's own lines count: a worker's note of torchrun's SIGTERM can land
    after the next signal was sent, and counting it sent one signal too many (CI found it)."""
    for sent in range(1, limit + 1):
        said = _said(err_path)
        os.kill(proc.pid, signal.SIGTERM)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if proc.poll() is not None:
                return sent
            if _said(err_path) > said:
                break
            time.sleep(POLL_S)
        else:
            raise AssertionError("neither the launcher's end nor an effect of the signal")
    return limit


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ha", [False, True], ids=["torchrun", "ha"])
def test_launcher_repeated_sigterm_ends_workers_that_ignore_it(tmp_path, ha):
    """``mindspeed-ha-run`` with 2 workers (a script that imports nothing and only notes
    SIGTERM and SIGINT). SIGTERM, then again each time it took effect. torchrun's path (no
    HA flag): the first begins torchrun's shutdown (SIGTERM to the workers, SIGKILL 30 s
    later), the second SIGKILLs every descendant now. With the HA flag the first is the
    graceful stop (the controller's; these workers never register), the second torchrun's
    shutdown, the third the SIGKILL. The launcher exits 143 and leaves nothing. Before the
    fix, torchrun's shutdown ran again after the signal that interrupted it and the next one
    broke it off between its SIGTERM and its SIGKILL: the launcher exited with a traceback,
    the workers still running."""
    script = tmp_path / "stubborn.py"
    script.write_text(WORKER)
    err_path = tmp_path / "launcher.err"
    extra = ["--enable-high-availability", "--ha-controller-port", "0"] if ha else []
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "mindspeed_ha.launcher", "--standalone", "--nproc-per-node",
                                 "2", "--log-dir", str(tmp_path / "logs"), str(script), str(tmp_path), *extra],
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    tree = []
    try:
        _wait_for("both workers ready", lambda: all((tmp_path / f"ready.{r}").exists() for r in (0, 1)), proc, 100)
        tree = _descendants(proc.pid)
        assert len(_workers(proc.pid, str(script), 2)) == 2
        sent = _signal_until_exit(proc, err_path, 4)
        code = proc.wait(60)
        _wait_for_gone(tree)
        text = err_path.read_text()
        assert code == 128 + signal.SIGTERM, text[-3000:]
        assert "SIGTERM during the shutdown: SIGKILL to every worker" in text and "Traceback" not in text, text[-3000:]
        graceful = "SIGTERM: graceful stop" in text
        assert graceful <= ha and sent == 2 + graceful, (sent, text[-3000:])
    finally:
        _kill_all(tree)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["runtime", "processor"])
def test_a_rank_ending_with_os_exit_leaves_no_multiprocessing_temp_dir(tmp_path, how):
    """A rank ends with ``os._exit`` (after a dying checkpoint; the processor's exit
    handler), which skips multiprocessing's exit finalizers. Megatron's torch_dist save
    made a ``spawn`` manager for its write results (megatron-core's own
    ``_get_write_results_queue``, called here): its server outlived the rank and left its
    ``pymp-*`` directory (the listener socket), one per rank and job; the rank's own
    ``pymp-*`` directory stayed too. The exit paths now shut the manager down and remove
    the rank's directory (only this process's own)."""
    import psutil

    call = ("from mindspeed_ha.runtime.exits import exit_now; exit_now(3)" if how == "runtime" else
            "from mindspeed_ha.control.processor import default_exit_handler; default_exit_handler(3, 'test')")
    code = ("import multiprocessing.util as u; "
            "from megatron.core.dist_checkpointing.strategies import filesystem_async as f; "
            "q = f._get_write_results_queue(); print(u.get_temp_dir(), q._manager._process.pid, flush=True); " + call)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                       env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert r.returncode == 3, r.stderr[-2000:]
    path, server = r.stdout.split()[:2]
    assert path.startswith(str(tmp_path)) and os.path.basename(path).startswith("pymp-"), path
    try:
        assert not psutil.pid_exists(int(server)) or psutil.Process(int(server)).status() == psutil.STATUS_ZOMBIE
    finally:
        if psutil.pid_exists(int(server)):
            psutil.Process(int(server)).kill()
    assert not [n for n in os.listdir(tmp_path) if n.startswith("pymp-")], os.listdir(tmp_path)


_KILLED_RANK = r"""
import os, signal, sys, multiprocessing as mp
import mindspeed_ha
from mindspeed_ha.patches import registry
registry.enable("ha")
from megatron.core.dist_checkpointing.strategies import filesystem_async as f
q = f._get_write_results_queue()  # megatron-core's own spawn manager
from multiprocessing.managers import SyncManager
m = SyncManager(ctx=mp.get_context("spawn"))  # with an initializer of the caller's: still run
m.start(initializer=open, initargs=(sys.argv[1], "w"))
print(q._manager._process.pid, os.path.dirname(q._manager.address), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(120)
def test_a_killed_rank_s_manager_server_ends_and_removes_its_directory(tmp_path):
    """A rank SIGKILLed after a ``torch_dist`` save made megatron-core's write-results
    manager (a ``spawn`` child): the server ends with it and removes its ``pymp-*``
    directory (``ha.helper_dies_with_rank``). Before: with this package imported the
    manager could not even be made outside Megatron-LM's script (its patched
    ``_run_server`` could not be pickled: NotImplementedError); where it was made, the
    server outlived its rank and, SIGKILLed with the rank's session, left the directory."""
    import psutil

    marker = tmp_path / "initializer_ran"
    r = subprocess.run([sys.executable, "-c", _KILLED_RANK, str(marker)], capture_output=True, text=True,
                       timeout=100, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    pid, path = r.stdout.split()[:2]
    try:
        server = psutil.Process(int(pid))
    except psutil.NoSuchProcess:
        server = None
    try:
        if server is not None:
            server.wait(60)  # it ends by itself (its parent is gone: no zombie to reap here)
    finally:
        for p in psutil.process_iter(["cmdline"]):  # both managers' servers, whatever happened
            if "spawn_main" in " ".join(p.info["cmdline"] or ()) and str(tmp_path) in str(p.environ().get("TMPDIR")):
                p.kill()
    assert path.startswith(str(tmp_path)) and not os.path.exists(path), os.listdir(tmp_path)
    assert marker.exists()


@pytest.mark.timeout(120)
def test_a_worker_skips_the_final_collection_of_its_teardown(tmp_path):
    """``mindspeed_ha.boot`` (every worker of ``mindspeed-ha-run``) freezes what is alive
    after the last exit handler, so the interpreter's final collection does not walk a
    rank's whole heap (2.4-3.3 s per rank measured, :mod:`mindspeed_ha.teardown`). Seen
    from outside: an object in a reference cycle, alive at exit, is not finalized under
    boot (control: under plain ``python`` it is, by that collection); the script's exit
    hooks still run."""
    script = tmp_path / "cycle.py"
    script.write_text(
        "import atexit, sys\n"
        "class Cycle:\n"
        "    def __del__(self, path=sys.argv[1], open=open):\n"  # sys.argv is gone by then
        "        open(path, 'a').write('finalized\\n')\n"
        "c = Cycle(); c.me = c; del c\n"
        "import gc; gc.disable()\n"  # nothing collects it before the exit
        "atexit.register(lambda: open(sys.argv[1], 'a').write('exit hook\\n'))\n")
    out = {}
    for how, cmd in (("plain", [sys.executable, str(script)]), ("boot", [sys.executable, "-m", "mindspeed_ha.boot",
                                                                         str(script)])):
        path = tmp_path / f"{how}.txt"
        r = subprocess.run(cmd + [str(path)], capture_output=True, text=True, timeout=100)
        assert r.returncode == 0, r.stderr[-2000:]
        out[how] = path.read_text().split()
    assert out["plain"] == ["exit", "hook", "finalized"], out
    assert out["boot"] == ["exit", "hook"], out
