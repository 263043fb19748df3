"""Worker restart in place (ARF, ``--enable-worker-reboot``) vs a full job restart, side by
side in one run (4 CPU ranks, gloo).

The tiny GPT (TP1 PP2 DP2, 2 optimizer replicas) runs K+2 iterations through
mindspeed-ha-run; rank 1 SIGKILLs itself at backward of iteration K. The launcher's agent
restarts that process alone; it replays its start-up, parks at its rejoin point, every rank
rebuilds its groups, the new process receives its state from a replica and every rank
re-runs iteration K. Phases (``mindspeed_ha.phases.reboot_phases``, which computes them):
detect (SIGKILL -> controller evidence), restart_process (-> the agent started the new
process), rendezvous (-> RETRY sent: mostly the new process's own start-up up to its rejoin
point; the controller's retry time is the proxy), rebuild_groups / repair / rollback (the
slowest rank's stage), first_iteration_after (RETRY -> the re-run iteration done on every
rank; contains the three stages), total (SIGKILL -> that). Sources: the injector's log, the
controller's report (``recoveries``, ``restarts``) and the recovery log (wall clocks).

The full restart it is compared with (the method of bench_in_place_recovery.py): the same
job started again with ``--load`` of the periodic checkpoint of iteration K-1 (saved once by
a first run with --save-interval K-1 --exit-interval K-1) and ``--train-iters K``: process
start, imports, init, model build, checkpoint load and the one iteration, until the launcher
returns (a restart's least cost, before the steps since the checkpoint are redone).

``--warm-spare`` adds a third run per repeat, the same ARF with ``MINDSPEED_HA_WARM_SPARES=1``
(a pre-imported parked process per node takes the dead rank's place), interleaved with the
other two; the table then has a column per kind.

    python scripts/bench_worker_restart.py [--repeat 2] [--warm-spare]
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

from mindspeed_ha.phases import RunLogs, reboot_phases  # noqa: E402
from mindspeed_ha.testing.harness import launch, launcher_command, time_full_restart, tiny_gpt_args  # noqa: E402

K = 4
ITERS = K + 2
KILL = f"rank=1,iteration={K},point=backward,fault=kill"


def _args(*extra, reboot=True):
    return tiny_gpt_args(tp=1, pp=2, train_iters=ITERS) + [
        "--enable-high-availability", "--ha-controller-port", "0",
        *(["--enable-worker-reboot"] if reboot else []), *extra]


def arf(workdir: str, warm: bool = False) -> dict:
    fired, after, report = (os.path.join(workdir, n) for n in ("fired.jsonl", "after.jsonl", "report.json"))
    for p in (fired, after, report):
        if os.path.exists(p):
            os.remove(p)
    r = launch(4, _args(), launcher=launcher_command(4), timeout_s=600,
               env={ha_env.INJECT: KILL, ha_env.INJECT_LOG: fired,
                    ha_env.RECOVERY_LOG: after, ha_env.REPORT: report,
                    **({ha_env.WARM_SPARES: "1"} if warm else {})})
    if r.returncode != 0:
        raise SystemExit(f"ARF run failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    logs = RunLogs.read(report, fired, after, nproc=4)
    recs = logs.recoveries
    if [e["rank"] for e in logs.restarts] != [1] or len(recs) != 1 or recs[0].get("mode") != "rejoin":
        raise SystemExit(f"not one rejoin of rank 1: restarts {logs.restarts}, recoveries {recs}")
    if len(logs.recovered) != 4:
        raise SystemExit(f"the recovery log has {len(logs.recovered)} of 4 ranks")
    out = reboot_phases(logs.report, logs.fault_wall, logs.first_after_wall)
    if any(v is None for v in out.values()):
        raise SystemExit(f"a phase is missing: {out}")
    return out


def restart(workdir: str) -> float:
    return time_full_restart(_args(reboot=False), K, workdir)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--warm-spare", action="store_true", help="also ARF with MINDSPEED_HA_WARM_SPARES=1")
    ns = p.parse_args()
    kinds = ["cold", "warm spare"] if ns.warm_spare else ["cold"]
    rows = {k: [] for k in kinds}
    restarts = []
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_worker_restart_") as workdir:
        for _ in range(ns.repeat):  # interleaved: the machine's load hits every kind alike
            for kind in kinds:
                rows[kind].append(arf(workdir, warm=kind == "warm spare"))
            restarts.append(restart(workdir))
    med_restart = statistics.median(restarts)
    print(f"\nWorker restart in place (ARF), rank 1 SIGKILLed at backward of iteration {K}; TP1 PP2 DP2 "
          f"(2 replicas), tiny GPT, 4 CPU ranks; medians of {ns.repeat} (seconds)")
    print(f"{'phase':<28}" + "".join(f"{k:>14}" for k in kinds) + "   runs")
    for ph in rows["cold"][0]:
        print(f"{ph:<28}" + "".join(f"{statistics.median(r[ph] for r in rows[k]):14.3f}" for k in kinds) + "   "
              + " | ".join(", ".join(f"{r[ph]:.3f}" for r in rows[k]) for k in kinds))
    print(f"{'full restart (--load)':<28}" + "".join(f"{med_restart:14.3f}" for _ in kinds) + "   "
          + ", ".join(f"{t:.3f}" for t in restarts))
    print(f"{'ratio total / restart':<28}" + "".join(
        f"{statistics.median(r['total'] for r in rows[k]) / med_restart:14.3f}" for k in kinds)
          + "   (target <= 0.5; <= 0.2 with a warm spare)")
    print(f"\nload average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, at end "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
