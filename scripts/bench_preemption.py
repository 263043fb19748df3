#!/usr/bin/env python
"""Graceful stop (SIGTERM) and controller loss on a real 4-rank job: how long each takes.

For each scenario the fault injector sends the signal after iteration ``--at`` completed on
one rank (wall clock logged by the injector), and the run's controller report
(``MINDSPEED_HA_REPORT``) and the checkpoint tracker's modification time give:

* ``request``: signal -> the controller has the stop request (SIGTERM scenarios);
* ``drain``: request -> every rank paused after the agreed iteration (controller clock);
* ``save``: DUMP -> EXIT sent (dump, assemble, commit);
* ``signal->commit``: signal -> the tracker names the new checkpoint (wall clock; for
  ``controller_lost`` this includes noticing the loss, ``heartbeat_timeout_s / 2`` after
  the launcher died, plus the ranks' own agreement and save);
* ``iters after``: iterations completed after the signal (the drain finishes the one in
  progress; controller loss trains on until it is noticed).

Also the start-up cost of the gloo group the ranks keep for deciding without a controller
(``dist.new_group(backend="gloo")`` of every rank, max over ranks), which is the only cost
of controller-loss protection (nothing per iteration).

    python scripts/bench_preemption.py [--repeats 3 --heartbeat-timeout 2]
"""

from mindspeed_ha import env as ha_env
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SCENARIOS = {
    "sigterm_launcher": "rank=0,iteration={at},point=between,fault=term_launcher",
    "sigterm_worker": "rank=2,iteration={at},point=between,fault=term",
    "controller_lost": "rank=0,iteration={at},point=between,fault=kill_launcher",
}

GROUP_PROBE = r"""
import os, time, datetime, torch.distributed as dist
dist.init_process_group("gloo")
best = []
for _ in range(5):
    t = time.perf_counter()
    g = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    best.append(time.perf_counter() - t)
out = [None] * dist.get_world_size()
dist.all_gather_object(out, min(best))
if dist.get_rank() == 0:
    print("GROUP_S", max(out))
dist.destroy_process_group()
"""


def run_one(name, at, iters, hb_timeout, tmp):
    from mindspeed_ha.phases import preemption_phases
    from mindspeed_ha.testing.harness import launch, launcher_command, tiny_gpt_args

    save, report, inj = (os.path.join(tmp, x) for x in ("ckpt", "report.json", "inject.jsonl"))
    args = tiny_gpt_args(pp=2, train_iters=iters) + [
        "--enable-high-availability", "--ha-controller-port", "0", "--save", save,
        "--ha-heartbeat-interval", str(hb_timeout / 4), "--ha-heartbeat-timeout", str(hb_timeout)]
    r = launch(4, args, launcher=launcher_command(4), timeout_s=600, env={
        ha_env.INJECT: SCENARIOS[name].format(at=at), ha_env.INJECT_LOG: inj,
        ha_env.REPORT: report})
    with open(inj) as f:
        signal_wall = json.loads(f.readline())["wall"]
    tracker = os.path.join(save, "latest_checkpointed_iteration.txt")
    row = {"exit": r.returncode, "k": None}
    commit_wall = None
    if os.path.exists(tracker):
        with open(tracker) as f:
            row["k"] = int(f.read())
        commit_wall = os.path.getmtime(tracker)
    rep = None
    if os.path.exists(report) and name != "controller_lost":  # no controller, no report of its own
        with open(report) as f:
            rep = json.load(f)
    row.update(preemption_phases(rep, signal_wall, commit_wall))
    return row


def group_cost(nproc):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.py")
        with open(path, "w") as f:
            f.write(GROUP_PROBE)
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={nproc}", path], capture_output=True, text=True, timeout=300)
        for line in out.stdout.splitlines():
            if line.startswith("GROUP_S"):
                return float(line.split()[1])
    raise RuntimeError(out.stderr[-2000:])


def fmt(x, unit="s"):
    return "-" if x is None else (f"{x:.3f} {unit}" if isinstance(x, float) else str(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--at", type=int, default=3)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ns = ap.parse_args()
    print(f"4 ranks (TP1 PP2 DP2, N=2), tiny GPT, signal after iteration {ns.at}, heartbeat timeout "
          f"{ns.heartbeat_timeout} s; medians of {ns.repeats} runs\n")
    print(f"{'scenario':18} {'exit':>5} {'iters after':>11} {'request':>10} {'drain':>10} {'save':>10} "
          f"{'signal->commit':>15}")
    for name in ns.scenarios.split(","):
        rows = []
        for _ in range(ns.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                rows.append(run_one(name, ns.at, ns.iters, ns.heartbeat_timeout, tmp))

        def med(key):
            vals = [r[key] for r in rows if r[key] is not None]
            return statistics.median(vals) if vals else None
        exits = sorted({r["exit"] for r in rows})
        after = [r["k"] - ns.at for r in rows if r["k"] is not None]
        print(f"{name:18} {','.join(map(str, exits)):>5} {','.join(map(str, after)):>11} {fmt(med('request')):>10} "
              f"{fmt(med('drain')):>10} {fmt(med('save')):>10} {fmt(med('commit')):>15}")
    print(f"\nstart-up: dist.new_group(backend='gloo') of 4 ranks, max over ranks: {group_cost(4):.4f} s")


if __name__ == "__main__":
    main()
