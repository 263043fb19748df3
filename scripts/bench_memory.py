#!/usr/bin/env python
"""Optimizer memory per parameter, measured vs the formula, with and without replicas.

Launches a real 4-rank (DP4, bf16, distributed optimizer) megatron-core run per
configuration, counts on every rank the bytes of model params, DDP grad buffers, fp32
main params and Adam moments after one step, and divides by the rank's parameter
count. Prints a table; the formula is Megatron-LM's (see mindspeed_ha.replica.MemoryModel).

    python scripts/bench_memory.py [--hidden-size 256] [--nproc 4]
"""

from mindspeed_ha import env as ha_env
import argparse
import glob
import json
import os
import shutil
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(nproc, extra, hidden):
    from mindspeed_ha.testing.harness import launcher_command, tiny_gpt_args

    out = tempfile.mkdtemp(prefix="msha_mem_")
    args = tiny_gpt_args(train_iters=2, hidden_size=hidden, bf16=True) + extra
    cmd = launcher_command(nproc) + ["--log-dir", os.path.join(out, "torchrun"),
                                     os.path.join(HERE, "_memory_probe.py"), *args]
    env = dict(os.environ, **{ha_env.BENCH_OUT: out}, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        raise SystemExit(f"probe failed ({r.returncode}):\n{r.stderr[-4000:]}")
    rows = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "rank*.json")))]
    shutil.rmtree(out, ignore_errors=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--hidden-size", type=int, default=256)
    ns = ap.parse_args()
    from mindspeed_ha.replica import MemoryModel

    configs = [("HA off (N=1)", []),
               ("HA on, no replica (N=1)", ["--enable-high-availability", "--distributed-optimizer-no-replica"]),
               ("HA on, N=2", ["--enable-high-availability", "--ha-replica-count", "2"])]
    if ns.nproc >= 4:
        configs.append(("HA on, N=4", ["--enable-high-availability", "--ha-replica-count", str(ns.nproc)]))
    print(f"DP{ns.nproc}, bf16 params, fp32 grads (Megatron-LM's bf16 default), distributed optimizer, "
          f"hidden {ns.hidden_size}")
    print(f"{'config':26} {'N':>2} {'params/rank':>11} {'model':>6} {'grads':>6} {'main':>6} {'moments':>7} "
          f"{'total B/param':>13} {'formula 6+12N/d':>15}")
    for name, extra in configs:
        extra = extra + (["--ha-controller-port", "0"] if extra else [])
        rows = measure(ns.nproc, extra, ns.hidden_size)
        r = rows[0]
        n = r["params"]
        per = {k: r[k] / n for k in ("model_bytes", "grad_bytes", "main_param_bytes", "moment_bytes")}
        total = sum(per.values())
        formula = MemoryModel(r["dp"], r["replicas"], True, True, fp32_grads=True).bytes_per_param()
        print(f"{name:26} {r['replicas']:>2} {n:>11} {per['model_bytes']:6.2f} {per['grad_bytes']:6.2f} "
              f"{per['main_param_bytes']:6.2f} {per['moment_bytes']:7.2f} {total:13.3f} {formula:15.3f}")


if __name__ == "__main__":
    main()
