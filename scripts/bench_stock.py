#!/usr/bin/env python
"""Megatron-LM's own pretrain_gpt.py with mindspeed-ha: start-up and healthy-iteration cost.

Runs stock ``pretrain_gpt.py`` (core_v0.12.1, unmodified; unpacked from the tarball or an
existing checkout) on 4 CPU/gloo ranks through ``mindspeed-ha-run``, alternately with every
HA flag off and with ``--enable-high-availability`` (2 optimizer replicas), ``--pairs``
times, and reports side by side from the same machine in one run:

* time to first iteration: launcher start -> end of iteration 1 (the ``testing.loss_log``
  timestamps, rank 0);
* median seconds per iteration after ``--warmup`` iterations (consecutive step ends on
  rank 0);
* the ratio HA on / HA off for both, and whether the losses were bitwise identical.

    python scripts/bench_stock.py [--megatron-lm DIR | --tarball FILE] [--pp 2 --tp 1 --iters 40 --pairs 2]
"""

from mindspeed_ha import env as ha_env
import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TARBALL = os.path.join(HERE, "..", "..", "shared", "third_party", "Megatron-LM-core_v0.12.1.tar.gz")


def _one(root, args, env):
    from mindspeed_ha.testing import megatron_lm as mlm

    start = time.time()
    r = mlm.launch_stock(root, args, env=env, timeout_s=1800)
    if r.returncode != 0:
        print(r.stderr[-3000:], file=sys.stderr)
        raise SystemExit("run failed")
    rows = sorted((rec for rec in r.records() if rec["rank"] == 0), key=lambda rec: rec["iteration"])
    first = rows[0]["time"] - start
    return first, rows, r.losses


def compare_pairs(run, pairs, warmup):
    """``run(mode)`` -> ``(seconds to iteration 1, the logging rank's records, losses)`` for
    ``mode`` "off" then "on", ``pairs`` times; returns ``(first, step, losses)``: per mode the
    seconds to iteration 1, the median seconds per iteration after ``warmup``, the losses."""
    first = {"off": [], "on": []}
    step = {"off": [], "on": []}
    losses = {}
    for pair in range(pairs):
        for mode in ("off", "on"):
            t_first, rows, losses[mode] = run(mode)
            deltas = [b["time"] - a["time"] for a, b in zip(rows, rows[1:]) if a["iteration"] >= warmup]
            first[mode].append(t_first)
            step[mode].append(statistics.median(deltas))
            print(f"pair {pair + 1}: HA {mode:3}  first iteration after {t_first:6.2f} s, "
                  f"median {step[mode][-1] * 1e3:7.2f} ms/iteration", flush=True)
    return first, step, losses


def print_comparison(title, first, step, losses):
    """The HA off / on table of :func:`compare_pairs`' results (medians over the pairs)."""
    f_off, f_on = statistics.median(first["off"]), statistics.median(first["on"])
    s_off, s_on = statistics.median(step["off"]), statistics.median(step["on"])
    print(f"\n{title}")
    print(f"{'':24} {'HA off':>10} {'HA on':>10} {'on/off':>8}")
    print(f"{'time to iteration 1 (s)':24} {f_off:10.2f} {f_on:10.2f} {f_on / f_off:8.3f}")
    print(f"{'ms per iteration':24} {s_off * 1e3:10.2f} {s_on * 1e3:10.2f} {s_on / s_off:8.3f}")
    print(f"losses bitwise identical: {losses['on'] == losses['off']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron-lm", help="an existing Megatron-LM core_v0.12.1 checkout")
    ap.add_argument("--tarball", default=DEFAULT_TARBALL)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=2)
    ns = ap.parse_args()
    from mindspeed_ha.testing import megatron_lm as mlm

    with tempfile.TemporaryDirectory(prefix="bench_stock_") as tmp:
        root = ns.megatron_lm or mlm.unpack(ns.tarball, tmp)
        env = {ha_env.CACHE: os.path.join(tmp, "cache")}
        base = mlm.stock_gpt_args(tp=ns.tp, pp=ns.pp, train_iters=ns.iters)
        ha = ["--enable-high-availability", "--ha-controller-port", "0"]
        # Warm-up run, not counted: builds Megatron's dataset helpers into the cache and
        # warms the page cache, so both modes start from the same state.
        _one(root, mlm.stock_gpt_args(tp=ns.tp, pp=ns.pp, train_iters=4), env)
        results = compare_pairs(lambda mode: _one(root, base + (ha if mode == "on" else []), env), ns.pairs,
                                ns.warmup)
    print_comparison(f"stock pretrain_gpt.py, TP{ns.tp} PP{ns.pp} DP{4 // (ns.tp * ns.pp)}, 4 gloo ranks, "
                     f"{ns.iters} iterations x {ns.pairs} pairs (HA on: 2 optimizer replicas)", *results)


if __name__ == "__main__":
    main()
