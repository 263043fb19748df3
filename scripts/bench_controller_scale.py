#!/usr/bin/env python
"""The control plane at scale: the real controller, thousands of simulated ranks.

The controller (:class:`mindspeed_ha.control.controller.Controller`) runs in this process
on its real socket (CURVE, ZAP, msgpack, HMAC, the wire schema of ``control/wire.py``).
The ranks are simulated in ``--sims`` OS processes: one ZeroMQ DEALER per rank, each a
CURVE client with its own sender name and ``seq``, speaking the real frames (REGISTER,
HEARTBEAT, STATUS, FAULT, STOPPED, ACTION_RESULT, GOODBYE), re-sending REGISTER on the
processor's schedule (``link.RegisterBackoff`` when present). The simulated savers write
nothing: they answer DUMP / ASSEMBLE / COMMIT ok.

Per N (``--ranks 1024 4096 16384``), on one controller:

1. registration: seconds from the simulators' start to the last REGISTERED; REGISTER
   frames sent (total, most by one rank); ranks not registered within 60 s;
2. steady state at 1 step/s (``--steady-s``): one HEARTBEAT + one STATUS per rank per
   second; controller process CPU (cores, all its threads) and RSS, p50/p99 of one frame's
   handling (decode + dispatch), the longest loop turn;
3. UCE (``--enable-hbmfault-repair``): FAULT(uce) of one rank -> the RETRY plan at every
   rank (the observe and abort rounds in between), then RESUME;
4. death: one rank's connection closed -> STOP at every survivor; -> the dying checkpoint
   decided and committed (EXIT 75);
5. false deaths: ranks the controller took for dead (or silent) other than the killed one.

``--per-node 8`` simulates node relays (control/relay.py): a node's 8 ranks share one CURVE
connection, and their heartbeats are one NODE_BEAT per node and second, as the relay merges
them (``--no-merge``: every rank's HEARTBEAT frame forwarded instead). Besides the totals,
each round is split on the controller's clock (the close read, the decision step, the
fan-out's last send) and its CPU-seconds (controller, its loop, the simulators) are given.

What the simulators spend stands for work a real job does on its 2,048 nodes, not on the
controller's machine; where it is the same for a node's ranks it is done once per node
(``Sim.fanout``): a fan-out's frame verified once per node, a node's alike routine
answers noted for its NODE_ANSWERS in one step per answer type (the same bytes as rank by
rank: ``tests/test_controller_scale.py``), the sockets watched by one epoll of their
ZMQ_FD. What the controller receives is unchanged: CURVE, msgpack, HMAC, the relay's frames.
``uce_turns_*`` split the UCE round's wall time on the controller: in a turn on a CPU, in
a turn but not running (other threads on the 2 cores), and between turns (nothing to read).

On a shared machine with ``kernel.sched_autogroup_enabled = 1``, ``nice`` alone does not give
the bench the CPU (each session is one autogroup of equal weight); run it in a session of
its own whose autogroup is raised too, e.g.
``setsid sh -c 'echo -20 > /proc/self/autogroup; exec nice -n -20 python scripts/...'``.

``--slow 2`` slows two of the simulator processes (each sleeps ``--slow-s`` between its
loop turns, nice 10): their ranks' frames arrive late and in bursts. Figures are
wall-clock on a shared machine: note the load average printed with them.

    PYTHONPATH=$PWD python scripts/bench_controller_scale.py --ranks 1024 4096 [--slow 2]
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import hmac
import json
import logging
import multiprocessing as mp
import os
import random
import resource
import secrets
import select
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import msgpack
import zmq

LAYOUT_TP, LAYOUT_PP, REPLICAS = 8, 2, 2
STEP_S = 1.0
#: the shortest loop turn of a simulator process, s (see Sim.run)
MIN_TURN_S = 0.01


def layout_of(rank: int, world: int) -> Dict[str, int]:
    """Megatron's order (tp fastest, then dp, then pp); distributed optimizer, 2 replicas."""
    tp, pp = LAYOUT_TP, LAYOUT_PP
    while world % (tp * pp * REPLICAS):
        tp = max(1, tp // 2)
        pp = 1
    dp = world // (tp * pp)
    spi = max(1, dp // REPLICAS)
    tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    return {"tp_rank": tp_rank, "pp_rank": pp_rank, "dp_rank": dp_rank, "cp_rank": 0, "tp_size": tp,
            "pp_size": pp, "dp_size": dp, "replica_count": REPLICAS, "instance_id": dp_rank // spi,
            "shard_id": dp_rank % spi, "cp_size": 1}


# ---------------------------------------------------------------------- the simulated ranks
class Sim:
    """The ranks of one simulator process."""

    def __init__(self, conn, sim_id: int, ranks: List[int], world: int, port: int, key: bytes, slow_s: float,
                 save_dir: str, connect_rate: float = 0.0, per_node: int = 0, merge: bool = True,
                 merge_answers: Any = ()):
        from mindspeed_ha.control import auth, wire
        from mindspeed_ha.control import link as link_mod

        self.wire = wire
        self.conn, self.sim_id, self.ranks, self.world, self.key = conn, sim_id, ranks, world, key
        self.slow_s, self.save_dir = slow_s, save_dir
        #: connections this simulator opens per second (0: all at once, as ranks that start together)
        self.connect_rate = connect_rate
        self.v = wire.SCHEMA_VERSION
        self.backoff_cls = getattr(link_mod, "RegisterBackoff", None)
        self.ctx = zmq.Context(io_threads=1)
        self.ctx.set(zmq.MAX_SOCKETS, len(ranks) + 64)
        keys = auth.derive_keys(key)
        #: --per-node K: the ranks of a simulated node (K of this process's ranks) share one
        #: CURVE connection, as behind the node relay (control/relay.py): frames go up as
        #: [sub, frame, ...] per node and loop turn, a killed rank's close as [sub, b""]
        self.per_node = per_node
        #: relayed and merged (the relay's default, wire schema 13): a rank's heartbeat is not a
        #: frame but its sub named in its node's next NODE_BEAT, one per node and STEP_S
        self.merge = bool(per_node) and merge
        self.heard: Dict[Any, List[bytes]] = {}  # node socket -> subs heard since its last beat
        self.beat_due: List[Any] = []  # (when, node index) of the next NODE_BEAT
        self.beat_sender: Dict[Any, str] = {}
        self.beat_seq: Dict[Any, int] = {}
        #: relayed and merged: a rank's routine answer of these types (wire.MERGEABLE, schema 14) is
        #: not a frame but an entry of its node's next NODE_ANSWERS, sent in the node's message of
        #: the turn before any later frame of that rank (as control/relay.py does)
        self.merge_answers = frozenset(merge_answers) if self.merge else frozenset()
        self.answers: Dict[Any, Dict[Any, Any]] = {}  # node socket -> (type, body) -> (body, subs, ranks)
        self.answer_sender: Dict[Any, str] = {}
        self.answer_seq: Dict[Any, int] = {}
        self.socks: Dict[int, Any] = {}  # rank -> its socket (its node's, when relayed)
        self.rank_of: Dict[Any, int] = {}  # socket -> rank (direct only)
        self.sub: Dict[int, bytes] = {r: f"r{r}-{secrets.token_hex(4)}".encode() for r in ranks}
        self.rank_of_sub: Dict[bytes, int] = {v: k for k, v in self.sub.items()}
        self.node_ranks: Dict[Any, List[int]] = {}  # socket -> the ranks it carries
        self.out: Dict[Any, List[bytes]] = {}  # relayed: socket -> [sub, frame, ...] to send this turn
        groups = [ranks[i:i + per_node] for i in range(0, len(ranks), per_node)] if per_node else \
            [[r] for r in ranks]
        for g in groups:
            s = self.ctx.socket(zmq.DEALER)
            wire.configure_socket(s, 1 << 20)
            auth.configure_client(s, keys)
            s.setsockopt(zmq.ROUTING_ID, self.sub[g[0]] if not per_node else
                         f"n{g[0]}-relay-{secrets.token_hex(4)}".encode())
            s.setsockopt(zmq.RECONNECT_IVL, 100)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            self.node_ranks[s] = g
            if per_node and merge:
                self.beat_sender[s], self.beat_seq[s] = wire.new_sender("relay", g[0]), 0
                self.heard[s] = []
                self.answer_sender[s], self.answer_seq[s] = wire.new_sender("relay", g[0]), 0
                self.answers[s] = {}
            for r in g:
                self.socks[r] = s
                self.rank_of[s] = r
        self.sender = {r: wire.new_sender("processor", r) for r in ranks}
        self.seq = {r: 0 for r in ranks}
        self.last_in = {r: 0 for r in ranks}
        self.t0 = time.monotonic()
        self.registered: Dict[int, float] = {}
        self.reg_sent = {r: 0 for r in ranks}
        self.backoff: Dict[int, Any] = {}
        self.phase = {r: random.random() * STEP_S for r in ranks}  # each rank's heartbeat offset
        self.hb_due: List[Any] = []  # (when, rank) of the next heartbeat
        self.reg_due: List[Any] = []  # (when, rank) of the next REGISTER
        self.it = {r: 0 for r in ranks}
        self.frozen: Dict[int, bool] = {r: False for r in ranks}
        self.exited: Dict[int, bool] = {r: False for r in ranks}
        self.dead: set = set()
        self.uce_rank: Optional[int] = None
        self.hold: Optional[int] = None
        self.stop_at: Dict[int, float] = {}
        self.retry_at: Dict[int, float] = {}
        self.exit_at: Dict[int, float] = {}
        self.rejected = 0
        self.sent = 0
        self.dropped = 0  # frames not sent: the socket's queue was full (zmq.Again)
        self.hb_late = 0.0  # the most a heartbeat left after its time (this simulator's own lag), s
        #: a node's alike routine answers noted in one step (see :meth:`fanout`; False: rank by rank)
        self.fast = True
        #: sockets to read at the next turn whatever their ZMQ_FD says (see run)
        self.check: set = set()

    # ---- frames
    def enc(self, r: int, mtype: str, body: Dict[str, Any]) -> bytes:
        self.seq[r] += 1
        env = msgpack.packb({"v": self.v, "type": mtype, "seq": self.seq[r], "sender": self.sender[r],
                             "body": body}, use_bin_type=True)
        return hmac.new(self.key, env, hashlib.sha256).digest() + env

    def beat(self, s) -> None:
        """One NODE_BEAT of node ``s``: the subs heard since its last one (none: not sent)."""
        subs, self.heard[s] = self.heard[s], []
        if not subs:
            return
        self.beat_seq[s] += 1
        env = msgpack.packb({"v": self.v, "type": "node_beat", "seq": self.beat_seq[s], "sender": self.beat_sender[s],
                             "body": {"node_rank": self.node_ranks[s][0], "subs": subs}}, use_bin_type=True)
        self.check.add(s)
        try:
            s.send(hmac.new(self.key, env, hashlib.sha256).digest() + env, zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self.dropped += 1

    def merged_answer(self, s, r: int, mtype: str, body: Dict[str, Any]) -> bool:
        """Relayed and merged: note rank ``r``'s routine answer for its node's next NODE_ANSWERS."""
        need = self.wire.MERGEABLE.get(mtype)
        if mtype not in self.merge_answers or need is None or any(body.get(k) != v for k, v in need.items()):
            return False
        common = {k: v for k, v in body.items() if k != "rank"}
        group = self.answers[s].setdefault((mtype, tuple(common.items())), (common, [], []))
        group[1].append(self.sub[r])
        group[2].append(r)
        return True

    def flush_answers(self, s) -> None:
        """Node ``s``'s noted answers, as NODE_ANSWERS frames of its relay into its message of this turn."""
        answers, self.answers[s] = self.answers[s], {}
        for (mtype, _), (common, subs, ranks) in answers.items():
            self.answer_seq[s] += 1
            env = msgpack.packb({"v": self.v, "type": "node_answers", "seq": self.answer_seq[s],
                                 "sender": self.answer_sender[s],
                                 "body": {"node_rank": self.node_ranks[s][0], "answer": mtype, "body": common,
                                          "subs": subs, "ranks": ranks}}, use_bin_type=True)
            self.out.setdefault(s, []).extend((b"", hmac.new(self.key, env, hashlib.sha256).digest() + env))
            self.sent += 1

    def send(self, r: int, mtype: str, body: Dict[str, Any]) -> None:
        if r in self.dead:
            return
        if self.per_node:
            s = self.socks[r]
            if self.merge_answers:
                if self.merged_answer(s, r, mtype, body):
                    return
                if any(self.sub[r] in g[1] for g in self.answers[s].values()):
                    self.flush_answers(s)  # its merged answer goes before this frame
            self.out.setdefault(s, []).extend((self.sub[r], self.enc(r, mtype, body)))
            self.sent += 1
            return
        self.check.add(self.socks[r])
        try:
            self.socks[r].send(self.enc(r, mtype, body), zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self.dropped += 1

    def flush(self) -> None:
        """Relayed: what each node's ranks sent this turn, one message per node (and 256 frames)."""
        for s, answers in self.answers.items():
            if answers:
                self.flush_answers(s)
        out, self.out = self.out, {}
        self.check.update(out)
        for s, parts in out.items():
            for i in range(0, len(parts), 512):
                try:
                    s.send_multipart(parts[i:i + 512], zmq.NOBLOCK)
                except zmq.Again:  # the node's queue is full (its connection or the controller is behind)
                    self.dropped += len(parts[i:i + 512]) // 2

    def received(self, s, now: float) -> None:
        for i in range(65):
            if i == 64:  # not read empty: read again next turn (its ZMQ_FD will not signal again)
                self.check.add(s)
                return
            try:
                parts = s.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not self.per_node:
                pairs = [(self.rank_of[s], parts[0])]
            elif len(parts) == 3 and not parts[0]:  # a fan-out through the relay: [b"", frame, packed subs]
                # one frame for the node's ranks: verified once here (each rank's own check of it
                # runs on its own CPU on a real node, not on the controller's machine), its seq per rank
                self.fanout(s, self.dec(None, parts[1]), unpack_subs(parts[2]), now)
                continue
            else:
                pairs = [(self.rank_of_sub.get(parts[i]), parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
            for r, frame in pairs:
                if r is None or r in self.dead:
                    continue
                m = self.dec(r, frame)
                if m is not None:
                    self.handle(r, m, now)

    def fanout(self, s, m: Optional[Dict[str, Any]], subs: List[bytes], now: float) -> None:
        """A fan-out's one frame ``m`` (None: it did not verify) for the node ranks ``subs``.

        Each rank checks its ``seq`` and handles it (:meth:`handle`), unless the node's answers
        are all routine and alike (``fast``, the default): a STOP or RETRY to ranks of one
        iteration, none of them the UCE rank, answers merged. Then the node's answers are noted
        for its NODE_ANSWERS in one step per answer type instead of rank by rank: the frames the
        controller gets are the same bytes (``tests/test_controller_scale.py`` compares them),
        made without the per-rank Python a real job runs on each rank's own node."""
        ranks = []
        for sub in subs:
            r = self.rank_of_sub.get(sub)
            if r is None or r in self.dead:
                continue
            if m is None or m["seq"] <= self.last_in[r]:
                self.rejected += 1
                continue
            self.last_in[r] = m["seq"]
            ranks.append(r)
        if not ranks:
            return
        answers = self.fast and self.node_answers_of(ranks, m)
        if not answers:
            for r in ranks:
                self.handle(r, m, now)
            return
        if m["type"] == "stop":
            for r in ranks:
                self.stop_at.setdefault(r, now)
                self.frozen[r] = True
        else:  # retry
            for r in ranks:
                self.retry_at.setdefault(r, now)
                self.frozen[r] = False
            self.hold = None
        node = self.answers[self.socks[ranks[0]]]
        subs = [self.sub[r] for r in ranks]
        for mtype, common in answers:  # in the order each rank sends them
            group = node.setdefault((mtype, tuple(common.items())), (common, [], []))
            group[1].extend(subs)
            group[2].extend(ranks)

    def node_answers_of(self, ranks: List[int], m: Optional[Dict[str, Any]]) -> Any:
        """The answers (type, body but ``rank``) every rank of ``ranks`` sends to ``m``, in
        order, when they are all merged and alike (see :meth:`fanout`); else None."""
        if m is None or not self.merge_answers or self.uce_rank in ranks:
            return None
        it = self.it[ranks[0]]
        if any(self.it[r] != it for r in ranks):
            return None
        t, body = m["type"], m["body"]
        if t == "stop":
            out = [("stopped", {"status": "updated", "iteration": it, "pause_at": -1, "step": it + 1})]
            if body.get("recover"):
                out.append(("fault", {"iteration": it + 1, "kind": "aborted", "message": "aborted",
                                      "status": "updated", "where": "train_step"}))
        elif t == "action" and body["kind"] == "retry":
            out = [("action_result", {"action_id": body["action_id"], "ok": True, "detail": "simulated retry"})]
        else:
            return None
        return out if all(mtype in self.merge_answers for mtype, _ in out) else None

    def dec(self, r: int, frame: bytes) -> Optional[Dict[str, Any]]:
        tag, env = frame[:32], frame[32:]
        if not hmac.compare_digest(tag, hmac.new(self.key, env, hashlib.sha256).digest()):
            self.rejected += 1
            return None
        m = msgpack.unpackb(env, raw=False, strict_map_key=False)
        if m.get("v") != self.v or (r is not None and m["seq"] <= self.last_in[r]):
            self.rejected += 1
            return None
        if r is not None:  # (None: a fan-out's frame, its seq checked per rank by the caller)
            self.last_in[r] = m["seq"]
        return m

    # ---- protocol
    def register(self, r: int, now: float) -> None:
        self.reg_sent[r] += 1
        self.send(r, "register", {"rank": r, "world_size": self.world, "pid": os.getpid(), "host": "sim",
                                  "layout": layout_of(r, self.world), "save_dir": self.save_dir, "run_id": "bench",
                                  "status": "updated", "iteration": 0, "verifies": False, "incarnation": 0,
                                  "rejoins": False})
        if self.backoff_cls is not None:  # the processor's own schedule
            b = self.backoff.get(r)
            if b is None:
                make = getattr(self.backoff_cls, "for_job", None)
                b = self.backoff[r] = make(self.world) if make else self.backoff_cls()
            heapq.heappush(self.reg_due, (now + b.next_delay(), r))
        else:  # before it existed: 0.1 s doubling to 2 s, whatever the connection
            b = self.backoff.get(r, 0.1)
            heapq.heappush(self.reg_due, (now + b, r))
            self.backoff[r] = min(2 * b, 2.0)

    def status_body(self, r: int) -> Dict[str, Any]:
        return {"rank": r, "status": "updated", "iteration": self.it[r], "step": self.it[r] + 1}

    def stopped(self, r: int) -> None:
        self.send(r, "stopped", {"rank": r, "status": "updated", "iteration": self.it[r], "pause_at": -1,
                                 "step": self.it[r] + 1})

    def handle(self, r: int, m: Dict[str, Any], now: float) -> None:
        t, body = m["type"], m["body"]
        if t == "registered":
            if body["accepted"] and r not in self.registered:
                self.registered[r] = now
                heapq.heappush(self.hb_due, (now + self.phase[r], r))
        elif t == "stop":
            self.stop_at.setdefault(r, now)
            self.frozen[r] = True
            self.stopped(r)
            if body.get("recover"):  # parked in the fault handler
                kind = "uce" if r == self.uce_rank else "aborted"
                self.send(r, "fault", {"rank": r, "iteration": self.it[r] + 1, "kind": kind, "message": kind,
                                       "status": "updated", "where": "train_step"})
        elif t == "action":
            kind = body["kind"]
            if kind == "retry":
                self.retry_at.setdefault(r, now)
                self.frozen[r] = False
                self.hold = None
            elif kind == "exit":
                self.exit_at.setdefault(r, now)
                self.exited[r] = True
                self.send(r, "goodbye", {"rank": r, "exit_code": int(body["params"].get("code", 0))})
                return
            self.send(r, "action_result", {"action_id": body["action_id"], "rank": r, "ok": True,
                                           "detail": f"simulated {kind}"})

    # ---- commands from the bench
    def command(self, cmd: str, arg: Any) -> Any:
        now = time.monotonic()
        if cmd == "hold":  # every rank at iteration arg, and no further (the faulty step is the next one)
            self.hold = arg
            for r in self.ranks:
                self.it[r] = arg
            self.stop_at.clear()
            self.retry_at.clear()
            return now
        if cmd == "uce":
            self.uce_rank = arg
            if arg in self.socks:
                self.send(arg, "fault", {"rank": arg, "iteration": self.it[arg] + 1, "kind": "uce",
                                         "message": "simulated UCE", "status": "updated", "where": "train_step"})
            return now
        if cmd == "kill":
            if arg in self.socks and self.per_node:  # the relay reports the rank's closed local connection
                self.dead.add(arg)
                self.socks[arg].send_multipart([self.sub[arg], b""], zmq.NOBLOCK)
                self.check.add(self.socks[arg])
                heard = self.heard.get(self.socks[arg])
                if heard is not None and self.sub[arg] in heard:  # the relay never names a closed connection
                    heard.remove(self.sub[arg])
            elif arg in self.socks:
                self.socks[arg].close(linger=0)
                self.dead.add(arg)
            return time.monotonic()
        if cmd == "profile":  # --profile-uce: this process under cProfile (arg: where to write; None: start)
            import cProfile
            if arg is None:
                self.profile = cProfile.Profile(time.thread_time)  # CPU, not wall: the machine is shared
                self.profile.enable()
            elif getattr(self, "profile", None) is not None:
                self.profile.disable()
                self.profile.dump_stats(f"{arg}.sim{self.sim_id}")
                self.profile = None
            return now
        if cmd == "report":
            # (no pass over the ranks in Python: the bench asks every 0.2 s during a round)
            stopped_dead = [r for r in self.dead if r in self.stop_at]  # (a rank killed after its STOP)
            stop_times = self.stop_at if not stopped_dead else {
                r: t for r, t in self.stop_at.items() if r not in self.dead}
            return {"registered": len(self.registered), "last_registered": max(self.registered.values(), default=None),
                    "register_sent": sum(self.reg_sent.values()), "register_max": max(self.reg_sent.values()),
                    "stops": len(stop_times), "last_stop": max(stop_times.values(), default=None),
                    "retries": len(self.retry_at), "last_retry": max(self.retry_at.values(), default=None),
                    "exits": len(self.exit_at), "rejected": self.rejected, "live": len(self.ranks) - len(self.dead),
                    "sent": self.sent,
                    "hb_late": self.hb_late, "cpu_s": cpu_s(), "main_cpu_s": time.thread_time(),
                    "dropped": self.dropped}
        return None

    # ---- the loop
    def run(self) -> None:
        if self.slow_s:
            os.nice(10)
        now = t_start = time.monotonic()
        pending = list(self.node_ranks)  # sockets not connected yet (--connect-rate paces them)
        total = len(pending)
        turn_start = now
        nodes = list(self.heard)
        for i, s in enumerate(nodes):
            heapq.heappush(self.beat_due, (now + STEP_S * (1 + random.random()), i))
        # the sockets' ZMQ_FD in one epoll: a turn reads only the sockets that signalled, were
        # sent on (a send may take a socket's signal) or were not read empty (self.check); a
        # zmq.Poller over the process's 512-4,096 sockets cost 0.5-4 ms of CPU per turn
        ep = select.epoll()
        ep.register(self.conn.fileno(), select.EPOLLIN)
        conn_fd = self.conn.fileno()
        by_fd: Dict[int, Any] = {}
        self.conn.send(("started", now))
        while True:
            due = len(pending) if not self.connect_rate else \
                min(len(pending), int((now - t_start) * self.connect_rate) + 1 - (total - len(pending)))
            for s in pending[:max(0, due)]:
                s.connect(self.wire.endpoint("127.0.0.1", self.port))
                fd = s.getsockopt(zmq.FD)
                by_fd[fd] = s
                ep.register(fd, select.EPOLLIN)
                self.check.add(s)
                for r in self.node_ranks[s]:
                    self.register(r, now)
            del pending[:max(0, due)]
            self.flush()
            # at most one poll per MIN_TURN_S: a poll costs O(sockets) in pyzmq, and with input
            # always pending (thousands of ranks) the loop spun on it and starved the heartbeats
            spare = turn_start + MIN_TURN_S - time.monotonic()
            if spare > 0:
                time.sleep(spare)
            turn_start = time.monotonic()
            ready = ep.poll(0.02 if not self.check else 0)
            now = time.monotonic()
            todo, self.check = self.check, set()
            for fd, _ in ready:
                if fd != conn_fd:
                    todo.add(by_fd[fd])
            for s in todo:
                if not s.closed and s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self.received(s, now)
            if self.conn.poll():
                cmd, arg = self.conn.recv()
                if cmd == "quit":
                    break
                if cmd == "kill" and arg in self.socks and not self.per_node:
                    fd = self.socks[arg].getsockopt(zmq.FD)
                    ep.unregister(fd)
                    del by_fd[fd]
                self.conn.send(self.command(cmd, arg))
            now = time.monotonic()
            while self.reg_due and self.reg_due[0][0] <= now:
                _, r = heapq.heappop(self.reg_due)
                if r not in self.registered and r not in self.dead:
                    self.register(r, now)
            while self.hb_due and self.hb_due[0][0] <= now:
                t, r = heapq.heappop(self.hb_due)
                if r in self.dead or self.exited[r]:
                    continue
                self.hb_late = max(self.hb_late, now - t)
                heapq.heappush(self.hb_due, (t + STEP_S, r))
                if not self.frozen[r] and self.hold is None:
                    self.it[r] += 1  # one step per second; its STATUS rides with the heartbeat flush
                    self.send(r, "status", self.status_body(r))
                if self.merge:  # the relay heard it: named in the node's next NODE_BEAT
                    if r in self.registered:
                        self.heard[self.socks[r]].append(self.sub[r])
                else:
                    self.send(r, "heartbeat", {"rank": r, "iteration": self.it[r], "status": "updated"})
            self.flush()
            while self.beat_due and self.beat_due[0][0] <= now:
                t, i = heapq.heappop(self.beat_due)
                heapq.heappush(self.beat_due, (t + STEP_S, i))
                self.beat(nodes[i])
            if self.slow_s:
                time.sleep(self.slow_s)
        ep.close()
        for s in self.node_ranks:
            if not s.closed:
                s.close(linger=0)
        self.ctx.term()


def unpack_subs(packed: bytes) -> List[bytes]:
    """``server.unpack_subs`` (each sub's length byte, then it)."""
    subs, i = [], 0
    while i < len(packed):
        subs.append(packed[i + 1:i + 1 + packed[i]])
        i += 1 + packed[i]
    return subs


def sim_main(conn, sim_id, ranks, world, port, key, slow_s, save_dir, pythonpath, connect_rate=0.0, per_node=0,
             merge=True, merge_answers=()):
    sys.path.insert(0, pythonpath)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sim = Sim(conn, sim_id, ranks, world, port, key, slow_s, save_dir, connect_rate, per_node, merge, merge_answers)
    sim.port = port
    sim.run()


# ---------------------------------------------------------------------- the bench
class Probe:
    """Frame handling times and turn lengths of the controller (wrapping its calls)."""

    def __init__(self, ctl):
        from mindspeed_ha.control import handlers, wire

        self.frames: List[float] = []
        self.turns: List[float] = []
        self.on = False
        codec_decode = ctl.codec.try_decode
        dispatch = handlers.dispatch
        register = handlers.register
        #: the controller's clock at the first and the last REGISTER handled (the last one's
        #: REGISTERED is sent before the call returns), and how many
        self.register_first: Optional[float] = None
        self.register_last: Optional[float] = None
        self.registers = 0

        def timed_register(*a, **k):
            register(*a, **k)
            self.register_last = time.monotonic()
            if self.register_first is None:
                self.register_first = self.register_last
            self.registers += 1
        turn = ctl._turn
        start = [0.0]

        def try_decode(*a, **k):
            start[0] = time.perf_counter()
            return codec_decode(*a, **k)

        def timed_dispatch(*a, **k):
            dispatch(*a, **k)
            if self.on:
                self.frames.append(time.perf_counter() - start[0])

        #: a cProfile.Profile to run the controller's turns under while set (``--profile-uce``)
        self.round_profile: Any = None

        #: while a list: each turn of the controller as (start, end on the controller's clock, its
        #: thread's CPU-seconds): where a round's wall time went (busy, not scheduled, waiting)
        self.round_turns: Optional[List[Any]] = None

        def timed_turn():
            t = time.perf_counter()
            record = self.round_turns
            if record is not None:
                w0, c0 = time.monotonic(), time.thread_time()
            prof = self.round_profile
            if prof is not None:
                prof.enable()  # on the controller's thread: its turns only
            turn()
            if prof is not None:
                prof.disable()
            if record is not None:
                record.append((w0, time.monotonic(), time.thread_time() - c0))
            if self.on:
                self.turns.append(time.perf_counter() - t)

        from mindspeed_ha.control.policy import table

        gone_ranks = table.gone_ranks
        self.silent: set = set()  # every rank the policy ever took for silent

        def watched_gone(*a, **k):
            gone = gone_ranks(*a, **k)
            self.silent.update(r for r, why in gone.items() if "heartbeat" in why)
            return gone

        #: fan-outs (``send_to_ranks``): (what, started, ended, ranks sent to), on the controller's clock
        self.fanouts: List[Any] = []
        fan = ctl.server.send_to_ranks

        def timed_fan(ranks, body):
            t = time.monotonic()
            sent = fan(ranks, body)
            what = type(body).__name__ + (f":{body.kind}" if hasattr(body, "kind") else "")
            self.fanouts.append((what, t, time.monotonic(), sent))
            return sent
        ctl.server.send_to_ranks = timed_fan
        #: connection closes handled: (rank, when the close was read, when it was handled)
        self.closes: List[Any] = []
        closed = handlers.connection_closed

        def timed_closed(c, rank, now):
            self.closes.append((rank, now, time.monotonic()))
            closed(c, rank, now)
        handlers.connection_closed = timed_closed
        #: FAULTs other than ``aborted`` handled: (when, rank, kind), on the controller's clock
        self.faults: List[Any] = []
        fault_handler = handlers.RANK_HANDLERS[wire.MsgType.FAULT]

        def watched_fault(c, now, rank, info, body):
            if body.kind != "aborted":
                self.faults.append((now, rank, body.kind))
            fault_handler(c, now, rank, info, body)
        handlers.RANK_HANDLERS[wire.MsgType.FAULT] = watched_fault
        from mindspeed_ha.control import controller as controller_mod
        decide = controller_mod.decide
        #: decision steps that ran ``decide``: (when, seconds it took), on the controller's clock
        self.decides: List[Any] = []

        def timed_decide(now, *a, **k):
            t = time.monotonic()
            d = decide(now, *a, **k)
            self.decides.append((now, time.monotonic() - t))
            return d
        controller_mod.decide = timed_decide
        ctl.codec.try_decode = try_decode
        handlers.dispatch = timed_dispatch
        handlers.register = timed_register
        table.gone_ranks = watched_gone
        ctl._turn = timed_turn
        self._undo = lambda: (setattr(handlers, "dispatch", dispatch), setattr(table, "gone_ranks", gone_ranks),
                              setattr(handlers, "register", register),
                              setattr(handlers, "connection_closed", closed),
                              handlers.RANK_HANDLERS.__setitem__(wire.MsgType.FAULT, fault_handler),
                              setattr(controller_mod, "decide", decide))

    def close(self):
        self._undo()


def pct(xs: List[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def listen_overflows() -> int:
    """The kernel's count of connections dropped because a listen queue was full (all ports)."""
    with open("/proc/net/netstat") as f:
        lines = f.read().splitlines()
    for head, vals in zip(lines[::2], lines[1::2]):
        if head.startswith("TcpExt:"):
            return int(dict(zip(head.split(), vals.split()))["ListenOverflows"])
    return 0


def ask(pipes, cmd, arg=None):
    for p in pipes:
        p.send((cmd, arg))
    return [p.recv() for p in pipes]


def thread_cpu_s(tid: Optional[int]) -> float:
    """CPU seconds (user + system) of one thread of this process (Linux ``/proc``)."""
    if tid is None:
        return float("nan")
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_split() -> Dict[str, float]:
    """CPU seconds so far of the process and of its controller thread (the Python loop); the
    rest is libzmq's I/O threads (CURVE handshakes, TCP) and the bench's own waiting."""
    import threading

    tid = next((t.native_id for t in threading.enumerate() if t.name == "mindspeed-ha-controller"), None)
    return {"process": cpu_s(), "thread": thread_cpu_s(tid)}


def one_run(n: int, sims: int, slow: int, slow_s: float, steady_s: float, log,
            profile: Optional[str] = None, register_wait: float = 60.0,
            connect_rate: float = 0.0, per_node: int = 0, merge: bool = True,
            merge_answers: Any = (), profile_uce: Optional[str] = None) -> Dict[str, Any]:
    from mindspeed_ha.config import HAConfig
    from mindspeed_ha.control.controller import Controller
    from mindspeed_ha.control.policy import ActionKind
    from mindspeed_ha.control.state import Phase

    key = secrets.token_bytes(32)
    save_dir = tempfile.mkdtemp(prefix="bench-scale-")
    cfg = HAConfig(enabled=True, distributed_optimizer=True, replica_count=REPLICAS, auth_key=key,
                   controller_addr="127.0.0.1", heartbeat_interval_s=1.0, heartbeat_timeout_s=10.0,
                   stop_timeout_s=30.0, action_timeout_s=120.0, connect_timeout_s=60.0, save_dir=save_dir,
                   hbm_repair=True)
    ctl = Controller(cfg, n, "127.0.0.1", 0)
    if profile:  # the controller thread under cProfile, written when it ends
        import cProfile
        run = ctl._run

        def profiled_run():
            prof = cProfile.Profile()
            try:
                prof.runcall(run)
            finally:
                prof.dump_stats(f"{profile}.{n}")
        ctl._run = profiled_run
    probe = Probe(ctl)
    ctl.start()
    out: Dict[str, Any] = {"ranks": n, "sims": sims, "slowed": slow, "per_node": per_node,
                           "merged": bool(per_node) and merge,
                           "merged_answers": sorted(merge_answers) if per_node and merge else [],
                           "load_before": os.getloadavg()[0]}
    import mindspeed_ha
    tree = os.path.dirname(os.path.dirname(os.path.abspath(mindspeed_ha.__file__)))  # the simulators use it too
    spawn = mp.get_context("spawn")
    pipes, procs = [], []
    per = [list(range(i, n, sims)) for i in range(sims)]
    try:
        for i in range(sims):
            a, b = spawn.Pipe()
            p = spawn.Process(target=sim_main, args=(b, i, per[i], n, ctl.port, key,
                                                     slow_s if i < slow else 0.0, save_dir, tree,
                                                     connect_rate / sims, per_node, merge, tuple(merge_answers)),
                              daemon=True)
            p.start()
            pipes.append(a)
            procs.append(p)
        overflows = listen_overflows()
        cpu_reg0 = cpu_split()
        starts = [p.recv()[1] for p in pipes]
        sims_cpu0 = sum(r["cpu_s"] for r in ask(pipes, "report"))
        t0 = min(starts)
        # 1. registration (the processor gives up after 60 s; the bench waits up to --register-wait)
        registered_60 = None
        while time.monotonic() < t0 + max(60.0, register_wait):
            with ctl._lock:
                k = len(ctl.state.ranks)
            if registered_60 is None and time.monotonic() >= t0 + 60.0:
                registered_60 = k
            if k >= n:
                break
            time.sleep(0.2)
        cpu_reg1 = cpu_split()
        out["registration_cpu_s"] = cpu_reg1["process"] - cpu_reg0["process"]
        out["registration_loop_cpu_s"] = cpu_reg1["thread"] - cpu_reg0["thread"]
        time.sleep(0.5)
        reps = ask(pipes, "report")
        regd = sum(r["registered"] for r in reps)
        # where registration's time went: the simulators' own CPU, and the controller's span
        # from its first REGISTER handled to its last REGISTERED sent
        out["registration_sims_cpu_s"] = sum(r["cpu_s"] for r in reps) - sims_cpu0
        out["registration_sims_cpu_max_s"] = max(r["cpu_s"] for r in reps)
        out["register_handled"] = probe.registers
        out["controller_first_register_s"] = (probe.register_first - t0) if probe.register_first else None
        out["controller_last_registered_s"] = (probe.register_last - t0) if probe.register_last else None
        out["registration_s"] = (max(r["last_registered"] or t0 for r in reps) - t0) if regd == n else None
        out["unregistered_60s"] = n - (registered_60 if registered_60 is not None else regd)
        out["register_frames"] = sum(r["register_sent"] for r in reps)
        out["register_max_per_rank"] = max(r["register_max"] for r in reps)
        out["listen_overflows"] = listen_overflows() - overflows  # machine-wide counter
        out["handshakes_failed"] = sum(ctl.transport_rejected.totals.values())
        out["duplicate_registers"] = getattr(ctl, "duplicate_registers", None)
        zap = ctl.server.zap or ctl.server.closed_zap
        out["handshakes_accepted"] = zap.counts["accepted"] if zap is not None else None
        out["frames_rejected"] = dict(ctl.codec.rejected)  # by reason (rate_limited, replay, ...)
        out["sim_dropped_registration"] = sum(r["dropped"] for r in reps)
        log(f"N={n} {'direct' if not per_node else f'{per_node} per node'}: registered {regd}/{n} in {out['registration_s']} s, REGISTER frames "
            f"{out['register_frames']} (max {out['register_max_per_rank']} per rank); CPU {out['registration_cpu_s']:.1f} s "
            f"({out['registration_loop_cpu_s']:.1f} s the loop thread); frames the simulators dropped (queue full) "
            f"{out['sim_dropped_registration']}; simulators' CPU {out['registration_sims_cpu_s']:.1f} s; the controller "
            f"handled {out['register_handled']} REGISTER from {out['controller_first_register_s']} s to "
            f"{out['controller_last_registered_s']} s")
        if regd < n:
            return out
        # 2. steady state
        time.sleep(2.0)
        probe.on = True
        reps = ask(pipes, "report")
        s0, m0 = sum(r["cpu_s"] for r in reps), sum(r["main_cpu_s"] for r in reps)
        c0, w0 = cpu_split(), time.monotonic()
        time.sleep(steady_s)
        c1, w1 = cpu_split(), time.monotonic()
        reps = ask(pipes, "report")
        s1, m1 = sum(r["cpu_s"] for r in reps), sum(r["main_cpu_s"] for r in reps)
        out["simulators_cores"] = (s1 - s0) / (w1 - w0)  # what sending the ranks' frames costs here
        out["simulators_main_cores"] = (m1 - m0) / (w1 - w0)  # their Python threads (the rest: libzmq's)
        probe.on = False
        out["controller_cores"] = (c1["process"] - c0["process"]) / (w1 - w0)
        out["loop_cores"] = (c1["thread"] - c0["thread"]) / (w1 - w0)
        out["rss_mb"] = rss_mb()
        out["frame_p50_us"] = pct(probe.frames, 0.5) * 1e6
        out["frame_p99_us"] = pct(probe.frames, 0.99) * 1e6
        out["frames_per_s"] = len(probe.frames) / (w1 - w0)
        # what the ranks send per second: a STATUS each, and a HEARTBEAT each or a NODE_BEAT per node
        out["frames_expected_per_s"] = n + (-(-n // per_node) if out["merged"] else n)
        out["node_beats"] = getattr(ctl, "node_beats", None)
        out["turn_max_ms"] = max(probe.turns, default=0.0) * 1e3
        out["turn_p99_ms"] = pct(probe.turns, 0.99) * 1e3
        log(f"N={n}: steady {out['controller_cores']:.2f} cores ({out['loop_cores']:.2f} the loop thread), "
            f"{out['frames_per_s']:.0f} of {out['frames_expected_per_s']} frames/s (simulators {out['simulators_cores']:.2f} cores), "
            f"p50 {out['frame_p50_us']:.0f} us, p99 {out['frame_p99_us']:.0f} us, turns max "
            f"{out['turn_max_ms']:.1f} ms, RSS {out['rss_mb']:.0f} MB")
        # 3. UCE -> RETRY at every rank
        with ctl._lock:
            k = max(i.iteration for i in ctl.state.ranks.values()) + 1
        ask(pipes, "hold", k)
        time.sleep(1.5)  # the held status reaches the controller with the next heartbeats
        uce_rank = n // 2 + 3
        if profile_uce:
            import cProfile
            probe.round_profile = cProfile.Profile()
            ask(pipes, "profile", None)
        reps = ask(pipes, "report")
        c_uce, s_uce, s_uce_main = cpu_split(), sum(r["cpu_s"] for r in reps), sum(r["main_cpu_s"] for r in reps)
        probe.round_turns = []
        t_uce = min(ask(pipes, "uce", uce_rank))
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            reps = ask(pipes, "report")
            if sum(r["retries"] for r in reps) >= n:
                break
            time.sleep(0.2)
        retried = sum(r["retries"] for r in reps)
        c_ret = cpu_split()
        turns, probe.round_turns = probe.round_turns, None
        if probe.round_profile is not None:
            prof, probe.round_profile = probe.round_profile, None
            time.sleep(0.2)  # (the turn under way ends)
            prof.dump_stats(f"{profile_uce}.{n}")
            ask(pipes, "profile", f"{profile_uce}.{n}")
        # CPU-seconds of the round (until every rank had its RETRY, plus at most one poll)
        out["uce_round_cpu_s"] = c_ret["process"] - c_uce["process"]
        out["uce_round_loop_cpu_s"] = c_ret["thread"] - c_uce["thread"]
        out["uce_round_sims_cpu_s"] = sum(r["cpu_s"] for r in reps) - s_uce
        out["uce_round_sims_main_cpu_s"] = sum(r["main_cpu_s"] for r in reps) - s_uce_main  # their Python threads
        fans = [f for f in probe.fanouts if f[1] >= t_uce]
        retry_fan = next((f for f in fans if f[0] == "Action:retry"), None)
        first_stop = next((f for f in fans if f[0] == "Stop"), None)
        # the round's steps on the controller: STOP(recover) sent, the RETRY fan-out started / ended
        out["uce_stop_sent_s"] = (first_stop[2] - t_uce) if first_stop else None
        abort = [f for f in fans if f[0] == "Stop"][1:2]  # the second round's STOP(recover), sent once all observed
        out["uce_abort_sent_s"] = (abort[0][2] - t_uce) if abort else None
        out["node_answers"] = getattr(ctl, "node_answers", None)
        with ctl._lock:  # the round on the controller's clock: its decisions and fan-outs (ended), s
            steps = [(round(e.t - t_uce, 3), e.action.value) for e in ctl.events if e.t >= t_uce]
        out["uce_timeline"] = sorted(steps + [(round(f[2] - t_uce, 3), f"sent {f[0]}") for f in fans]
                                     + [(round(f[0] - t_uce, 3), f"read FAULT {f[2]}") for f in probe.faults
                                        if f[0] >= t_uce])[:12]
        round_decides = [(round(t - t_uce, 3), round(c, 3)) for t, c in probe.decides
                         if t_uce <= t <= (retry_fan[1] if retry_fan else t)]
        out["uce_decide_steps"] = len(round_decides)  # decision steps in the round and their cost, s
        out["uce_decide_s"] = round(sum(c for _, c in round_decides), 3)
        out["uce_decides"] = round_decides[:40]
        out["uce_retry_decided_s"] = (retry_fan[1] - t_uce) if retry_fan else None
        out["uce_retry_sent_s"] = (retry_fan[2] - t_uce) if retry_fan else None
        out["uce_retry_s"] = (max(r["last_retry"] for r in reps if r["last_retry"]) - t_uce) if retried == n else None
        if out["uce_retry_s"] is not None:  # the controller thread from the UCE to the last rank's RETRY
            end = t_uce + out["uce_retry_s"]
            inside = [(max(a, t_uce), min(b, end), c * (min(b, end) - max(a, t_uce)) / max(b - a, 1e-9))
                      for a, b, c in turns if b > t_uce and a < end]
            out["uce_turns"] = len(inside)
            out["uce_turns_wall_s"] = round(sum(b - a for a, b, _ in inside), 3)  # in a turn (running or not)
            out["uce_turns_cpu_s"] = round(sum(c for _, _, c in inside), 3)  # of which on a CPU
            out["uce_waiting_s"] = round(out["uce_retry_s"] - out["uce_turns_wall_s"], 3)  # between turns: polling
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and ctl.phase is not Phase.RUNNING:
            time.sleep(0.1)
        with ctl._lock:
            out["uce_outcome"] = ctl.events[-1].reason[:160] if ctl.events else ""
            out["uce_recovered"] = bool(ctl.state.recoveries and ctl.state.recoveries[-1].get("done_at"))
        log(f"N={n}: UCE -> RETRY at {retried}/{n} ranks in {out['uce_retry_s']} s (controller: STOP sent at "
            f"{out['uce_stop_sent_s']}, abort sent at {out['uce_abort_sent_s']}, RETRY fan-out {out['uce_retry_decided_s']} -> {out['uce_retry_sent_s']} s; CPU {out['uce_round_cpu_s']:.2f} s, loop "
            f"{out['uce_round_loop_cpu_s']:.2f} s, simulators {out['uce_round_sims_cpu_s']:.2f} s); recovered "
            f"{out['uce_recovered']}: {out['uce_outcome']}")
        time.sleep(3.0)
        # 4. death -> STOP at every survivor, -> dying checkpoint committed
        with ctl._lock:
            k = max(i.iteration for i in ctl.state.ranks.values()) + 1
        ask(pipes, "hold", k)
        time.sleep(1.5)
        victim = n // 3 + 1
        t_kill = min(ask(pipes, "kill", victim))
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            reps = ask(pipes, "report")
            if sum(r["stops"] for r in reps) >= n - 1:
                break
            time.sleep(0.2)
        stops = sum(r["stops"] for r in reps)
        stop_fan = next((f for f in probe.fanouts if f[1] >= t_kill and f[0] == "Stop"), None)
        out["death_stop_decided_s"] = (stop_fan[1] - t_kill) if stop_fan else None  # the close handled, decided
        with ctl._lock:
            first = next((e for e in ctl.events if e.t >= t_kill), None)
        out["death_step_began_s"] = (first.t - t_kill) if first else None  # the decision step's clock read
        close = next((c for c in probe.closes if c[0] == victim), None)
        out["death_close_read_s"] = (close[1] - t_kill) if close else None  # the relay's report read
        out["death_stop_sent_s"] = (stop_fan[2] - t_kill) if stop_fan else None  # the fan-out's last send
        out["death_stop_s"] = (max(r["last_stop"] for r in reps if r["last_stop"]) - t_kill) if stops == n - 1 \
            else None
        done = ctl.wait_done(240.0)
        with ctl._lock:
            committed = [e for e in ctl.events if e.action is ActionKind.EXIT]
            out["exit_code"] = ctl.state.exit_code
            out["death_commit_s"] = (committed[0].t - t_kill) if committed and ctl.state.exit_code == 75 else None
            out["exit_reason"] = ctl.state.exit_reason[:200]
            false = sorted(r for r, i in ctl.state.ranks.items() if r != victim and not i.alive
                           and "goodbye" not in i.dead_reason)
            silent = sum(1 for e in ctl.events if "heartbeat" in e.reason)  # decisions that name a silence
            longest_reason = max((len(e.reason) for e in ctl.events), default=0)
        out["false_deaths"] = len(set(false) | (probe.silent - {victim}))  # dead, or taken for silent
        out["silence_decisions"] = silent
        reps = ask(pipes, "report")
        out["sim_lag_max_s"] = max(r["hb_late"] for r in reps)
        out["sim_dropped"] = sum(r["dropped"] for r in reps)  # frames the simulators could not queue
        out["longest_reason_chars"] = longest_reason
        log(f"N={n}: death -> STOP at {stops}/{n - 1} survivors in {out['death_stop_s']} s (controller: decided "
            f"{out['death_stop_decided_s']} (close read {out['death_close_read_s']}, its step began {out['death_step_began_s']}), sent {out['death_stop_sent_s']} s); -> exit "
            f"{out['exit_code']} in {out['death_commit_s']} s ({out['exit_reason']}); false deaths "
            f"{out['false_deaths']}; done {done is not None}")
        out["load_after"] = os.getloadavg()[0]
        return out
    finally:
        for p in pipes:
            try:
                p.send(("quit", None))
            except OSError:
                pass
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        ctl.stop()
        probe.close()
        import shutil
        shutil.rmtree(save_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--sims", type=int, default=4, help="simulator processes (default 4)")
    ap.add_argument("--slow", type=int, default=0, help="how many simulator processes are slowed (default 0)")
    ap.add_argument("--slow-s", type=float, default=0.25, help="sleep of a slowed simulator per loop turn, s")
    ap.add_argument("--steady-s", type=float, default=10.0, help="seconds of steady state measured")
    ap.add_argument("--log-file", default=os.devnull, help="the controller's log (INFO; default: discarded)")
    ap.add_argument("--register-wait", type=float, default=60.0,
                    help="seconds the bench waits for every rank to register before it gives up (>= 60; the "
                         "processors' own timeout is 60 s: later ones are counted as unregistered_60s)")
    ap.add_argument("--profile", default=None, help="write the controller thread's cProfile stats to PROFILE.<N>")
    ap.add_argument("--profile-uce", default=None,
                    help="write the cProfile stats of the controller's turns during the UCE round to PROFILE_UCE.<N>")
    ap.add_argument("--connect-rate", type=float, default=0.0,
                    help="connections opened per second by all simulators together (default 0: every rank at once)")
    ap.add_argument("--per-node", type=int, nargs="+", default=[0],
                    help="ranks per simulated node relay, one run per value (0: one connection per rank; 8: the "
                         "ranks of a node share one, as behind control/relay.py); e.g. --per-node 0 8")
    ap.add_argument("--no-merge", action="store_true",
                    help="relayed: forward every rank's HEARTBEAT frame instead of one NODE_BEAT per node and second "
                         "(the relay's default since wire schema 13)")
    ap.add_argument("--merge-answers", nargs="*", default=None, metavar="TYPE",
                    help="relayed and merged: the answers the simulated relays merge into NODE_ANSWERS (wire schema "
                         "14; default: all the relay merges, wire.MERGEABLE; none given: none)")
    ap.add_argument("--json", default=None, help="append the figures to this file (one JSON line per N)")
    ns = ap.parse_args()
    if not ns.connect_rate >= 0:
        ap.error(f"--connect-rate={ns.connect_rate} must be >= 0 (0: all at once)")
    if not 1 <= ns.sims <= 64 or not 0 <= ns.slow <= ns.sims:
        ap.error(f"--sims={ns.sims} must be 1..64 and --slow={ns.slow} 0..--sims")
    if any(n < ns.sims for n in ns.ranks):
        ap.error("--ranks: each N must be >= --sims")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # the controller's log at INFO, as a job runs it (its cost counts), to --log-file
    logging.basicConfig(level=logging.INFO, filename=ns.log_file,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    say = lambda s: print(time.strftime("%H:%M:%S"), s, flush=True)  # noqa: E731
    if any(k < 0 for k in ns.per_node):
        ap.error(f"--per-node={ns.per_node}: each must be >= 0 (0: no relay)")
    from mindspeed_ha.control import wire
    mergeable = sorted(getattr(wire, "MERGEABLE", {}))
    merge_answers = mergeable if ns.merge_answers is None else ns.merge_answers
    if not set(merge_answers) <= set(mergeable):
        ap.error(f"--merge-answers={ns.merge_answers}: each must be one of {mergeable}")
    for n in ns.ranks:
        for k in ns.per_node:
            res = one_run(n, ns.sims, ns.slow, ns.slow_s, ns.steady_s, say, ns.profile, ns.register_wait,
                          ns.connect_rate, k, not ns.no_merge, merge_answers, ns.profile_uce)
            say(json.dumps(res))
            if ns.json:
                with open(ns.json, "a") as f:
                    f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
