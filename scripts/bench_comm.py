#!/usr/bin/env python
"""Interruptible collectives (mindspeed_ha/recovery/comm.py) on gloo: what they cost, how
fast they get out.

Two gloo processes on this machine (TCPStore rendezvous):

* per-op cost: a synchronous ``all_reduce`` of 1 KB and 4 MB (fp32), ``--n`` calls each,
  unwrapped (feature ``ha`` off: the registry's gates pass straight through), wrapped
  (``ha`` on) and wrapped without phase 1 (``comm.FIRST_WAIT_S = 0``: every wait parks on
  the future's done-callback, the design without a bounded first C++ wait), interleaved
  call by call so that load from elsewhere hits all alike; median microseconds per call
  on rank 0 and the ratios to unwrapped; and a 1 KB exchange as Megatron's pipeline
  stages do it (``batch_isend_irecv`` of one isend and one irecv per rank, then
  ``req.wait()`` each; a send/recv work has no future, so a helper thread waits it);
* abort -> raise: rank 1 stays out of the op; rank 0 is blocked in it; another thread
  of rank 0 calls ``comm.abort()``; the time from that call to ``CollectiveAborted``
  reaching rank 0's caller, median of ``--repeats`` (a fresh group each time), for:
  ``all_reduce parked`` (abort after the wait parked: the usual case, a control plane
  decides seconds after a rank got stuck), ``all_reduce phase 1`` (abort as soon as
  the op was launched: bounded by ``comm.FIRST_WAIT_S``) and ``recv parked`` (a work
  without a future: a helper thread waits it).

    python scripts/bench_comm.py [--n 200 --repeats 10]
"""

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = ((1024, "1 KB"), (4 << 20, "4 MB"))


MODES = ("unwrapped", "wrapped", "no phase 1")


def _modes(registry, comm):
    """A function that puts the interruptible collectives in one of ``MODES``."""
    first_wait = comm.FIRST_WAIT_S

    def mode(m):
        (registry.disable if m == "unwrapped" else registry.enable)("ha")
        comm.FIRST_WAIT_S = 0.0 if m == "no phase 1" else first_wait

    return mode


def _print_medians(rank: int, what: str, times) -> None:
    if rank == 0:
        medians = " ".join(f"{statistics.median(times[m]) * 1e6:.1f}" for m in MODES)
        print(f"OP {what} {medians}", flush=True)


def _op_costs(rank: int, n: int, mode) -> None:
    """Per-call cost of a synchronous all_reduce of each size, every mode interleaved."""
    import torch
    import torch.distributed as dist

    for nbytes, label in SIZES:
        x = torch.ones(nbytes // 4)
        times = {m: [] for m in MODES}
        for m in MODES:  # warm-up
            mode(m)
            dist.all_reduce(x)
        for _ in range(n):
            for m in MODES:
                mode(m)
                t0 = time.perf_counter()
                dist.all_reduce(x)
                times[m].append(time.perf_counter() - t0)
        _print_medians(rank, f"all_reduce {label.replace(' ', '')}", times)


def _p2p_cost(rank: int, n: int, mode) -> None:
    """Per-exchange cost of a 1 KB batch_isend_irecv as Megatron's pipeline stages do it."""
    import torch
    import torch.distributed as dist

    peer = 1 - rank
    x, y = torch.ones(256), torch.empty(256)
    times = {m: [] for m in MODES}
    for i in range(n + 1):  # the first round is a warm-up
        for m in MODES:
            mode(m)
            t0 = time.perf_counter()
            for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]):
                req.wait()
            if i:
                times[m].append(time.perf_counter() - t0)
    _print_medians(rank, "p2p-exchange 1KB", times)


def _abort_once(comm, trigger, op, group) -> float:
    """Rank 0: ``op`` blocked on ``group``, aborted from another thread once ``trigger`` is
    set; seconds from the abort call to CollectiveAborted reaching the caller."""
    stamp = []

    def aborter():
        trigger.wait(60)
        stamp.append(time.perf_counter())
        comm.abort("bench")

    th = threading.Thread(target=aborter, daemon=True)
    th.start()
    try:
        op(group)
        raise AssertionError("op returned: rank 1 joined?")
    except comm.CollectiveAborted:
        lat = time.perf_counter() - stamp[0]
    th.join()
    comm.reset()
    return lat


def _abort_latency(rank: int, store, repeats: int, comm) -> None:
    """abort -> raise, per case, median and max of ``repeats`` (a fresh group each time)."""
    import torch
    import torch.distributed as dist

    parked, inside = threading.Event(), threading.Event()
    real_park = comm._park

    def park(lk, timeout):
        parked.set()
        return real_park(lk, timeout)

    comm._park = park  # comm has no public hook for "the wait parked": its private _park is wrapped
    comm.set_fault_hook(lambda op, group: inside.set())
    cases = (("all_reduce parked", parked, lambda g: dist.all_reduce(torch.ones(4), group=g)),
             ("all_reduce phase 1", inside, lambda g: dist.all_reduce(torch.ones(4), group=g)),
             ("recv parked", parked, lambda g: dist.recv(torch.zeros(4), src=1, group=g)))
    for name, trigger, op in cases:
        lat = []
        for i in range(repeats):
            group = dist.new_group([0, 1], backend="gloo", use_local_synchronization=True)
            dist.barrier(group=group)  # connections up
            if rank == 1:
                store.wait([f"done/{name}/{i}"])
                continue
            parked.clear()
            inside.clear()
            lat.append(_abort_once(comm, trigger, op, group))
            store.set(f"done/{name}/{i}", "1")
        if rank == 0:
            print(f"ABORT {name} {statistics.median(lat) * 1e3:.3f} {max(lat) * 1e3:.3f}", flush=True)


def _rank(rank: int, port: int, n: int, repeats: int) -> None:
    import mindspeed_ha  # noqa: F401 - installs the patches
    import torch.distributed as dist

    from mindspeed_ha.patches import registry
    from mindspeed_ha.recovery import comm

    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2)
    mode = _modes(registry, comm)
    _op_costs(rank, n, mode)
    _p2p_cost(rank, n, mode)
    mode("wrapped")
    _abort_latency(rank, store, repeats, comm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200, help="calls per size and mode")
    ap.add_argument("--repeats", type=int, default=10, help="aborts per case")
    args = ap.parse_args()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=timedelta(seconds=120), wait_for_workers=False)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--rank"]
    procs = [subprocess.Popen(cmd + [str(r), str(store.port), str(args.n), str(args.repeats)],
                              stdout=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    if any(p.returncode for p in procs):
        sys.exit(f"a rank failed: {[p.returncode for p in procs]}\n{outs}")
    rows = [line.split() for line in outs[0].splitlines()]
    print(f"per-call cost (synchronous all_reduce; p2p-exchange: batch_isend_irecv + waits), "
          f"2 gloo processes, median of {args.n} (us)")
    print(f"| {'op':<17} | {'unwrapped':>9} | {'wrapped':>9} | {'ratio':>5} | {'no phase 1':>10} | {'ratio':>5} |")
    print(f"|{'-' * 19}|{'-' * 11}|{'-' * 11}|{'-' * 7}|{'-' * 12}|{'-' * 7}|")
    for r in rows:
        if r[0] == "OP":
            off, on, event = float(r[3]), float(r[4]), float(r[5])
            print(f"| {r[1] + ' ' + r[2]:<17} | {off:>9.1f} | {on:>9.1f} | {on / off:>5.2f} | {event:>10.1f} "
                  f"| {event / off:>5.2f} |")
    print(f"\nabort() -> CollectiveAborted in the blocked caller, {args.repeats} aborts (ms)")
    print(f"| {'case':<20} | {'median':>7} | {'max':>7} |")
    print(f"|{'-' * 22}|{'-' * 9}|{'-' * 9}|")
    for r in rows:
        if r[0] == "ABORT":
            print(f"| {' '.join(r[1:-2]):<20} | {float(r[-2]):>7.3f} | {float(r[-1]):>7.3f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        code = 1
        try:
            _rank(*(int(a) for a in sys.argv[2:6]))
            code = 0
        finally:
            sys.stdout.flush()
            os._exit(code)  # abandoned gloo ops must not hold up the exit
    main()
