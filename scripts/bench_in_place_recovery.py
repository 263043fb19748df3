"""In-place recovery vs a full job restart, side by side in one run (4 CPU ranks, gloo).

For each fault (UCE at forward on rank 0 with --enable-hbmfault-repair; a UCE inside the
optimizer update of rank 1, recovered by a roll forward; a network error inside the
grad-sync collective of rank 1) the tiny GPT (TP1 PP2 DP2, 2 optimizer
replicas) runs K+2 iterations with the fault in iteration K, through mindspeed-ha-run.
Phases: ``mindspeed_ha.phases.in_place_phases`` with ``stop`` split into ``freeze``
(evidence -> ABORT sent) and ``abort+park+plan`` (-> plan sent), from the injector's log
(fault raised, wall clock), the controller's report (evidence, abort, plan sent, wall clock)
and each rank's RETRY result (its stage seconds); "first iteration after" ends when the
last rank finished the re-run iteration (for the roll forward: the iteration whose update
was interrupted; it has no rollback stage, shown as 0).

The full restart it is compared with: the same job started again with ``--load`` of the
periodic checkpoint of iteration K-1 (saved by a first run with --save-interval K-1) and
``--train-iters K``: process start, imports, init, model build, checkpoint load and the
one iteration, until the launcher returns (what a restart costs at the least, before the
steps since the checkpoint are redone; measured as the launcher's wall time).

    python scripts/bench_in_place_recovery.py [--repeat 2]
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

from mindspeed_ha.phases import RunLogs, in_place_phases  # noqa: E402
from mindspeed_ha.testing.harness import launch, launcher_command, time_full_restart, tiny_gpt_args  # noqa: E402

K = 4
ITERS = K + 2
FAULTS = {"uce": "rank=0,iteration={k},point=forward,fault=uce,what=param",
          "uce-update": "rank=1,iteration={k},point=optimizer,fault=uce,what=exp_avg",
          "network": "rank=1,iteration={k},point=grad_sync,fault=network"}


def _args(*extra):
    return tiny_gpt_args(tp=1, pp=2, train_iters=ITERS) + ["--enable-high-availability", "--enable-hbmfault-repair",
                                                         "--ha-controller-port", "0", *extra]


def in_place(workdir: str, fault: str) -> dict:
    fired, after, report = (os.path.join(workdir, f"{fault}-{n}") for n in ("fired.jsonl", "after.jsonl", "report.json"))
    for p in (fired, after, report):
        if os.path.exists(p):
            os.remove(p)
    r = launch(4, _args(), launcher=launcher_command(4), timeout_s=600,
               env={ha_env.INJECT: FAULTS[fault].format(k=K), ha_env.INJECT_LOG: fired,
                    ha_env.RECOVERY_LOG: after, ha_env.REPORT: report})
    if r.returncode != 0:
        raise SystemExit(f"{fault}: the run failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    logs = RunLogs.read(report, fired, after)
    if not logs.recoveries:
        raise SystemExit(f"{fault}: the controller's report has no recovery")
    out = in_place_phases(logs.report, logs.fault_wall, logs.first_after_wall, split_stop=True)
    missing = [k for k in ("detect", "freeze", "abort+park+plan", "first_iteration_after", "total") if out[k] is None]
    if missing:
        raise SystemExit(f"{fault}: phases {missing} missing: {out}")
    # a stage no rank ran (the roll forward has no rollback) costs nothing
    return {k: 0.0 if v is None else v for k, v in out.items()}


def restart(workdir: str) -> float:
    return time_full_restart(_args(), K, workdir)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=2)
    ns = p.parse_args()
    rows = {f: [] for f in FAULTS}
    restarts = []
    with tempfile.TemporaryDirectory(prefix="bench_in_place_") as workdir:
        for _ in range(ns.repeat):  # interleaved: the machine's load hits every kind alike
            for fault in FAULTS:
                rows[fault].append(in_place(workdir, fault))
            restarts.append(restart(workdir))
    med_restart = statistics.median(restarts)
    phases = list(next(iter(rows.values()))[0])
    print(f"\nIn-place recovery, TP1 PP2 DP2 (2 replicas), tiny GPT, 4 CPU ranks; medians of {ns.repeat} (seconds)")
    print(f"{'phase':<24}" + "".join(f"{f:>12}" for f in FAULTS))
    for ph in phases:
        print(f"{ph:<24}" + "".join(f"{statistics.median(r[ph] for r in rows[f]):12.3f}" for f in FAULTS))
    print(f"{'full restart (--load)':<24}" + "".join(f"{med_restart:12.3f}" for _ in FAULTS))
    print(f"{'ratio total / restart':<24}" + "".join(
        f"{statistics.median(r['total'] for r in rows[f]) / med_restart:12.3f}" for f in FAULTS))
    print(f"\nfull restarts measured: {', '.join(f'{t:.2f}' for t in restarts)} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
