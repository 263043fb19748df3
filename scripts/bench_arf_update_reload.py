#!/usr/bin/env python
"""Worker restart in place (ARF) in the two cases added on 2026-12-01, phase by phase (4 CPU
ranks, gloo, the tiny GPT TP1 PP2 DP2 through ``mindspeed-ha-run --enable-worker-reboot``):

* ``update``: rank 1 SIGKILLed inside the optimizer update of iteration K (2 optimizer
  replicas): roll forward with rejoin (the new process receives the finished update of K
  from its replica, rank 0, and runs a catch-up step K with the survivors);
* ``no-replica``: rank 1 SIGKILLed at backward of iteration K with
  ``--distributed-optimizer-no-replica --save-interval 2``: every rank reloads the periodic
  checkpoint of K-2 (the restarted one at its rejoin point) and re-runs K-1 silently, then K.

Phases as in ``scripts/bench_worker_restart.py`` (``mindspeed_ha.phases.reboot_phases``:
detect, restart_process, rendezvous, rebuild_groups, repair, first_iteration_after, total),
plus each rank's own stage seconds from its RETRY result (``reload``: the checkpoint load
in place; the silent re-runs are inside ``first_iteration_after``).

    python scripts/bench_arf_update_reload.py [--repeat 1]
"""

from __future__ import annotations

from mindspeed_ha import env as ha_env
import argparse
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mindspeed_ha.phases import RunLogs, reboot_phases, slowest_stages  # noqa: E402
from mindspeed_ha.testing.harness import launch, launcher_command, tiny_gpt_args  # noqa: E402

K = 4
ITERS = K + 1
CASES = {
    "update": ([], f"rank=1,iteration={K},point=optimizer,fault=kill", "forward"),
    "no-replica": (["--distributed-optimizer-no-replica", "--save-interval", "2"],
                   f"rank=1,iteration={K},point=backward,fault=kill", "reload"),
}


def run(case: str, workdir: str) -> dict:
    extra, inject, mode = CASES[case]
    fired, after, report = (os.path.join(workdir, f"{case}-{n}") for n in ("fired.jsonl", "after.jsonl", "report.json"))
    for p in (fired, after, report):
        if os.path.exists(p):
            os.remove(p)
    args = tiny_gpt_args(tp=1, pp=2, train_iters=ITERS) + [
        "--enable-high-availability", "--ha-controller-port", "0", "--enable-worker-reboot",
        "--save", os.path.join(workdir, f"{case}-ckpt"), *extra]
    r = launch(4, args, launcher=launcher_command(4), timeout_s=600,
               env={ha_env.INJECT: inject, ha_env.INJECT_LOG: fired,
                    ha_env.RECOVERY_LOG: after, ha_env.REPORT: report})
    if r.returncode != 0:
        raise SystemExit(f"{case}: run failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    logs = RunLogs.read(report, fired, after)
    recs = logs.recoveries
    if [e["rank"] for e in logs.restarts] != [1] or len(recs) != 1 or recs[0].get("mode") != mode:
        raise SystemExit(f"{case}: not one {mode} recovery of rank 1: {logs.restarts}, {recs}")
    out = reboot_phases(logs.report, logs.fault_wall, logs.first_after_wall)
    stages = slowest_stages(recs[0], ("clean", "rebuild", "reload", "repair", "rollback"))
    out.update({f"rank max {k}": v for k, v in stages.items() if v is not None})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=1)
    ns = p.parse_args()
    rows = {c: [] for c in CASES}
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_arf_update_reload_") as workdir:
        for _ in range(ns.repeat):
            for case in CASES:
                rows[case].append(run(case, workdir))
    keys = []
    for case in CASES:
        for row in rows[case]:
            keys += [k for k in row if k not in keys]
    print(f"ARF phases, seconds (median of {ns.repeat}; load average at start {load[0]:.1f})")
    print(f"| phase | {' | '.join(CASES)} |")
    print(f"|---|{'---|' * len(CASES)}")
    for k in keys:
        cells = []
        for case in CASES:
            vals = [row[k] for row in rows[case] if row.get(k) is not None]
            cells.append(f"{statistics.median(vals):.3f}" if vals else "-")
        print(f"| {k} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
