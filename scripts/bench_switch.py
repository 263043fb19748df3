#!/usr/bin/env python
"""Hot switch on the tiny job: the pause window (paused -> resumed) and the phase seconds.

One 4-rank job (the built-in trainer, ``mindspeed-ha-run``, gloo, TP1 PP1 DP4,
``--enable-worker-reboot``, ``MINDSPEED_HA_WARM_SPARES=1``) meets ``--switches`` hot switches
in turn (ranks ``--ranks``, cycled), driven through the operator channel
(mindspeed_ha/testing/switch_job.py); each switch's reply carries the controller's phase
seconds: ``spare_ready`` (request -> the new process parked at its rejoin point: its
start-up, while training goes on), ``pause`` (-> every rank holds), ``rebuild`` and
``transfer`` (the slowest rank's own seconds), ``commit`` (the plan sent -> every answer),
``pause_window`` (paused -> resumed: what training waits) and ``total``.

    PYTHONPATH=. python scripts/bench_switch.py --switches 4 [--no-replica] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile

from mindspeed_ha.testing import switch_job

COLUMNS = ("spare_ready", "pause", "rebuild", "transfer", "commit", "pause_window", "total")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--switches", type=int, default=4, help="switches in the job (default 4)")
    p.add_argument("--ranks", default="1,0", help="ranks switched in turn (default 1,0)")
    p.add_argument("--no-replica", action="store_true", help="--distributed-optimizer-no-replica")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    ns = p.parse_args(argv)
    if ns.switches < 1:
        print("--switches: at least 1", file=sys.stderr)
        return 2
    ranks = [r.strip() for r in ns.ranks.split(",") if r.strip()]
    schedule = [ranks[i % len(ranks)] for i in range(ns.switches)]
    extra = ["--distributed-optimizer-no-replica"] if ns.no_replica else []
    d = tempfile.mkdtemp(prefix="bench_switch_")
    try:
        run = switch_job.run(d, schedule, train_iters=max(switch_job.TRAIN_ITERS, 300 * ns.switches),
                             extra_args=extra)
    except RuntimeError as exc:
        print(f"the job failed: {exc}; its logs are kept in {d}", file=sys.stderr)
        return 1
    if run.returncode != 0:
        print(f"the job failed (exit {run.returncode}), its logs are kept in {d}:\n{run.output[-4000:]}",
              file=sys.stderr)
        return 1
    shutil.rmtree(d)
    rows = []
    print(f"{'switch':>6} {'rank':>4} {'K':>5} " + " ".join(f"{c:>12}" for c in COLUMNS))
    for i, r in enumerate(run.replies, 1):
        res = r["result"]
        secs = res.get("phase_seconds", {})
        rows.append({"rank": r["entry"], "code": r["code"], "iteration": res.get("iteration"), **secs})
        print(f"{i:>6} {r['entry']:>4} {str(res.get('iteration')):>5} "
              + " ".join(f"{secs[c]:>12.3f}" if c in secs else f"{'-':>12}" for c in COLUMNS)
              + ("" if r["code"] == 0 else f"   code {r['code']}: {r['detail']}"))
    done = [row for row in rows if row["code"] == 0]
    if done:
        print("median " + " ".join(f"{c}={statistics.median(row[c] for row in done if c in row):.3f}s"
                                   for c in COLUMNS if all(c in row for row in done)))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"rows": rows, "no_replica": ns.no_replica}, f, indent=1)
    return 0 if len(done) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
