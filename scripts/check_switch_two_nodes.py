#!/usr/bin/env python
"""Hot switch of a rank of the node without the controller, by hand, in a longer job than CI's
(CI: ``tests/test_two_nodes.py``, the stale-lease job, rank 3 switched while rank 0 holds).

Two ``mindspeed-ha-run`` launchers on loopback (tests' ``TwoNodeJob``: TP2 PP1 DP2, the
controller in node 0's launcher, ``--enable-worker-reboot``, ``MINDSPEED_HA_WARM_SPARES=1``
on both), rank 2's first process sleeping 0.3 s per iteration (the injector's ``slow``: no
effect on the numbers) so that training outlasts the switch. Once both nodes reported a
warm spare, ``switch --ranks 3``: node 1's agent starts the new process from its spare
(SWITCH_VIEW over its agent link). Prints the reply, the PIDs before and after, both
launchers' exit codes and whether the losses equal an uninterrupted run's bit for bit;
exit 0 when all of that holds.

    PYTHONPATH=. python scripts/check_switch_two_nodes.py [--iters 150] [--rank 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

from mindspeed_ha.control import operator
from mindspeed_ha.testing.harness import Baselines, TwoNodeJob, four_rank_args

SLOW = "rank=2,iteration=1,point=between,fault=slow,sleep=0.3"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=150)
    ap.add_argument("--rank", type=int, default=3, help="the global rank to switch (2 and 3 are node 1's)")
    ns = ap.parse_args(argv)
    args = four_rank_args("tp2pp1", ns.iters, "--enable-worker-reboot")
    args[args.index("--ha-controller-port") + 1] = "0"
    poll = threading.Event()  # never set: its wait() is the poll interval
    with TwoNodeJob(args, env={"MINDSPEED_HA_WARM_SPARES": "1", "MINDSPEED_HA_INJECT": SLOW}) as job:
        n0, n1 = job.start(0), job.start(1)
        key = bytes.fromhex(job.env["MINDSPEED_HA_AUTH_KEY"])
        target = operator.Target("127.0.0.1", job.controller_port)

        def ask(verb, **kw):
            kw.setdefault("timeout_s", 30.0)
            return operator.request(verb, key=key, target=target, env={}, **kw)

        def status_until(cond):
            while True:
                if n0.poll() is not None or n1.poll() is not None:
                    raise RuntimeError(f"a launcher ended: {n0.poll()}, {n1.poll()}")
                try:
                    s = ask("status").result
                except operator.OperatorError:
                    s = None
                if s is not None and cond(s):
                    return s
                poll.wait(0.5)

        s = status_until(lambda s: len(s["ranks"]) == 4 and min(r.get("iteration", -1) for r in s["ranks"]) >= 2
                         and len({sp.get("node", "local") for sp in s.get("spares") or ()}) == 2)
        before = [r["pid"] for r in s["ranks"]]
        reply = ask("switch", params={"ranks": [ns.rank]}, timeout_s=300.0)
        print("switch:", reply.code, reply.detail, json.dumps(reply.result), flush=True)
        k = (reply.result or {}).get("iteration") or 0
        s = status_until(lambda s: not s.get("switching") and min(r.get("iteration", -1) for r in s["ranks"]) >= k + 2)
        after = [r["pid"] for r in s["ranks"]]
        print("pids before", before, "after", after, flush=True)
        codes = (job.wait(n0, 600), job.wait(n1, 600))
        print("launchers' exit codes", codes, flush=True)
        losses = job.losses()
    base = Baselines(lambda layout: four_rank_args(layout, ns.iters, "--enable-worker-reboot"), ns.iters).get(
        "tp2pp1")
    equal = losses == base and len(losses) == ns.iters
    print("losses bitwise equal to the uninterrupted run:", equal)
    changed = [r for r, (a, b) in enumerate(zip(before, after)) if a != b]
    ok = reply.code == 0 and codes == (0, 0) and equal and changed == [ns.rank]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
