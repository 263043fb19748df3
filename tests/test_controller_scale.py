"""The controller with 1,024 simulated ranks: no false death, the dying checkpoint committed.

In-process and deterministic: the real :class:`Controller` (its handlers, policy and
effects, the real wire frames: msgpack, HMAC, per-sender ``seq``) is driven turn by turn
(``Controller._turn``) on a fake clock, its ROUTER replaced by a stand-in that reads the
connections fairly and, like a loaded controller, costs ``SEND_S`` of the clock per frame
sent once every rank registered: one fan-out to 1,023 survivors takes 20 s, twice the heartbeat timeout. The
simulated ranks (layout TP 8, PP 2, DP 64, two optimizer replicas: 512 shards) send a
HEARTBEAT (relayed: their node's NODE_BEAT names them) and a STATUS each second, answer STOP with STOPPED and every action ok (the
savers write nothing). CURVE and real sockets are the benchmark's
(``scripts/bench_controller_scale.py``); no latency is asserted here.
"""

from __future__ import annotations

import collections
import gc

import pytest
import zmq

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control import wire
from mindspeed_ha.control.controller import Controller
from mindspeed_ha.control.policy import ActionKind
from mindspeed_ha.control.server import unpack_subs
from mindspeed_ha.control.state import Layout, Phase
from mindspeed_ha.faults import EXIT_DYING_CHECKPOINT_SAVED

KEY = b"s" * 32
WORLD = 1024
TP, PP, REPLICAS = 8, 2, 2
DP = WORLD // (TP * PP)
SEND_S = 0.02  # clock seconds per frame the controller sends (a slow fan-out)
TICK_S = 0.05
CFG = HAConfig(enabled=True, distributed_optimizer=True, replica_count=REPLICAS, auth_key=KEY,
               controller_addr="127.0.0.1", heartbeat_interval_s=1.0, heartbeat_timeout_s=10.0, stop_timeout_s=30.0,
               action_timeout_s=600.0, connect_timeout_s=60.0, save_dir=None)


def layout(rank):
    spi = DP // REPLICAS
    tp, dp, pp = rank % TP, (rank // TP) % DP, rank // (TP * DP)
    return Layout(tp_rank=tp, pp_rank=pp, dp_rank=dp, tp_size=TP, pp_size=PP, dp_size=DP, replica_count=REPLICAS,
                  instance_id=dp // spi, shard_id=dp % spi)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class SlowRouter:
    """The ROUTER's stand-in: fair reads (one frame per connection in turn), and every
    frame sent costs ``send_s`` of the clock."""

    def __init__(self, clock):
        self.clock = clock
        self.send_s = 0.0  # SEND_S once every rank registered: the fan-outs are slow
        self.queues = collections.OrderedDict()
        self.sent = []
        self.messages_to_relays = 0

    def push(self, ident, data):
        """Queue ``data`` from connection ``ident`` (a rank's, or (relay, sub): a node relay's
        message [sub, frame]; an empty frame is the relay's report of a closed connection)."""
        self.queues.setdefault(ident, collections.deque()).append(data)

    def recv_multipart(self, flags=0, copy=True):
        while self.queues:
            ident, q = next(iter(self.queues.items()))
            if not q:
                del self.queues[ident]
                continue
            self.queues.move_to_end(ident)
            head = [_Frame(ident)] if type(ident) is bytes else [_Frame(ident[0]), _Frame(ident[1])]
            return head + [_Frame(q.popleft())]
        raise zmq.Again()

    def send_multipart(self, parts, flags=0):
        """One frame to a rank, or [relay, sub, frame, sub, frame, ...] to the ranks behind a relay,
        or [relay, b"", frame, packed subs]: the same frame to several of them."""
        self.clock.t += self.send_s
        if len(parts) == 2:
            self.sent.append((bytes(parts[0]), bytes(parts[1])))
            return
        self.messages_to_relays += 1
        if len(parts) == 4 and not parts[1]:
            self.sent += [((bytes(parts[0]), sub), bytes(parts[2])) for sub in unpack_subs(bytes(parts[3]))]
            return
        for i in range(1, len(parts), 2):
            self.sent.append(((bytes(parts[0]), bytes(parts[i])), bytes(parts[i + 1])))


class _Frame:
    def __init__(self, data):
        self.bytes = data
        self.buffer = memoryview(data)

    def __len__(self):
        return len(self.bytes)

    def get(self, option):
        raise zmq.ZMQError(zmq.EINVAL)


class Ranks:
    """The simulated ranks: their codecs, iteration, and answers to what the controller sent."""

    def __init__(self, router, clock, per_node=0):
        self.router, self.clock = router, clock
        self.out = {r: wire.Codec(KEY, wire.new_sender("processor", r)) for r in range(WORLD)}
        self.inn = {r: wire.Codec(KEY, f"rx-{r}") for r in range(WORLD)}
        # per_node: the ranks of a node reach the controller through its relay (control/relay.py)
        self.ident = {r: (b"n%d" % (r // per_node), b"r%d" % r) if per_node else b"r%d" % r for r in range(WORLD)}
        self.rank_of = {v: k for k, v in self.ident.items()}
        self.dead = set()
        self.iteration = 5
        self.frozen = False
        self.next_beat = {r: clock.t + (r % 100) / 100 for r in range(WORLD)}
        # relayed: a rank's heartbeat is its sub named in its relay's next NODE_BEAT (one per
        # node and second, as control/relay.py merges them; wire schema 13), not a frame
        self.per_node = per_node
        nodes = sorted({self.ident[r][0] for r in range(WORLD)}) if per_node else []
        self.relay_out = {n: wire.Codec(KEY, wire.new_sender("relay", i)) for i, n in enumerate(nodes)}
        self.heard = {n: [] for n in nodes}
        self.next_node_beat = {n: clock.t + (i % 20) / 20 for i, n in enumerate(nodes)}
        self.read = 0
        self.received = collections.defaultdict(list)  # message type -> [(rank, body)]
        self.frames = collections.defaultdict(set)  # message type -> distinct frames

    def send(self, r, body):
        if r not in self.dead:
            self.router.push(self.ident[r], self.out[r].encode(body))

    def beat(self):
        """Each live rank whose second is up: STATUS and HEARTBEAT (its next one in a second)."""
        now = self.clock.t
        for r in range(WORLD):
            if r in self.dead or self.next_beat[r] > now:
                continue
            self.next_beat[r] = max(self.next_beat[r] + 1.0, now)  # a stalled controller's clock jump: one
            self.send(r, wire.Status(r, "updated", self.iteration, self.iteration + 1))
            if self.per_node:
                self.heard[self.ident[r][0]].append(self.ident[r][1])
            else:
                self.send(r, wire.Heartbeat(r, self.iteration, "updated"))
        for n, at in self.next_node_beat.items():
            if at <= now:
                self.next_node_beat[n] = max(at + 1.0, now)
                subs, self.heard[n] = self.heard[n], []
                if subs:
                    self.router.push(n, self.relay_out[n].encode(wire.NodeBeat(int(n[1:]), subs)))

    def answer(self):
        """Read what the controller sent since last time and answer it as a processor would."""
        sent, self.read = self.router.sent[self.read:], len(self.router.sent)
        for ident, frame in sent:
            r = self.rank_of[ident]
            msg = self.inn[r].decode(frame)
            self.received[msg.type].append((r, msg.body))
            self.frames[msg.type].add(frame)
            if msg.type is wire.MsgType.STOP:
                self.frozen = True
                self.send(r, wire.Stopped(r, "updated", self.iteration, -1, self.iteration + 1))
            elif msg.type is wire.MsgType.ACTION and msg.body.kind == ActionKind.EXIT.value:
                self.send(r, wire.Goodbye(r, int(msg.body.params["code"])))
            elif msg.type is wire.MsgType.ACTION:
                self.send(r, wire.ActionResult(msg.body.action_id, r, True, f"simulated {msg.body.kind}"))


def run(ctl, ranks, clock, until, max_turns):
    for _ in range(max_turns):
        if until():
            return True
        if not ranks.frozen:
            ranks.beat()
        ctl._turn()
        ranks.answer()
        clock.t += TICK_S
    return until()


@pytest.mark.parametrize("per_node", [0, 8], ids=["direct", "relayed"])
def test_1024_ranks_one_death_no_false_death_and_the_dying_checkpoint_committed(per_node):
    """``relayed``: 8 ranks per node relay; the ranks' liveness is their relays' NODE_BEATs
    (merged heartbeats), the victim's death is its relay's report of its closed connection,
    and a fan-out is one message per relay."""
    clock = Clock()
    ctl = Controller(CFG, WORLD, "127.0.0.1", 0, tick_s=TICK_S, clock=clock)  # never started: no socket
    router = SlowRouter(clock)
    ctl._router = router
    ranks = Ranks(router, clock, per_node)
    for r in range(WORLD):
        body = wire.Register(r, WORLD, 10_000 + r, "node", layout(r), "/save", "run", "updated", ranks.iteration)
        ranks.send(r, body)
        if r % 4 == 0:
            ranks.send(r, body)  # re-sent before the answer came: answered again, nothing else
    assert run(ctl, ranks, clock, lambda: len(ctl.state.ranks) == WORLD and not any(router.queues.values()), 100)
    assert ctl.duplicate_registers == WORLD // 4
    assert ctl.heap_frozen and gc.get_freeze_count() > 0  # once every rank registered (handlers.FREEZE_HEAP_FROM)
    gc.unfreeze()  # this test's process: as the controller thread's end would
    assert len(ranks.received[wire.MsgType.REGISTERED]) == WORLD + WORLD // 4
    router.send_s = SEND_S

    # steady state: three seconds of heartbeats and status, no decision but NOOP
    t_end = clock.t + 3.0
    run(ctl, ranks, clock, lambda: clock.t >= t_end, 1000)
    assert not ctl.events

    victim = 517
    ranks.dead.add(victim)
    if per_node:
        router.push(ranks.ident[victim], b"")  # its relay: the local connection closed
    else:
        ctl.report_rank_exit(victim, -9)
    assert run(ctl, ranks, clock, lambda: ctl.state.phase is Phase.DONE, 2000), ctl.events[-3:]

    out = ctl.outcome()
    assert out.exit_code == EXIT_DYING_CHECKPOINT_SAVED, out.reason
    assert out.fault_rank == victim and out.iteration == ranks.iteration
    # no false death: every survivor answered STOP, none taken for silent or dead
    assert not [r for r, i in ctl.state.ranks.items() if r != victim and "goodbye" not in i.dead_reason
                and not i.alive], [ctl.state.ranks[r].dead_reason for r in ctl.state.ranks if r != victim][:3]
    assert not [e.reason for e in ctl.events if "heartbeat" in e.reason]
    assert len({r for r, _ in ranks.received[wire.MsgType.STOP]}) == WORLD - 1
    if not per_node:  # (relayed, a fan-out is 128 messages, not 1,023: it is not slow)
        assert ctl.busy_credited_s >= SEND_S * (WORLD - 1) - 1  # the slow fan-outs were credited
    # one STOP frame for every survivor (encoded once); each saver got only its own part of the plan
    assert len(ranks.frames[wire.MsgType.STOP]) == 1
    dumps = [(r, b) for r, b in ranks.received[wire.MsgType.ACTION] if b.kind == ActionKind.DUMP.value]
    assert sorted(r for r, _ in dumps) == list(out.plan.savers())
    assert len(out.plan.shard_savers) == TP * PP * (DP // REPLICAS)
    for r, body in dumps:
        assert [s[3] for s in body.params["shard_savers"]] == [r]
    if per_node:  # the death was the relay's close report; STOP reached the survivors one message per relay
        assert "control connection closed" in ctl.events[0].reason, ctl.events[0].reason
        assert ctl.node_beats >= 2 * WORLD // per_node and ctl.beat_unknown == 0  # liveness by NODE_BEATs
        assert router.messages_to_relays >= WORLD // per_node
    # reasons stay short whatever the size of the job
    assert max(len(e.reason) for e in ctl.events) < 1000


def test_a_step_that_sent_a_round_ends_without_deciding_again(monkeypatch):
    """A decision that sent a round (here the STOP after a death) ends the decision step:
    nothing was read since, so a second ``decide`` (O(N): 10-40 ms at 16,384 ranks) could
    only wait for the answers. A graceful stop's preemption deadline can end a round at once:
    then the step decides again, as before."""
    from mindspeed_ha.control import controller as controller_mod
    from mindspeed_ha.control.policy import Decision, decide

    calls = []

    def counted(now, state, config):
        d = decide(now, state, config)
        calls.append(d.action)
        return d

    monkeypatch.setattr(controller_mod, "decide", counted)
    clock = Clock()
    ctl = Controller(CFG, 4, "127.0.0.1", 0, tick_s=TICK_S, clock=clock)  # never started: no socket
    router = SlowRouter(clock)
    ctl._router = router
    out = {r: wire.Codec(KEY, wire.new_sender("processor", r)) for r in range(4)}
    for r in range(4):
        router.push(b"r%d" % r, out[r].encode(wire.Register(r, 4, 100 + r, "h", Layout(), None, "run")))
    ctl._turn()
    assert len(ctl.state.ranks) == 4 and ctl.state.phase is Phase.RUNNING
    calls.clear()
    clock.t += 1.0
    ctl.report_rank_exit(2, -9)
    ctl._turn()
    assert calls == [ActionKind.STOP_ALL], calls  # STOP sent to ranks 0, 1, 3: no second decide
    assert ctl.state.phase is Phase.STOPPING and ctl.state.ranks[0].stopped is False
    clock.t += 1.0
    for r in (0, 1, 3):  # the answers: the next step goes on from them
        router.push(b"r%d" % r, out[r].encode(wire.Stopped(r, "updated", 0, -1, 1)))
    calls.clear()
    ctl._turn()
    assert calls and calls[0] is not ActionKind.NOOP, calls

    stop = Decision(ActionKind.STOP_ALL, "x", None, (0,))
    assert controller_mod.awaits_answers(ctl.state, stop)
    assert not controller_mod.awaits_answers(ctl.state, Decision(ActionKind.STOP_ALL, "x", None, ()))  # none sent
    assert not controller_mod.awaits_answers(ctl.state, Decision(ActionKind.RESUME, "x", None, ()))
    ctl.state.stop_request = object()  # a graceful stop: its deadline may end the round at once
    assert not controller_mod.awaits_answers(ctl.state, stop)


def _bench():
    """``scripts/bench_controller_scale.py`` as a module (its simulated ranks)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench_controller_scale.py"
    spec = importlib.util.spec_from_file_location("bench_controller_scale", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_benchmark_notes_a_nodes_alike_answers_as_its_ranks_would():
    """The benchmark's simulated relay notes a node's alike routine answers (STOP, the abort
    STOP, RETRY) in one step per answer type: the NODE_ANSWERS frames it then sends are the
    same bytes as when each rank answers on its own (the controller gets what it got), also
    for a node with the UCE rank, a dead rank, or a replayed frame (those ranks handled one by
    one)."""
    import copy

    bench = _bench()
    world, ranks = 64, list(range(0, 64, 2))  # 32 ranks of one simulator process: 4 nodes of 8
    sim = bench.Sim(None, 0, ranks, world, 0, KEY, 0.0, "/save", per_node=8, merge=True,
                    merge_answers=tuple(wire.MERGEABLE))
    try:
        ctl = wire.Codec(KEY, wire.new_sender("controller"))
        for r in ranks:
            sim.it[r] = 7
        sim.uce_rank, sim.dead = 36, {50}  # in the third node; the fourth has a dead rank
        rounds = [wire.Stop("observe", False, False), wire.Stop("abort", True, True),
                  wire.Action(3, "retry", {"iteration": 7})]
        nodes = list(sim.node_ranks.items())
        state = ("answers", "answer_seq", "out", "seq", "last_in", "stop_at", "retry_at", "frozen", "hold", "sent")
        for body in rounds:
            m = sim.dec(None, ctl.encode(body))
            before = {k: copy.copy(getattr(sim, k)) for k in state}
            frames = {}
            for fast in (False, True):
                for k, v in before.items():
                    setattr(sim, k, copy.copy(v) if not isinstance(v, dict) else
                            {kk: copy.copy(vv) for kk, vv in v.items()})
                sim.fast = fast
                for i, (s, node) in enumerate(nodes):
                    subs = [sim.sub[r] for r in node]
                    sim.fanout(s, m, subs if i != 1 else subs + subs[:1], 1.0)  # node 1: a sub named twice
                for s in sim.answers:
                    sim.flush_answers(s)
                frames[fast] = ([(node, sim.out.get(s)) for s, node in nodes],
                                {k: getattr(sim, k) for k in state if k not in ("answers", "out")})
            for a, b in zip(frames[True][0], frames[False][0]):
                assert a == b, (body, a[0], [p[:200] for p in a[1]], [p[:200] for p in b[1]])
            assert frames[True] == frames[False]
            assert all(parts for _, parts in frames[True][0]), frames[True][0]
        assert sim.rejected == 2 * 3  # the sub named twice: its frame's seq seen (both passes, 3 rounds)
    finally:
        for s in sim.node_ranks:
            s.close(linger=0)
        sim.ctx.term()
