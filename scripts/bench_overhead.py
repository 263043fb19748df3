#!/usr/bin/env python
"""Healthy-iteration overhead of mindspeed-ha: HA on vs HA off, side by side.

Runs the same megatron-core GPT (same seed, same launcher, same machine) alternately
with and without ``--enable-high-availability`` (``--ha-replica-count 2`` by default),
``--pairs`` times, and compares the median seconds per iteration (first ``--warmup``
iterations dropped). Alternating pairs keeps slow drift of a noisy machine out of the
ratio. Prints a table and the ratio on/off.

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
    ns = ap.parse_args()
    from mindspeed_ha.testing.harness import launch, launcher_command, tiny_gpt_args

    launcher = launcher_command(ns.nproc)
    base = tiny_gpt_args(tp=ns.tp, pp=ns.pp, train_iters=ns.iters, hidden_size=ns.hidden_size, log_interval=ns.iters)
    ha = ["--enable-high-availability", "--ha-replica-count", str(ns.replicas)]
    times = {"off": [], "on": []}
    losses = {}
    for pair in range(ns.pairs):
        for mode in ("off", "on"):
            extra = ha + ["--ha-controller-port", "0"] if mode == "on" else []
            r = launch(ns.nproc, base + extra, launcher=launcher, timeout_s=1200)
            if r.returncode != 0:
                print(r.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{mode} run failed")
            per_iter = [rec["elapsed_s"] for rec in r.records() if rec["iteration"] > ns.warmup]
            times[mode].append(statistics.median(per_iter))
            losses[mode] = r.losses
            print(f"pair {pair + 1}: HA {mode:3} median {times[mode][-1] * 1e3:7.2f} ms/iteration", flush=True)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"\nTP{ns.tp} PP{ns.pp} DP{ns.nproc // (ns.tp * ns.pp)}, hidden {ns.hidden_size}, "
          f"{ns.iters} iterations x {ns.pairs} pairs, N={ns.replicas}")
    print(f"{'mode':8} {'median ms/iter':>15}")
    print(f"{'HA off':8} {off * 1e3:15.2f}")
    print(f"{'HA on':8} {on * 1e3:15.2f}")
    print(f"ratio on/off: {on / off:.3f}   losses identical: {losses['on'] == losses['off']}")


if __name__ == "__main__":
    main()
