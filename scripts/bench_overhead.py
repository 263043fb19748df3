#!/usr/bin/env python
"""Healthy-iteration overhead of mindspeed-ha: HA on vs HA off, side by side.

Runs the same megatron-core GPT (same seed, same launcher, same machine) alternately
with and without ``--enable-high-availability`` (``--ha-replica-count 2`` by default),
``--pairs`` times, and compares the median seconds per iteration (first ``--warmup``
iterations dropped). Alternating pairs keeps slow drift of a noisy machine out of the
ratio. Prints a table and the ratio on/off. ``--no-commit`` adds a third run per pair,
HA on with in-place recovery off (``--ha-network-retries 0``, no UCE repair), which
skips the optimizer update's commit barrier (one world all-reduce of one int32 per
iteration, see patches/optimizer.py): the barrier's cost is on / no-commit.

    python scripts/bench_overhead.py [--tp 1 --pp 1 --iters 40 --pairs 3 --hidden-size 128]
"""

import argparse
import statistics
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--no-commit", action="store_true", help="also run HA on without the commit barrier")
    ns = ap.parse_args()
    from mindspeed_ha.testing.harness import launch, launcher_command, tiny_gpt_args

    launcher = launcher_command(ns.nproc)
    base = tiny_gpt_args(tp=ns.tp, pp=ns.pp, train_iters=ns.iters, hidden_size=ns.hidden_size, log_interval=ns.iters)
    ha = ["--enable-high-availability", "--ha-replica-count", str(ns.replicas)]
    modes = ("off", "on", "no-commit") if ns.no_commit else ("off", "on")
    times = {m: [] for m in modes}
    losses = {}
    for pair in range(ns.pairs):
        for mode in modes:
            extra = ha + ["--ha-controller-port", "0"] if mode != "off" else []
            if mode == "no-commit":
                extra += ["--ha-network-retries", "0"]
            r = launch(ns.nproc, base + extra, launcher=launcher, timeout_s=1200)
            if r.returncode != 0:
                print(r.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{mode} run failed")
            per_iter = [rec["elapsed_s"] for rec in r.records() if rec["iteration"] > ns.warmup]
            times[mode].append(statistics.median(per_iter))
            losses[mode] = r.losses
            print(f"pair {pair + 1}: HA {mode:9} median {times[mode][-1] * 1e3:7.2f} ms/iteration", flush=True)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"\nTP{ns.tp} PP{ns.pp} DP{ns.nproc // (ns.tp * ns.pp)}, hidden {ns.hidden_size}, "
          f"{ns.iters} iterations x {ns.pairs} pairs, N={ns.replicas}")
    print(f"{'mode':8} {'median ms/iter':>15}")
    print(f"{'HA off':8} {off * 1e3:15.2f}")
    print(f"{'HA on':8} {on * 1e3:15.2f}")
    if ns.no_commit:
        nc = statistics.median(times["no-commit"])
        print(f"{'HA on, no commit barrier':8} {nc * 1e3:15.2f}")
        print(f"commit barrier: on / no-commit = {on / nc:.3f}")
    print(f"ratio on/off: {on / off:.3f}   losses identical: {losses['on'] == losses['off']}")


if __name__ == "__main__":
    main()
