#!/usr/bin/env python
"""Dying checkpoint write rate against the disk's sequential rate, in one run.

Stock Megatron-LM ``pretrain_gpt.py`` (4 gloo ranks, TP1 PP2 DP2, 2 optimizer replicas,
hidden ``--hidden-size``: ~240 MB of checkpoint at 512) is killed in backward of
iteration 2; the controller's report gives the save phase (DUMP sent -> EXIT sent: the
savers' files, completion check or merge, validation, rename, tracker). Right after, ``dd
if=/dev/zero bs=4M conv=fsync`` writes the same number of bytes to the same directory,
three times; the fastest dd counts (the disk's best rate in the same run); then the
*floor*: the same bytes written by as many processes as there were savers, each its
equal part from memory (``pwrite`` 16 MiB + fsync, nothing else), three times, the
fastest counts: what any saver writing through the page cache could reach. Prints, per
``--ckpt-format``: the load average, checkpoint bytes, save seconds, MB/s, dd MB/s, the
ratio (goal ``GOAL_RATIO``), the floor and the ratios floor/dd, save/floor.

    python scripts/bench_dying_write.py [--megatron-lm DIR | --tarball FILE] [--hidden-size 512]
        [--repeat N] [--log-dir DIR]

Also prints, per run, the seconds between the controller's actions (DUMP -> ASSEMBLE ->
COMMIT -> EXIT) and each rank's own steps (from its action result).
"""

from mindspeed_ha import env as ha_env
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

#: dd runs after each killed run; the fastest counts (the disk's best rate in this run)
DD_RUNS = 3
#: the goal: dying checkpoint write rate / the disk's best dd rate (issue 21)
GOAL_RATIO = 0.7
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TARBALL = os.path.join(HERE, "..", "..", "shared", "third_party", "Megatron-LM-core_v0.12.1.tar.gz")


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(b, f)) for b, _, files in os.walk(path) for f in files)


def _dd_rate(directory, nbytes):
    target = os.path.join(directory, "dd.bin")
    count = max(1, nbytes // (4 << 20))
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={count}", "conv=fsync"],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - start
    os.remove(target)
    return count * (4 << 20) / seconds


def _primitive_rates(directory, nbytes=128 << 20):
    """Single-core rates (bytes/s) of what a saver does per byte, on this machine: the
    integrity digest (XXH3-128, as ``mindspeed_ha.checkpoint.integrity.Digest``; blake2b,
    the digest before, for comparison), CRC-32 (zlib), and write + fsync of a new file in
    ``directory`` from memory (``os.pwrite``)."""
    import hashlib
    import zlib

    import xxhash

    data = memoryview(os.urandom(1 << 20) * (nbytes >> 20))
    out = {}
    for name, fn in (("xxh3_128", lambda: xxhash.xxh3_128(data).digest()),
                     ("blake2b", lambda: hashlib.blake2b(data, digest_size=16).digest()),
                     ("crc32", lambda: zlib.crc32(data))):
        start = time.perf_counter()
        fn()
        out[name] = nbytes / (time.perf_counter() - start)
    path = os.path.join(directory, "primitive.bin")
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    out["pwrite+fsync"] = nbytes / (time.perf_counter() - start)
    os.remove(path)
    return out


def _parallel_writer(path, nbytes, start, out):
    data = memoryview(bytearray(os.urandom(1 << 20) * max(1, nbytes >> 20)))[:nbytes]
    start.wait()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for pos in range(0, nbytes, 16 << 20):
            os.pwrite(fd, data[pos:pos + (16 << 20)], pos)
        os.fsync(fd)
    finally:
        os.close(fd)
    out.put((t0, time.perf_counter()))


def _parallel_floor(directory, nbytes, writers):
    """Bytes/s of ``writers`` processes writing ``nbytes`` in all (equal parts, each its own
    new file in ``directory``, from memory, ``pwrite`` of 16 MiB + one fsync: what the
    savers do with nothing else), first start to last fsync: the best a dying checkpoint
    written through the page cache by that many savers can reach on this disk now."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    paths = [os.path.join(directory, f"floor{i}.bin") for i in range(writers)]
    procs = [ctx.Process(target=_parallel_writer, args=(p, nbytes // writers, start, out)) for p in paths]
    for p in procs:
        p.start()
    time.sleep(0.5 + nbytes / 2e9)  # let every writer fill its buffer first
    start.set()
    times = [out.get() for _ in procs]
    for p in procs:
        p.join()
    for p in paths:
        os.remove(p)
    return writers * (nbytes // writers) / (max(t for _, t in times) - min(t for t, _ in times))


def _breakdown(report, stderr):
    """Seconds from each action sent to the next (DUMP -> ASSEMBLE -> COMMIT -> EXIT), and
    the ranks' own step timings (``[name=1.234s ...]`` in their action results)."""
    from mindspeed_ha.phases import action_intervals

    phases = action_intervals(report)
    steps = re.findall(r"rank (\d+): (dump|assemble|commit) ok .*?\[([^\]]*)\]", stderr)
    return phases, steps


def _run_once(mlm, root, tmp, fmt, hidden, log_dir, n):
    """One killed run; returns (bytes, save s, dd bytes/s) and prints the breakdown."""
    save = os.path.join(tmp, f"ckpt_{fmt}_{n}")
    report = os.path.join(tmp, f"report_{fmt}_{n}.json")
    args = mlm.stock_gpt_args(pp=2, train_iters=4, ckpt_format=fmt, hidden_size=hidden,
                              num_attention_heads=8, save=save, save_interval=1000,
                              enable_high_availability=True, ha_controller_port=0)
    env = {ha_env.CACHE: os.path.join(tmp, "cache"), ha_env.REPORT: report,
           ha_env.INJECT: "rank=3,iteration=2,point=backward"}
    r = mlm.launch_stock(root, args, env=env, timeout_s=1800)
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, f"{fmt}_{n}.stderr"), "w") as f:
            f.write(r.stderr)
    if r.returncode != 75:
        print(r.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{fmt}: expected exit 75, got {r.returncode}")
    with open(report) as f:
        rep = json.load(f)
    phases, steps = _breakdown(rep, r.stderr)
    print(f"{fmt} #{n}: phases " + " ".join(f"{k}={v:.3f}s" for k, v in phases.items()))
    for rank, action, detail in steps:
        print(f"{fmt} #{n}:   rank {rank} {action}: {detail}")
    nbytes = _dir_bytes(os.path.join(save, "iter_0000001"))
    # The disk's rate moves between runs (a first write after deletions is often several
    # times slower here): dd DD_RUNS times, the fastest counts (the lower, conservative ratio).
    load = os.getloadavg()[0]
    dds = [_dd_rate(save, nbytes) for _ in range(DD_RUNS)]
    dd = max(dds)
    savers = len({rank for rank, action, _ in steps if action == "dump"}) or 1
    floors = [_parallel_floor(save, nbytes, savers) for _ in range(DD_RUNS)]
    rates = _primitive_rates(save)
    print(f"{fmt} #{n}: load average {load:.1f} on {os.cpu_count()} cores (1-minute, right after the save)")
    print(f"{fmt} #{n}: one core, MB/s: " + " ".join(f"{k} {v / 1e6:.0f}" for k, v in rates.items())
          + f"; dd " + ", ".join(f"{d / 1e6:.0f}" for d in dds)
          + f"; {savers} parallel pwrite+fsync writers " + ", ".join(f"{f / 1e6:.0f}" for f in floors))
    shutil.rmtree(save, ignore_errors=True)
    return nbytes, rep["phase_seconds"]["save"], dd, max(floors), savers, load


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron-lm")
    ap.add_argument("--tarball", default=DEFAULT_TARBALL)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--formats", default="torch,torch_dist")
    ap.add_argument("--repeat", type=int, default=1, help="runs per format (the disk's rate varies between runs)")
    ap.add_argument("--log-dir", help="keep each run's stderr (controller and ranks) here")
    ns = ap.parse_args()
    from mindspeed_ha.testing import megatron_lm as mlm

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_dying_write_", dir=os.getcwd()) as tmp:
        root = ns.megatron_lm or mlm.unpack(ns.tarball, os.path.join(tmp, "src"))
        for n in range(ns.repeat):
            for fmt in ns.formats.split(","):
                rows.append((fmt, *_run_once(mlm, root, tmp, fmt, ns.hidden_size, ns.log_dir, n)))
    print(f"\nstock pretrain_gpt.py, TP1 PP2 DP2, 2 replicas, hidden {ns.hidden_size}; rank 3 killed")
    print("floor: the same bytes written by as many processes as savers, pwrite + fsync from memory, nothing else")
    print(f"{'format':11} {'load':>5} {'MB':>8} {'save s':>8} {'MB/s':>8} {'dd MB/s':>8} {'ratio':>6} "
          f"{'floor MB/s':>10} {'floor/dd':>8} {'save/floor':>10}  goal {GOAL_RATIO}")
    for fmt, nbytes, save_s, dd, floor, savers, load in rows:
        rate = nbytes / save_s
        print(f"{fmt:11} {load:5.1f} {nbytes / 1e6:8.1f} {save_s:8.3f} {rate / 1e6:8.1f} {dd / 1e6:8.1f} "
              f"{rate / dd:6.2f} {floor / 1e6:10.1f} {floor / dd:8.2f} {rate / floor:10.2f}  "
              f"{'met' if rate / dd >= GOAL_RATIO else 'NOT met'}")
    if ns.repeat > 1:
        for fmt in ns.formats.split(","):
            ratios = [r[1] / r[2] / r[3] for r in rows if r[0] == fmt]
            print(f"{fmt}: ratio median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, "
                  f"max {max(ratios):.2f}, {len(ratios)} runs)")


if __name__ == "__main__":
    main()
