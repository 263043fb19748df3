#!/usr/bin/env python
"""MindSpeed-LLM's own pretrain_gpt.py with mindspeed-ha: start-up and healthy-iteration cost.

Runs MindSpeed-LLM 2.3.0's ``pretrain_gpt.py`` (with MindSpeed 2.3.0_core_r0.12.1 and
Megatron-LM core_v0.12.1, unmodified, unpacked from ../shared/third_party) on 4 CPU/gloo
ranks through ``mindspeed-ha-run``, with the arguments of
``scripts/pretrain_llama2_7b_ptd_mindspeed_llm.sh`` at ``TINY=1 CPU=1`` (the project's
``tests/npu_double`` stands in for torch_npu), alternately with the guide's four HA flags
removed (off) and as given (on: no replica, UCE repair, worker reboot), ``--pairs`` times,
and reports side by side from the same machine in one run:

* time to first iteration: launcher start -> end of iteration 1 (``testing.loss_log``
  timestamps, the first rank that logs);
* median seconds per iteration after ``--warmup`` iterations;
* the ratio on / off for both, and whether the losses were bitwise identical.

    python scripts/bench_mindspeed_llm.py [--tp 1 --pp 2 --iters 30 --pairs 1]
"""

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SHARED = next((p for p in (os.path.join(REPO, d, 'shared', 'third_party') for d in ('..', os.path.join('..', '..'))) if os.path.isdir(p)), os.path.join(REPO, '..', 'shared', 'third_party'))
SCRIPT = os.path.join(HERE, "pretrain_llama2_7b_ptd_mindspeed_llm.sh")
NPU_DOUBLE = os.path.join(REPO, "tests", "npu_double")
sys.path.insert(0, HERE)
from bench_stock import compare_pairs, print_comparison  # noqa: E402  (the same pairs and table)


def script_args(tp, pp, iters):
    env = dict(os.environ, DRY_RUN="1", TINY="1", CPU="1", TP=str(tp), PP=str(pp), TRAIN_ITERS=str(iters))
    out = subprocess.run(["bash", SCRIPT], env=env, capture_output=True, text=True, check=True).stdout
    argv = shlex.split(out)
    argv = argv[next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py")) + 1:]
    drop = {"--load", "--save"}
    keep, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in drop:
            skip = True
        else:
            keep.append(a)
    return keep + ["--eval-iters", "0"]


def _one(roots, args, env):
    from mindspeed_ha.testing import mindspeed_llm as msl

    start = time.time()
    r = msl.launch(roots, args, extra_path=[NPU_DOUBLE], env_extra=env, timeout_s=1800)
    if r.returncode != 0:
        print((r.stdout + r.stderr)[-3000:], file=sys.stderr)
        raise SystemExit("run failed")
    logger = min(rec["rank"] for rec in r.records())
    rows = sorted((rec for rec in r.records() if rec["rank"] == logger), key=lambda rec: rec["iteration"])
    return rows[0]["time"] - start, rows, r.losses


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=1)
    ns = ap.parse_args()
    from mindspeed_ha import env as ha_env
    from mindspeed_ha.testing import mindspeed_llm as msl

    ha_flags = list(msl.HA_FLAGS)
    with tempfile.TemporaryDirectory(prefix="bench_mindspeed_llm_") as tmp:
        roots = msl.unpack({k: os.path.join(SHARED, n) for k, n in msl.TARBALLS.items()}, tmp)
        env = {ha_env.CACHE: os.path.join(tmp, "cache")}
        on = script_args(ns.tp, ns.pp, ns.iters) + ["--ha-controller-port", "0"]
        off = [a for a in on if a not in ha_flags][:-2]
        _one(roots, [a for a in script_args(ns.tp, ns.pp, 2) if a not in ha_flags], env)  # warm-up, not counted
        results = compare_pairs(lambda mode: _one(roots, on if mode == "on" else off, env), ns.pairs, ns.warmup)
    print_comparison(f"MindSpeed-LLM pretrain_gpt.py, TP{ns.tp} PP{ns.pp} DP{4 // (ns.tp * ns.pp)}, 4 gloo ranks, "
                     f"bf16, {ns.iters} iterations x {ns.pairs} pairs (HA on: the guide's four flags)", *results)

if __name__ == "__main__":
    main()
