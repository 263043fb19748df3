#!/usr/bin/env python
"""Workers started by torchrun vs forked by the fork server (``MINDSPEED_HA_FORKSERVER=1``):
CPU seconds of a whole job and its wall time, Megatron-LM's own pretrain_gpt.py (unpacked
from a core_v0.12.1 tarball to a temp dir, unmodified) on 4 CPU/gloo ranks, TP1 PP2 DP2,
8 iterations, HA on, through ``mindspeed-ha-run``. The two kinds alternate, ``--rounds``
times each, in one run; CPU is the job's (launcher, fork server, workers: RUSAGE_CHILDREN
of this process), so it does not depend on what else the machine runs; wall does.
nvidia-modelopt is measured as it is installed (``--hide-modelopt`` hides it as the test
suite does, see tests/conftest.py).

    python scripts/bench_forkserver.py --megatron-lm-tarball PATH [--rounds 3] [--hide-modelopt]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mindspeed_ha.testing import megatron_lm as mlm  # noqa: E402


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def one_job(root: str, forked: bool) -> dict:
    """CPU seconds and wall seconds of one job; raises RuntimeError when it failed."""
    os.environ["MINDSPEED_HA_FORKSERVER"] = "1" if forked else "0"
    args = mlm.stock_gpt_args(tp=1, pp=2, train_iters=8, ckpt_format="torch", enable_high_availability=True,
                              ha_controller_port=0)
    cpu0, t0 = _children_cpu(), time.monotonic()
    r = mlm.launch_stock(root, args)
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    if r.returncode != 0 or sorted(r.losses) != list(range(1, 9)):
        raise RuntimeError(f"job failed (exit {r.returncode}): {r.stderr[-2000:]}")
    return {"cpu": cpu, "wall": wall, "losses": r.losses}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megatron-lm-tarball", required=True, help="Megatron-LM core_v0.12.1 tarball")
    ap.add_argument("--rounds", type=int, default=3, help="jobs of each kind (>= 1)")
    ap.add_argument("--hide-modelopt", action="store_true", help="hide nvidia-modelopt as the test suite does")
    ns = ap.parse_args()
    if ns.rounds < 1:
        ap.error("--rounds: at least 1")
    if ns.hide_modelopt:
        hidden = os.path.join(REPO, "tests", "_hidden")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (hidden, os.environ.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="bench_forkserver.") as tmp:
        root = mlm.unpack(ns.megatron_lm_tarball, tmp)
        rows = {False: [], True: []}
        for _ in range(ns.rounds):
            for forked in (False, True):
                rows[forked].append(one_job(root, forked))
        if any(r["losses"] != rows[False][0]["losses"] for rs in rows.values() for r in rs):
            print("losses differ between the runs", file=sys.stderr)
            return 1
    print(f"4-rank stock pretrain_gpt.py job, 8 iterations, {ns.rounds} rounds, modelopt "
          f"{'hidden' if ns.hide_modelopt else 'as installed'}; load average {os.getloadavg()[0]:.1f}")
    print("| workers | job CPU s (median) | job wall s (median) |")
    print("|---|---|---|")
    for forked, name in ((False, "torchrun (Popen)"), (True, "fork server")):
        print(f"| {name} | {statistics.median(r['cpu'] for r in rows[forked]):.1f} | "
              f"{statistics.median(r['wall'] for r in rows[forked]):.1f} |")
    ratio = statistics.median(r["cpu"] for r in rows[True]) / statistics.median(r["cpu"] for r in rows[False])
    print(f"CPU ratio fork server / torchrun: {ratio:.2f}; losses bitwise equal across all {2 * ns.rounds} jobs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
