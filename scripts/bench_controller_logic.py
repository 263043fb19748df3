#!/usr/bin/env python
"""The controller's own CPU at scale, without sockets: its logic alone, per phase.

The real :class:`Controller` (handlers, policy, effects, the real wire frames: msgpack,
HMAC, per-sender ``seq``) driven turn by turn on a fake clock by the in-process harness
of ``tests/test_controller_scale.py`` (its ROUTER stand-in and simulated ranks), for N
ranks (layout TP 8, PP 2, two optimizer replicas); the clock moves by the CPU time of each
turn while input is queued (a controller on a core of its own). What it leaves out is libzmq: CURVE
handshakes and per-frame encryption (``bench_controller_scale.py`` measures those, and
this machine cannot host 16,384 simulated CURVE clients at 1 step/s). Reported: the
controller thread's CPU-seconds (``time.thread_time`` around each turn; the simulated
ranks' own encoding is outside) for registration, one simulated second of steady state
at 1 step/s, a UCE -> the RETRY plan at every rank, and a death -> STOP at every survivor
and -> the dying checkpoint committed; and false deaths.

``--decisions``: the dying checkpoint's decision alone, per step, for the same layout with
one rank dead (the best of ``--repeat`` runs, CPU-ms of the thread): the savers' selection from
the ranks as the controller keeps them (``select_dying_checkpoint``, reading the parts'
holder table kept at registration) and, for comparison, the same selection grouping every
rank again (``select_by_scan``, what it did before); the DUMP action's params as sent
(the whole plan, as the decision carries it, and each saver's own part, encoded as wire
frames: bytes of the largest); the reason's length; the roster's payload (bytes, and the
time to make it on the writer thread).

    PYTHONPATH=$PWD python scripts/bench_controller_logic.py --ranks 1024 4096 16384
    PYTHONPATH=$PWD python scripts/bench_controller_logic.py --decisions --ranks 1024 4096 16384
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def one(n: int) -> dict:
    import dataclasses

    import test_controller_scale as h

    from mindspeed_ha.control import wire
    from mindspeed_ha.control.controller import Controller
    from mindspeed_ha.control.state import Phase

    h.WORLD, h.DP = n, n // (h.TP * h.PP)
    cfg = dataclasses.replace(h.CFG, hbm_repair=True)
    clock = h.Clock()
    ctl = Controller(cfg, n, "127.0.0.1", 0, tick_s=h.TICK_S, clock=clock)
    router = h.SlowRouter(clock)
    ctl._router = router
    ranks = h.Ranks(router, clock)
    cpu = [0.0]

    def run(until, max_turns):
        """Turns as a controller on a core of its own runs them: the clock moves by the CPU
        time each turn took while input is queued, else by the poll interval (``tick_s``)."""
        for _ in range(max_turns):
            if until():
                return True
            if not ranks.frozen:
                ranks.beat()
            t = time.thread_time()
            ctl._turn()
            dt = time.thread_time() - t
            cpu[0] += dt
            ranks.answer()
            clock.t += max(dt, 1e-4) if any(router.queues.values()) else h.TICK_S
        return until()
    uce = {"rank": None}
    answer = ranks.answer

    def answer_with_faults():  # STOP(recover): the ranks report where they stopped (uce / aborted)
        answer()
        for r, body in ranks.received.pop(wire.MsgType.STOP, []):
            if body.recover:
                kind = "uce" if r == uce["rank"] else "aborted"
                ranks.send(r, wire.Fault(r, ranks.iteration + 1, kind, kind, "updated", "train_step"))
            ranks.received.setdefault("stop_seen", []).append(r)
        for r, body in ranks.received.pop(wire.MsgType.ACTION, []):
            ranks.received.setdefault("actions", []).append((r, body))
            if body.kind == "retry":
                ranks.frozen = False

    ranks.answer = answer_with_faults
    out = {"ranks": n}
    t_reg = clock.t
    for r in range(n):
        ranks.send(r, wire.Register(r, n, 10_000 + r, "node", h.layout(r), "/save", "run", "updated", ranks.iteration))
    c = cpu[0]
    assert run(lambda: len(ctl.state.ranks) == n and not any(router.queues.values()), 10_000)
    out["registration_cpu_s"] = cpu[0] - c
    out["registration_clock_s"] = clock.t - t_reg
    c, t0 = cpu[0], clock.t
    run(lambda: clock.t >= t0 + 5.0, 10_000)
    out["steady_cores"] = (cpu[0] - c) / (clock.t - t0)  # CPU-s per second at 1 step/s
    # UCE of one rank -> the RETRY plan at every rank
    uce["rank"] = n // 2 + 3
    ranks.frozen = True
    ranks.send(uce["rank"], wire.Fault(uce["rank"], ranks.iteration + 1, "uce", "simulated UCE", "updated",
                                       "train_step"))
    c = cpu[0]

    def retried():
        return len({r for r, b in ranks.received.get("actions", []) if b.kind == "retry"}) >= n
    t_uce = clock.t
    ok = run(retried, 10_000)
    out["uce_retry_cpu_s"] = cpu[0] - c if ok else None
    out["uce_retry_clock_s"] = clock.t - t_uce if ok else None
    run(lambda: ctl.state.phase is Phase.RUNNING, 10_000)
    ranks.received.clear()
    ranks.frozen = False
    run(lambda: clock.t >= t0 + 30.0, 10_000)
    # death -> STOP at every survivor -> committed
    victim = n // 3 + 1
    ranks.dead.add(victim)
    ctl.report_rank_exit(victim, -9)
    c, t_kill = cpu[0], clock.t
    ok = run(lambda: len(set(ranks.received.get("stop_seen", []))) >= n - 1, 10_000)
    out["death_stop_cpu_s"] = cpu[0] - c if ok else None
    ok = run(lambda: ctl.state.phase is Phase.DONE, 20_000)
    out["death_commit_cpu_s"] = cpu[0] - c if ok else None
    out["death_commit_clock_s"] = clock.t - t_kill if ok else None
    out["exit_code"] = ctl.state.exit_code
    out["false_deaths"] = sum(1 for r, i in ctl.state.ranks.items()
                              if r != victim and not i.alive and "goodbye" not in i.dead_reason)
    out["silence_decisions"] = sum(1 for e in ctl.events if "heartbeat" in e.reason)
    return out


def decisions(n: int, repeat: int) -> dict:
    """The dying checkpoint's decision steps at ``n`` ranks (see the module's docstring)."""
    import test_controller_scale as h

    from mindspeed_ha.control import wire
    from mindspeed_ha.control.failover import roster_entry
    from mindspeed_ha.control.policy.dying import select_dying_checkpoint
    from mindspeed_ha.control.state import ClusterState, OptimizerStatus, RankInfo

    try:  # a tree before the holder table (the "before" of RESULTS) has no scan to compare with
        from mindspeed_ha.control.policy.dying import select_by_scan
    except ImportError:
        select_by_scan = select_dying_checkpoint
    h.WORLD, h.DP = n, n // (h.TP * h.PP)
    ranks = ClusterState(world_size=n).ranks  # the controller's own container
    for r in range(n):  # as the controller's registrations fill it
        ranks[r] = RankInfo(r, h.layout(r), status=OptimizerStatus.UPDATED, iteration=10, stopped=True, pid=r,
                            host=f"node{r // 8}", save_dir="/save")
    victim = n // 3 + 1
    ranks[victim].alive = False
    gone = {victim: "exited with -9"}

    def best(fn):
        times = []
        for _ in range(repeat):
            t = time.thread_time()
            out = fn()
            times.append(time.thread_time() - t)
        return out, round(min(times) * 1e3, 2)

    plan, out_table = best(lambda: select_dying_checkpoint(ranks, gone))
    ref, out_scan = best(lambda: select_by_scan(ranks, gone))
    assert plan == ref, "the table's selection differs from the scan's"
    codec = wire.Codec(h.KEY, "controller")
    savers = plan.savers()
    whole, t_whole = best(lambda: codec.encode(wire.Action(1, "dump", plan.to_params("/save"))))
    own, t_own = best(lambda: [codec.encode(wire.Action(1, "dump", p))
                               for p in plan.params_by_rank("/save", savers).values()])
    entries = {r: roster_entry(i) for r, i in ranks.items()}
    payload, t_roster = best(lambda: ('{"ranks": {' + ", ".join(entries[r] for r in ranks) + '}, "recoveries": []}')
                             .encode())
    return {"ranks": n, "savers": len(savers), "select_table_ms": out_table, "select_scan_ms": out_scan,
            "dump_whole_plan_bytes": len(whole), "dump_whole_plan_encode_ms": t_whole,
            "dump_per_saver_bytes_max": max(len(f) for f in own), "dump_all_savers_encode_ms": t_own,
            "reason_chars": len(plan.reason), "roster_bytes": len(payload), "roster_payload_ms": t_roster}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--decisions", action="store_true", help="the dying checkpoint's decision steps alone")
    ap.add_argument("--repeat", type=int, default=5, help="--decisions: runs of each step (the best is given)")
    ns = ap.parse_args()
    if ns.decisions:
        for n in ns.ranks:
            print(json.dumps(dict(decisions(n, ns.repeat), load=os.getloadavg()[0])), flush=True)
        return
    import logging

    # the controller's log at INFO, as a job runs it (its cost counts), discarded
    logging.basicConfig(level=logging.INFO, filename=os.devnull)
    for n in ns.ranks:
        res = one(n)
        res["load"] = os.getloadavg()[0]
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
