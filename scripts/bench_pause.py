#!/usr/bin/env python
"""Graceful pause and resume latencies on the tiny 4-rank job (CPU, gloo, TP1 PP2 DP2,
``mindspeed-ha-run``, the built-in trainer), through the operator channel.

Per round: ``pause`` -> its reply (every rank holds after one iteration K: the controller
answers when the last STOPPED(pause_at=K) arrived), measured on the client's clock and as
the controller's own ``pause_seconds``; then ``resume`` -> the loss-logging rank (the last
pipeline stage) appends iteration K+1 to the loss log (polled every millisecond; the
controller's view of iterations follows the heartbeats, 1 s, so ``status`` cannot time
this). The healthy step time is the trainer's own ``elapsed_s`` of the logged iterations.
The job ends with ``stop`` (exit 75).

``--tasks``: instead, the pause tasks, each one request on the running job (pause, task,
resume): ``check`` of every test on every rank, then ``relink --ranks 1 --addr 127.0.0.2``
and ``--back``, per round; printed: the pause window (request -> verdict, the controller's
``pause_seconds``), the task's seconds on the ranks, each test's seconds (slowest rank)
and the relink's rebuild seconds.

    python scripts/bench_pause.py [--rounds 5] [--tasks]
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mindspeed_ha.control import operator  # noqa: E402
from mindspeed_ha.launch.proctree import end_tree  # noqa: E402
from mindspeed_ha.testing.harness import (TRAINER_MODULE, four_rank_args, free_port, launcher_command,  # noqa: E402
                                          read_loss_log)


def logged(path):
    """The iterations in the loss log so far."""
    try:
        return {r["iteration"] for r in read_loss_log(path)}
    except ValueError:  # a line being written
        return set()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tasks", action="store_true", help="check and relink rounds instead of pause / resume")
    a = ap.parse_args()
    port, key = free_port(), secrets.token_hex(32)
    target = operator.Target("127.0.0.1", port)

    def ask(verb, **kw):
        reply = operator.request(verb, key=bytes.fromhex(key), target=target, timeout_s=120, env={}, **kw)
        if reply.code != 0:
            raise SystemExit(f"{verb}: {reply.code} {reply.detail}")
        return reply

    def iterations():
        return [r.get("iteration", -1) for r in ask("status").result["ranks"]]

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", TTP_PORT=str(port), MINDSPEED_HA_AUTH_KEY=key,
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        loss_log = os.path.join(tmp, "loss.jsonl")
        job = subprocess.Popen([*launcher_command(4), "--log-dir", os.path.join(tmp, "tr"), "-m", TRAINER_MODULE,
                                *four_rank_args("tp1pp2", 100000), "--save", os.path.join(tmp, "ckpt"),
                                "--loss-log", loss_log], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        rows = []
        try:
            deadline = time.monotonic() + 300
            while True:  # until every rank trains
                try:
                    if min(iterations()) >= 3:
                        break
                except operator.OperatorError:
                    pass
                time.sleep(0.2)
                if time.monotonic() > deadline or job.poll() is not None:
                    raise SystemExit("the job did not start")
            for _ in range(a.rounds if a.tasks else 0):
                rows.append(_task_round(ask, iterations))
            for _ in range(0 if a.tasks else a.rounds):
                t0 = time.monotonic()
                reply = ask("pause")
                pause_client = time.monotonic() - t0
                k = reply.result["iteration"]
                t0 = time.monotonic()
                ask("resume")
                while k + 1 not in logged(loss_log):
                    time.sleep(0.001)
                rows.append((pause_client, reply.result["seconds"], time.monotonic() - t0))
                while min(iterations()) < k + 3:  # trains on a while before the next round
                    time.sleep(0.05)
            steps = [r["elapsed_s"] for r in read_loss_log(loss_log)[3:]]
            ask("stop")
            code = job.wait(timeout=120)
        finally:
            end_tree(job.pid, include_root=True)
            job.wait()
    print(f"job exit {code}; {len(rows)} rounds")
    print("| | median s | max s |\n|---|---|---|")
    if a.tasks:
        print(f"| healthy step (trainer's elapsed_s) | {statistics.median(steps):.3f} | {max(steps):.3f} |")
        for name in rows[0]:
            vals = [r[name] for r in rows]
            print(f"| {name} | {statistics.median(vals):.3f} | {max(vals):.3f} |")
        return 0
    print(f"| healthy step (trainer's elapsed_s) | {statistics.median(steps):.3f} | {max(steps):.3f} |")
    for i, name in enumerate(("pause request -> reply (client)", "pause request -> every rank paused (controller)",
                              "resume request -> iteration K+1 logged")):
        vals = [r[i] for r in rows]
        print(f"| {name} | {statistics.median(vals):.3f} | {max(vals):.3f} |")
    return 0


def _task_round(ask, iterations):
    """One check (every test, every rank), one relink of rank 1 to 127.0.0.2 and back: seconds."""
    row = {}
    start = min(iterations())
    r = ask("check", params={"tests": ["gemm", "memory", "p2p", "allreduce"], "budget_s": 120.0}).result
    row["check: pause window (request -> verdict)"] = r["pause_seconds"]
    row["check: on the ranks (slowest)"] = r["seconds"]
    for test in ("gemm", "memory", "p2p", "allreduce"):
        row[f"check: {test} (slowest rank)"] = max(v["tests"][test]["seconds"] for v in r["ranks"].values()
                                                   if test in v["tests"])
    for what, params in (("relink", {"ranks": [1], "addr": "127.0.0.2"}), ("relink --back", {"ranks": [1],
                                                                                          "back": True})):
        while min(iterations()) < start + 2:  # trains on between two tasks
            time.sleep(0.05)
        start = min(iterations())
        r = ask("relink", params={**params, "budget_s": 120.0}).result
        row[f"{what}: pause window"] = r["pause_seconds"]
        row[f"{what}: rebuild (slowest rank)"] = max(v["rebuild_seconds"] for v in r["ranks"].values())
    while min(iterations()) < start + 2:
        time.sleep(0.05)
    return row


if __name__ == "__main__":
    sys.exit(main())
