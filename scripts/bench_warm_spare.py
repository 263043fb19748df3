"""Warm spare (``MINDSPEED_HA_WARM_SPARES=1``) vs a cold restart of a dead worker (ARF,
``--enable-worker-reboot``), interleaved in one run.

The real launcher (``python -m mindspeed_ha.launcher --standalone --nproc-per-node=2
--monitor-interval=0.01``) runs a small worker script that starts like a real one: its
first line writes a wall-clock timestamp, then it imports torch, torch.distributed and
megatron.core and writes a second. Rank 1 (incarnation 0) waits until rank 0 has imported
and, with spares, until the spare is parked (blocked in ``read(0, ...)`` on its stdin,
read from ``/proc/<pid>/syscall``: Linux x86-64, syscall 0 on fd 0), writes the time and
SIGKILLs itself; the agent restarts it (the spare becomes it, or a new
``python -u -m mindspeed_ha.boot`` process starts). Figures, per run:

* ``kill->first line``: SIGKILL to the new process's first line of the user's script. It
  contains the agent's detection (the monitor interval, 0.01 s, plus the poll), the same
  in both modes.
* ``kill->imports done``: to the end of the script's ``import torch, megatron.core``
  (what a real worker has before it can do anything; with a spare these are already loaded).

Repeats alternate cold and warm (``--repeat`` rounds). Nothing here is a test: no
assertions on times.

    python scripts/bench_warm_spare.py [--repeat 3]
"""

from __future__ import annotations

from mindspeed_ha import env as ha_env
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r'''
import os, sys, time
t_first = time.time()  # the first line of the user's script
out = sys.argv[1]
rank, inc = int(os.environ["RANK"]), int(os.environ.get("@INCARNATION@", "0"))


def put(name, text):
    tmp = os.path.join(out, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(out, name))


def wait(pred, timeout_s=120.0):  # bounded: the run fails, it does not hang
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.005)


put(f"first.{rank}.{inc}", repr(t_first))
import torch, torch.distributed, megatron.core, megatron.core.parallel_state  # noqa: E401,F401  (a real worker's imports)
put(f"imported.{rank}.{inc}", repr(time.time()))


def parked_spare():
    import psutil

    here = os.path.dirname(os.path.abspath(__file__))
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "mindspeed_ha.spare" in cmd and here in cmd:
            try:
                with open(f"/proc/{p.info['pid']}/syscall") as f:
                    if f.read().split()[:2] == ["0", "0x0"]:  # read(0, ...): parked on its stdin
                        return True
            except OSError:
                pass
    return False


if rank == 1 and inc == 0:
    wait(lambda: os.path.exists(os.path.join(out, "imported.0.0")))
    if os.environ.get("@WARM_SPARES@") == "1":
        wait(parked_spare)
    put("killed", repr(time.time()))
    os.kill(os.getpid(), 9)
if rank == 0:
    wait(lambda: os.path.exists(os.path.join(out, "imported.1.1")))
'''.replace("@INCARNATION@", ha_env.INCARNATION).replace("@WARM_SPARES@", ha_env.WARM_SPARES)


def one_run(workdir: str, warm: bool) -> dict:
    """One launcher run; returns the two figures in seconds."""
    run = tempfile.mkdtemp(dir=workdir)
    out = os.path.join(run, "out")
    os.mkdir(out)
    script = os.path.join(run, "worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    env = dict(os.environ, TTP_PORT="0", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop(ha_env.WARM_SPARES, None)
    if warm:
        env[ha_env.WARM_SPARES] = "1"
    cmd = [sys.executable, "-m", "mindspeed_ha.launcher", "--standalone", "--nproc-per-node=2",
           "--monitor-interval=0.01", "--log-dir", os.path.join(run, "logs"), script, out,
           "--enable-high-availability", "--enable-worker-reboot"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        raise SystemExit(f"launcher timed out:\n{stderr[-4000:]}")
    if proc.returncode != 0:
        raise SystemExit(f"launcher exited {proc.returncode}:\n{stderr[-4000:]}")
    if warm != ("(warm spare)" in stderr):
        raise SystemExit(f"expected warm={warm}, the agent said otherwise:\n{stderr[-4000:]}")

    def read(name):
        with open(os.path.join(out, name)) as f:
            return float(f.read())

    killed = read("killed")
    return {"first_line": read("first.1.1") - killed, "imports_done": read("imported.1.1") - killed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="rounds of (cold, warm) runs (default 3)")
    args = ap.parse_args()
    results = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="bench_warm_spare_") as workdir:
        for i in range(args.repeat):
            for mode in ("cold", "warm"):
                r = one_run(workdir, warm=(mode == "warm"))
                results[mode].append(r)
                print(f"round {i + 1} {mode}: kill->first line {r['first_line']:.3f} s, kill->imports done "
                      f"{r['imports_done']:.3f} s", file=sys.stderr, flush=True)
    print(f"{'restart':<22}{'runs':>5}{'kill->first line s (median)':>30}{'kill->imports done s (median)':>32}"
          f"{'  imports done, each run s'}")
    for mode, label in (("cold", "cold (new process)"), ("warm", "warm spare")):
        rs = results[mode]
        fl = statistics.median(r["first_line"] for r in rs)
        im = statistics.median(r["imports_done"] for r in rs)
        each = " ".join(f"{r['imports_done']:.3f}" for r in rs)
        print(f"{label:<22}{len(rs):>5}{fl:>30.3f}{im:>32.3f}  {each}")
    cold = statistics.median(r["imports_done"] for r in results["cold"])
    warm = statistics.median(r["imports_done"] for r in results["warm"])
    print(f"warm/cold (imports done): {warm / cold:.3f}")
    print(json.dumps({m: results[m] for m in results}))


if __name__ == "__main__":
    main()
