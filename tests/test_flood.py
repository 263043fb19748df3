"""A control plane nobody can starve: floods, forged and replayed frames, many connections.

Three layers, each tested on its own and then together in a real training run:

* transport (``control/auth.py``): CURVE with keys derived from the job's auth key, ZAP
  checking the client key. A peer without the key (no security, another key, the
  server's public key but its own client key, raw TCP garbage, huge length prefixes)
  never gets a frame to the controller's application; a connection that never completes
  its handshake is closed at the handshake deadline, and idle connections beyond the
  controller's descriptor limit do not keep a rank from registering;
* admission (``control/admission.py``): per-peer rate budgets, checked before a frame is
  authenticated, and rejection logs that write a bounded number of lines;
* the controller's loop (``Controller._turn``): bounded batches, registered ranks'
  frames first, each frame stamped when handled, then always the decision step.

The unit tests drive these with chosen times (a fake clock, a fake ROUTER that reads its
connections fairly, as ZeroMQ's does). The end-to-end tests flood the controller port of
a real 4-rank job from a separate attacker process (this file run as a script), which also
holds the job's key for part of its traffic (an insider whose frames pass CURVE and must
be stopped by the frame checks and budgets). They assert outcomes: exit 0 with losses
bitwise equal to an unattacked run; a rank killed during the flood still ends in the
dying checkpoint of the last completed iteration. Never latencies.

Run the attacker by hand::

    python tests/test_flood.py --port 8000 --key-hex $MINDSPEED_HA_AUTH_KEY --stats flood.json
"""

import argparse
import collections
import json
import os
import random
import re
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import zmq

from mindspeed_ha import faults
from mindspeed_ha.config import ConfigError, HAConfig
from mindspeed_ha.control import admission, auth, server, wire
from mindspeed_ha.control.controller import MAX_FRAMES_PER_TURN, Controller
from mindspeed_ha.control.policy import ActionKind
from mindspeed_ha.control.processor import Processor
from mindspeed_ha.control.state import Layout, Phase
from test_control import closing, no_leaks  # noqa: F401  (fixtures: teardown, no leaked threads/contexts)

KEY = b"f" * 32
CFG = HAConfig(enabled=True, distributed_optimizer=True, replica_count=2, auth_key=KEY, controller_addr="127.0.0.1",
               heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0, stop_timeout_s=5.0, action_timeout_s=10.0,
               connect_timeout_s=10.0, save_dir=None)


# =============================================================================== admission
def test_token_bucket_refills_at_its_rate_up_to_its_burst():
    b = admission.TokenBucket(rate=10, burst=5, now=0.0)
    assert [b.allow(0.0) for _ in range(6)] == [True] * 5 + [False]
    assert b.allow(0.1) and not b.allow(0.1)  # 0.1 s at 10/s: one token
    assert sum(b.allow(100.0) for _ in range(10)) == 5  # never more than the burst
    assert not b.allow(50.0)  # a clock going back adds nothing


def test_peer_limiter_ranks_own_budgets_strangers_share_one():
    lim = admission.PeerLimiter(strangers_rate=50, strangers_burst=50, max_strangers=8)
    # one stranger: its own small bucket
    assert sum(lim.allow(b"evil", False, 0.0) for _ in range(1000)) == admission.STRANGER_BURST
    # many strangers: together never more than the shared budget (what is left of it)
    admitted = sum(lim.allow(b"evil-%d" % i, False, 0.0) for i in range(1000))
    assert admitted == 50 - admission.STRANGER_BURST
    # a registered rank is unaffected by all of that
    assert sum(lim.allow(b"r0", True, 0.0) for _ in range(100)) == 100
    # a flooding rank is limited too, at a rate no healthy rank comes near
    assert sum(lim.allow(b"r0", True, 0.0) for _ in range(10000)) == admission.RANK_BURST - 100
    # a second later the shared budget is back
    assert lim.allow(b"newcomer", False, 1.0)
    assert len(lim._strangers) <= 8  # bounded table


def test_reject_log_writes_a_bounded_number_of_lines_with_counts(caplog):
    import logging

    caplog.set_level(logging.WARNING)
    rl = admission.RejectLog(logging.getLogger("test.flood"), "control frame", interval_s=10, max_lines=3)
    rl.note("p0", "bad_mac", 0.0)
    assert rl.lines == 1 and "from p0" in caplog.records[0].getMessage()  # the first one is news
    for i in range(100_000):  # 60 s of rejections from 500 peers
        rl.note(f"p{i % 500}", "replay" if i % 2 else "bad_mac", i * 60.0 / 100_000)
    rl.flush(70.0)
    assert rl.totals == {"bad_mac": 50_001, "replay": 50_000}
    windows = 8  # [0, 10), [10, 20), ... up to the flush at 70
    assert rl.lines <= windows * (3 + 1), rl.lines
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "rejected from" in text and "more control frames" in text  # summaries carry the counts
    # one peer flooding alone: one line per interval, with the count since the last
    caplog.clear()
    rl = admission.RejectLog(logging.getLogger("test.flood"), "control frame", interval_s=10, max_lines=3)
    for i in range(3001):
        rl.note("solo", "short", i * 0.01)
    assert [re.search(r"rejected: (\d+) since", r.getMessage()).group(1) for r in caplog.records] == \
        ["1", "999", "1000", "1000"]


def test_ranks_first_keeps_arrival_order_within_each_group():
    batch = [("e", 1), ("r0", 1), ("e", 2), ("r1", 1), ("r0", 2)]
    assert admission.ranks_first(batch, lambda x: x[0].startswith("r")) == \
        [("r0", 1), ("r1", 1), ("r0", 2), ("e", 1), ("e", 2)]


# =============================================================================== the loop
class FakeFrame:
    def __init__(self, data):
        self.bytes = data
        self.buffer = memoryview(data)

    def get(self, option):
        raise zmq.ZMQError(zmq.EINVAL)


class FairRouter:
    """Stands in for the controller's ROUTER socket: reads its connections in turn, one
    frame each (ZeroMQ's fair queuing), records what is sent."""

    def __init__(self):
        self.queues = collections.OrderedDict()
        self.sent = []

    def push(self, ident, data):
        self.queues.setdefault(ident, collections.deque()).append(data)

    def pending(self):
        return sum(len(q) for q in self.queues.values())

    def recv_multipart(self, flags=0, copy=True):
        while self.queues:
            ident, q = next(iter(self.queues.items()))
            if not q:
                del self.queues[ident]
                continue
            self.queues.move_to_end(ident)
            return [FakeFrame(ident), FakeFrame(q.popleft())]
        raise zmq.Again()

    def send_multipart(self, parts, flags=0):
        self.sent.append(parts)


class FakeClock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


def _sim(world=2):
    """A controller that is not started: its turns are driven by hand with a chosen time."""
    clock = FakeClock()
    ctl = Controller(CFG, world, "127.0.0.1", 0, clock=clock)
    ctl._router = FairRouter()
    codecs = [wire.Codec(KEY, wire.new_sender("rank", r)) for r in range(world)]
    for r, codec in enumerate(codecs):
        lay = Layout(dp_rank=r, dp_size=world, replica_count=world, instance_id=r)
        ctl._router.push(b"r%d" % r, codec.encode(wire.Register(r, world, 1000 + r, "h", lay, "/save", "run",
                                                                 "updated", 1)))
    ctl._turn()
    assert sorted(ctl.state.ranks) == list(range(world))
    return ctl, clock, codecs


def test_turn_reads_one_bounded_batch_then_decides():
    ctl, clock, _ = _sim()
    for _ in range(10 * MAX_FRAMES_PER_TURN):
        ctl._router.push(b"evil", b"x")
    clock.t += CFG.heartbeat_timeout_s + 1  # both ranks silent since they registered
    ctl._turn()
    assert ctl._router.pending() == 9 * MAX_FRAMES_PER_TURN  # one batch read, the rest left queued
    assert ctl.events[0].action is ActionKind.STOP_ALL  # the decision ran all the same
    assert "missed heartbeats" in ctl.events[0].reason
    assert ctl.codec.rejected["rate_limited"] == MAX_FRAMES_PER_TURN - admission.STRANGER_BURST


def test_flood_that_never_drains_cannot_starve_liveness():
    """64 peers send twice what the controller reads; the backlog grows without end, yet
    for ten heartbeat timeouts the live ranks stay alive, and a rank that falls silent is
    declared dead in the first turn after its timeout."""
    ctl, clock, codecs = _sim()
    router = ctl._router
    forger = wire.Codec(b"w" * 32, "rank-0-forged")  # right format, wrong key
    insider = wire.Codec(KEY, "rank-1-replayed")  # right key: accepted once, then replays
    replayed = insider.encode(wire.Heartbeat(1, 1, "updated"))
    kinds = [b"x", forger.encode(wire.Heartbeat(0, 1, "updated")), replayed, b"\xff" * 100]
    turns_per_interval = 4
    per_peer = 2 * turns_per_interval * MAX_FRAMES_PER_TURN // 64

    def interval(live):
        for i in range(64):
            for j in range(per_peer):
                router.push(b"evil-%d" % i, kinds[(i + j) % len(kinds)])
        for r in live:
            router.push(b"r%d" % r, codecs[r].encode(wire.Heartbeat(r, 1, "updated")))
        for _ in range(turns_per_interval):
            ctl._turn()
        clock.t += CFG.heartbeat_interval_s

    t_end = clock.t + 10 * CFG.heartbeat_timeout_s
    while clock.t < t_end:
        interval((0, 1))
        assert ctl.state.phase is Phase.RUNNING, ctl.events
    assert router.pending() > 20 * turns_per_interval * MAX_FRAMES_PER_TURN  # never drained
    last = ctl.state.ranks[1].last_heartbeat
    assert clock.t - last <= CFG.heartbeat_interval_s  # the heartbeat of the last interval counted
    while ctl.state.phase is Phase.RUNNING:
        interval((0,))
    assert ctl.state.fault.rank == 1 and "rank 1 missed heartbeats" in ctl.events[0].reason
    assert ctl.events[0].t - last <= CFG.heartbeat_timeout_s + CFG.heartbeat_interval_s
    stops = [wire.Codec(KEY, "rx").decode(parts[1]).body for parts in router.sent if parts[0] == b"r0"]
    assert any(isinstance(b, wire.Stop) for b in stops)
    rejected = ctl.codec.rejected
    assert rejected["rate_limited"] > 0 and rejected["bad_mac"] + rejected["replay"] + rejected["short"] > 0
    windows = (clock.t - 100.0) / ctl.codec.reject_log.interval_s + 2
    assert ctl.codec.reject_log.lines <= windows * (ctl.codec.reject_log.max_lines + 1)  # not one per frame


class FdFrame(FakeFrame):
    """A frame that names the connection (file descriptor) it came on."""

    def __init__(self, data, fd):
        super().__init__(data)
        self.fd = fd

    def get(self, option):
        return self.fd


class FakeMonitor:
    """Stands in for the socket monitor's PAIR socket: queued events, oldest first."""

    def __init__(self):
        self.events = collections.deque()

    def disconnected(self, fd):
        self.events.append([struct.pack("=hi", zmq.EVENT_DISCONNECTED, fd), b"tcp://127.0.0.1:1"])

    def recv_multipart(self, flags=0, copy=True):
        if not self.events:
            raise zmq.Again()
        return self.events.popleft()


def test_the_goodbye_before_a_close_is_handled_first_whatever_the_monitor_says():
    """Found in CI (a 4-rank ARF demo, 1 run in 15 beside two CPU hogs): every rank said
    GOODBYE(0) and closed at the end of training, the controller's turn read the monitor's
    "disconnected" events before the GOODBYE frames queued on the ROUTER and took the
    finished job for four dead ranks (a dying checkpoint attempted, "no complete data",
    exit 76 in the report of a job that ended normally). A close is handled only once the
    frames sent before it have been."""
    world = 2
    clock = FakeClock()
    ctl = Controller(CFG, world, "127.0.0.1", 0, clock=clock)
    router, monitor = FairRouter(), FakeMonitor()
    ctl._router = router
    ctl.server.monitor = monitor
    codecs = [wire.Codec(KEY, wire.new_sender("rank", r)) for r in range(world)]
    frames = collections.deque()
    router.recv_multipart = lambda flags=0, copy=True: frames.popleft() if frames else (_ for _ in ()).throw(
        zmq.Again())
    for r in range(world):
        lay = Layout(dp_rank=r, dp_size=world, replica_count=world, instance_id=r)
        frames.append([FakeFrame(b"r%d" % r), FdFrame(codecs[r].encode(
            wire.Register(r, world, 1000 + r, "h", lay, "/save", "run", "updated", 1)), 50 + r)])
    ctl._turn()
    assert sorted(ctl.state.ranks) == list(range(world))
    # each rank: GOODBYE(0) queued on the ROUTER, then its close queued on the monitor
    for r in range(world):
        frames.append([FakeFrame(b"r%d" % r), FdFrame(codecs[r].encode(wire.Goodbye(r, 0)), 50 + r)])
        monitor.disconnected(50 + r)
    clock.t += 0.01
    ctl._turn()
    assert ctl.state.phase is Phase.DONE, [e.reason for e in ctl.events]
    assert [e.action for e in ctl.events if e.action is not ActionKind.NOOP] == []
    # a close with nothing before it is still a death (the next turn that reads the ROUTER empty)
    ctl2, clock2, codecs2 = _sim()
    ctl2.server.monitor = mon2 = FakeMonitor()
    ctl2.server.bind_fd(70, 0)
    mon2.disconnected(70)
    ctl2._turn()
    assert not ctl2.state.ranks[0].alive and "control connection closed" in ctl2.state.ranks[0].dead_reason


def test_heartbeat_is_stamped_when_handled_not_when_the_turn_began():
    ctl, clock, codecs = _sim()
    ticks = iter(range(10_000))
    ctl.clock = lambda: 200.0 + next(ticks) * 0.001  # every clock read is a millisecond later
    for _ in range(MAX_FRAMES_PER_TURN - 1):  # rank 0's own connection: junk first, its heartbeat last
        ctl._router.push(b"r0", b"x")
    ctl._router.push(b"r0", codecs[0].encode(wire.Heartbeat(0, 1, "updated")))
    ctl._turn()
    assert ctl.state.ranks[0].last_heartbeat >= 200.0 + 0.001 * (MAX_FRAMES_PER_TURN - 1) - 1e-9
    assert ctl.codec.rejected == {"short": MAX_FRAMES_PER_TURN - 1}


# =============================================================================== transport
def test_curve_keys_derive_from_the_auth_key():
    a, b = auth.derive_keys(KEY), auth.derive_keys(KEY)
    assert a == b and len(a.server_public) == len(a.client_secret) == 40
    assert a.server_public == zmq.curve_public(a.server_secret)
    assert auth.derive_keys(b"g" * 32).server_public != a.server_public
    assert len({a.server_public, a.server_secret, a.client_public, a.client_secret}) == 4
    assert KEY.hex() not in repr(a) and a.server_secret.decode() not in repr(a)


def test_no_curve_is_a_clear_start_up_error(monkeypatch):
    monkeypatch.setattr(zmq, "has", lambda what: False if what == "curve" else True)
    with pytest.raises(ConfigError, match=r"CURVE.*zmq.has\('curve'\)"):
        Controller(CFG, 1)
    with pytest.raises(ConfigError, match="CURVE"):
        Processor(CFG, 0, Layout())


def _raw_payloads():
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x00" * 32
    return [
        os.urandom(256),
        greeting + b"\x06" + struct.pack(">Q", 1 << 62) + b"\x00" * 64,  # a command of 4 EiB
        b"\xff" + struct.pack(">Q", (1 << 63) - 1) + b"\x00" + b"x" * 64,  # ZMTP/1.0 frame of 8 EiB
        b"x" * 4096,
    ]


def test_peers_without_the_key_never_reach_the_application(closing):
    ctl = Controller(CFG, 1, "127.0.0.1", 0, tick_s=0.01).start()
    closing.callback(ctl.stop)
    ctx = zmq.Context()
    socks = []
    closing.callback(lambda: wire.close_all(ctx, *socks))
    other = auth.derive_keys(b"o" * 32)
    mine = auth.derive_keys(KEY)
    for keys in (None, other, auth.CurveKeys(mine.server_public, b"", other.client_public, other.client_secret)):
        s = ctx.socket(zmq.DEALER)
        socks.append(s)
        s.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            auth.configure_client(s, keys)
        s.connect(wire.endpoint("127.0.0.1", ctl.port))
        for _ in range(100):
            s.send(b"x", zmq.NOBLOCK)
    for payload in _raw_payloads():
        with socket.create_connection(("127.0.0.1", ctl.port)) as raw:
            try:
                raw.sendall(payload)
            except OSError:
                pass  # the controller may close first
    # Refused for certain: the key-less and junk peers (protocol error), the wrong client key
    # (ZAP denies it). Whether a raw connection closed by its sender counts as a protocol
    # error or a handshake ended without detail depends on which the controller reads first
    # (under load: the first; CI found it), so either is accepted, nothing else.
    deadline = time.monotonic() + 30
    required = {"handshake_protocol_error", "handshake_auth_denied"}
    while not required <= set(ctl.transport_rejected.totals) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert required <= set(ctl.transport_rejected.totals) <= required | {"handshake_failed"}, ctl.traffic()
    assert ctl.codec.accepted == 0 and not ctl.state.ranks, ctl.traffic()
    p = Processor(CFG, 0, Layout(), None, port=ctl.port)  # the job's own rank gets in meanwhile
    closing.callback(p.close, None)
    p.start()
    p.close(0)
    out = ctl.wait_done(30)
    assert out is not None and out.phase is Phase.DONE and out.fault_rank is None
    assert ctl.codec.accepted >= 2 and not ctl.codec.rejected, ctl.traffic()  # the rank's frames only


IDLE_SERVER = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))
from mindspeed_ha.config import HAConfig
from mindspeed_ha.control import server
from mindspeed_ha.control.controller import Controller
server.HANDSHAKE_DEADLINE_S = float(sys.argv[3])
cfg = HAConfig(enabled=True, auth_key=bytes.fromhex(sys.argv[4]), controller_addr="127.0.0.1", save_dir=None,
               heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0, connect_timeout_s=10.0)
ctl = Controller(cfg, 1, "127.0.0.1", 0, tick_s=0.01).start()
print(ctl.port, flush=True)
cpu0 = time.process_time()
out = ctl.wait_done(100)
print(json.dumps({"phase": out and out.phase.value, "refused": dict(ctl.transport_rejected.totals),
                  "fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                  "cpu_s": time.process_time() - cpu0}), flush=True)
ctl.stop()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("soft,hard", [(128, 1024), (128, 128)], ids=["headroom", "no_headroom"])
def test_a_rank_registers_while_idle_connections_hold_more_descriptors_than_the_limit(closing, soft, hard):
    """Issue 21: idle TCP connections to the controller port (never a byte sent) exhausted
    the launcher's descriptors, so a real rank could not register. The controller runs in
    a child process whose open-file limit is lowered to ``soft``/``hard``; this process
    holds 300 idle connections to it while the job's rank registers and says goodbye.
    With headroom the controller raised its soft limit to the hard one; without, each idle
    connection is closed at the handshake deadline (1 s here) and the rank gets in."""
    held_n = 300
    proc = subprocess.Popen([sys.executable, "-c", IDLE_SERVER, str(soft), str(hard), "1.0", KEY.hex()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    closing.callback(lambda: (proc.kill(), proc.communicate()))
    port = int(proc.stdout.readline() or 0)
    assert port, proc.stderr.read()[-3000:] if proc.poll() is not None else "no port"
    held = []
    closing.callback(lambda: [s.close() for s in held])
    for _ in range(held_n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))  # completes in the kernel's backlog, or waits there
        held.append(s)
    # the rank connects only once the port is saturated: more connections established than
    # the controller had descriptors (accepted, or in the kernel's backlog of 100)
    poller, connected = select.poll(), set()
    for s in held:
        poller.register(s, select.POLLOUT)
    while len(connected) < soft + 50:
        for fd, _ in poller.poll():
            poller.unregister(fd)
            connected.add(fd)
    p = Processor(CFG, 0, Layout(), None, port=port)
    closing.callback(p.close, None)
    p.start()  # raises ControlPlaneError without REGISTERED within connect_timeout_s (10 s)
    p.close(0)
    result = json.loads(proc.stdout.readline() or "{}")
    print(f"\n{soft}/{hard} descriptors, {held_n} idle connections held: {result}")
    assert result.get("phase") == "done", (result, proc.stderr.read()[-3000:])
    assert result["fd_limit"] == hard
    if soft == hard:  # the idle ones were closed at the deadline (counted, no log line each)
        assert result["refused"].get("handshake_failed", 0) > 0, result


def test_the_controller_port_has_a_handshake_deadline(closing):
    ctl = Controller(CFG, 1, "127.0.0.1", 0, tick_s=0.01).start()
    closing.callback(ctl.stop)
    assert ctl.server.router.getsockopt(zmq.HANDSHAKE_IVL) == int(server.HANDSHAKE_DEADLINE_S * 1000) <= 10_000


# =============================================================================== end to end
ITERS = 60
KILL_AT = 4
HB_TIMEOUT = 3.0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_args(port, *extra):
    from mindspeed_ha.testing.harness import tiny_gpt_args

    return tiny_gpt_args(tp=1, pp=2, train_iters=ITERS) + [
        "--enable-high-availability", "--ha-controller-port", str(port),
        "--ha-heartbeat-interval", "0.5", "--ha-heartbeat-timeout", str(HB_TIMEOUT), *extra]


def _launch(args, key_hex, loss_log=None, env=None):
    from mindspeed_ha.testing.harness import launch, launcher_command

    r = launch(4, args, launcher=launcher_command(4), timeout_s=400, loss_log=loss_log,
               env=dict(env or {}, MINDSPEED_HA_AUTH_KEY=key_hex))
    assert not r.timed_out, r.stderr[-6000:]
    return r


class Attack:
    """One attacker process (this file run as a script); ``stop()`` ends it and returns its stats."""

    def __init__(self, tmp_path, port, key_hex, loss_log):
        self.stats_path = str(tmp_path / f"flood-{port}.json")
        self.err = open(tmp_path / f"flood-{port}.err", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--port", str(port), "--key-hex", key_hex,
             "--stats", self.stats_path, "--loss-log", loss_log],
            stdout=subprocess.DEVNULL, stderr=self.err, start_new_session=True)

    def stop(self):
        """SIGTERM: the attacker closes every socket (linger 0) and its context, writes its stats, exits 0."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("the attacker did not stop by itself within 60 s")
        self.err.seek(0)
        assert rc == 0, self.err.read()[-4000:]
        with open(self.stats_path) as f:
            return json.load(f)

    def kill(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


@pytest.fixture
def attacker(tmp_path):
    """Starts attackers; whatever happens in the test, none outlives it."""
    started = []

    def start(port, key_hex, loss_log):
        a = Attack(tmp_path, port, key_hex, loss_log)
        started.append(a)
        return a

    yield start
    for a in started:
        a.kill()
        a.err.close()


def _control_plane_counts(stderr):
    """The controller's closing line: what reached it and what it refused."""
    m = re.search(r"control plane: frames accepted (\d+), frames rejected (\{.*?\}), "
                  r"connections refused (\{.*?\}), ZAP (\{.*?\})", stderr)
    assert m, stderr[-4000:]
    return int(m.group(1)), eval(m.group(2)), eval(m.group(3)), eval(m.group(4))  # noqa: S307 - our own dicts


def _report(name, stats, stderr):
    accepted, rejected, refused, zap = _control_plane_counts(stderr)
    secs = stats["stopped"] - stats["started"]
    trained = stats["stopped"] - stats["training_seen"] if stats["training_seen"] else 0.0
    rates = {k: round(v / secs) for k, v in stats["counts"].items()}
    print(f"\n[{name}] attack of {secs:.1f} s, {sum(stats['counts'].values()) / secs:.0f} frames+connections/s "
          f"by kind (per s): {rates}; controller: accepted {accepted}, rejected {rejected}, "
          f"connections refused {refused}, ZAP {zap}; training flooded for "
          f"{trained:.1f} s")
    return accepted, rejected, refused, zap


def _assert_flooded_throughout(stats, train_must_last=True):
    assert stats["first_connected"] is not None and stats["training_seen"] is not None, stats
    assert stats["first_connected"] < stats["training_seen"]  # the flood was on before iteration 1 ...
    if train_must_last:  # ... and went on, while the ranks trained, for longer than the heartbeat timeout
        assert stats["stopped"] - stats["training_seen"] > HB_TIMEOUT, stats


def _assert_rejected_in_depth(stats, stderr):
    _, rejected, refused, zap = _control_plane_counts(stderr)
    # outsiders were refused by the transport; the insider's frames by the budgets and the frame checks
    assert {"handshake_failed", "handshake_protocol_error", "handshake_auth_denied"} <= set(refused), refused
    assert zap.get("denied", 0) > 0
    assert rejected.get("rate_limited", 0) > 0, rejected
    frames = sum(rejected.values())
    lines = stderr.count("rejected: ") + stderr.count("rejected from ")
    assert lines < 300 and lines * 100 < frames + sum(refused.values()), (lines, frames)


@pytest.mark.timeout(1200)
def test_flood_does_not_stop_a_healthy_job(tmp_path, attacker):
    key = secrets.token_hex(32)
    base = _launch(_job_args(0), key)
    assert base.returncode == 0, base.stderr[-6000:]
    assert sorted(base.losses) == list(range(1, ITERS + 1))

    port, loss_log = _free_port(), str(tmp_path / "loss.jsonl")
    attack = attacker(port, key, loss_log)
    try:
        r = _launch(_job_args(port), key, loss_log=loss_log)
    finally:
        stats = attack.stop()
    _report("healthy job", stats, r.stderr)
    assert r.returncode == 0, r.stderr[-6000:]
    assert r.losses == base.losses  # bitwise, every iteration
    assert "missed heartbeats" not in r.stderr and "decision stop_all" not in r.stderr
    _assert_flooded_throughout(stats)
    _assert_rejected_in_depth(stats, r.stderr)


@pytest.mark.timeout(900)
def test_rank_killed_during_flood_still_gets_its_dying_checkpoint(tmp_path, attacker):
    key = secrets.token_hex(32)
    port, loss_log, save = _free_port(), str(tmp_path / "loss.jsonl"), str(tmp_path / "ckpt")
    attack = attacker(port, key, loss_log)
    try:
        r = _launch(_job_args(port, "--save", save), key, loss_log=loss_log,
                    env={"MINDSPEED_HA_INJECT": f"rank=1,iteration={KILL_AT},point=backward"})
    finally:
        stats = attack.stop()
    _report("rank killed", stats, r.stderr)
    assert r.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, r.stderr[-6000:]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == KILL_AT - 1
    assert "missed heartbeats" not in r.stderr  # the death was seen for what it was, not invented
    _assert_flooded_throughout(stats, train_must_last=False)
    _assert_rejected_in_depth(stats, r.stderr)


# =============================================================================== the attacker
class Flood:
    """Floods ``port`` from several threads until ``stop`` is set; ``counts`` by kind.

    Outsiders (no key): ZeroMQ DEALERs without security sending b"x" (the reported
    reproduction), CURVE clients with another job's keys, a CURVE client that knows the
    server's public key but not the client key (ZAP refuses it), raw TCP connections
    with garbage, huge ZMTP length prefixes and large writes, up to ``max_open`` of them
    held open at once. An insider (the job's key, so it passes CURVE) on several
    connections: one-byte frames, well-formed frames tagged with a wrong key, frames
    with the right key replayed or with an old sequence number, and frames larger than
    the size cap. Every socket is closed with linger 0.
    """

    def __init__(self, port, key, max_bytes=wire.DEFAULT_MAX_BYTES, max_open=200):
        self.addr = ("127.0.0.1", port)
        self.endpoint = wire.endpoint("127.0.0.1", port)
        self.key = key
        self.max_bytes = max_bytes
        self.max_open = max_open
        self.stop = threading.Event()
        self.counts = collections.Counter()
        self.lock = threading.Lock()
        self.first_connected = None
        self.ctx = zmq.Context()

    def run(self):
        threads = [threading.Thread(target=self._guard, args=(fn,), daemon=True)
                   for fn in (self._outsiders, self._raw_tcp, self._insider, self._insider)]
        for t in threads:
            t.start()
        self.stop.wait()
        for t in threads:
            t.join(30)
        left = [t for t in threads if t.is_alive()]
        if left:  # a thread still holds a socket: term() would wait for it forever
            self.ctx.destroy(linger=0)
        else:
            self.ctx.term()  # every socket was closed by its thread
        return left

    def _guard(self, fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - an attacker thread that fails is reported, not fatal
            print(f"attacker thread {fn.__name__} failed: {exc!r}", file=sys.stderr, flush=True)
            self._count(f"error_{fn.__name__}")

    def _count(self, kind, n=1):
        with self.lock:
            self.counts[kind] += n

    def _dealer(self, keys=None, ident=None):
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 20)
        s.setsockopt(zmq.SNDHWM, 10_000)
        if ident is not None:
            s.setsockopt(zmq.ROUTING_ID, ident)
        if keys is not None:
            auth.configure_client(s, keys)
        s.connect(self.endpoint)
        return s

    def _send_loop(self, socks, frames, kind_of):
        """Round-robin over ``socks`` sending ``frames`` (cycled) until stopped."""
        i = 0
        while not self.stop.is_set():
            s = socks[i % len(socks)]
            frame = frames[i % len(frames)]
            try:
                s.send(frame, zmq.NOBLOCK)
                self._count(kind_of(frame))
            except zmq.Again:  # queue full (peer refused, or the controller reads slower)
                self.stop.wait(0.0005)
            i += 1

    def _outsiders(self):
        mine, other = auth.derive_keys(self.key), auth.derive_keys(secrets.token_bytes(32))
        half_known = auth.CurveKeys(mine.server_public, b"", other.client_public, other.client_secret)
        socks = [self._dealer() for _ in range(4)] + [self._dealer(other) for _ in range(2)] \
            + [self._dealer(half_known) for _ in range(2)]
        try:
            self._send_loop(socks, [b"x"], lambda f: "outsider_frames_queued")
        finally:
            for s in socks:
                s.close(linger=0)

    def _raw_tcp(self):
        greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x00" * 32
        payloads = [
            lambda: os.urandom(random.randint(1, 512)),
            lambda: greeting + b"\x06" + struct.pack(">Q", 1 << 62) + os.urandom(64),
            lambda: b"\xff" + struct.pack(">Q", (1 << 63) - 1) + b"\x00" + os.urandom(64),
            lambda: b"x" * 65536,
        ]
        held = collections.deque()
        try:
            i = 0
            while not self.stop.is_set():
                try:
                    s = socket.create_connection(self.addr, timeout=1)
                except OSError:
                    self.stop.wait(0.01)  # nobody listening yet
                    continue
                if self.first_connected is None:
                    self.first_connected = time.time()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                held.append(s)
                try:
                    s.sendall(payloads[i % len(payloads)]())
                except OSError:
                    pass  # refused and closed by the other side
                self._count("raw_connections")
                while len(held) > self.max_open:
                    held.popleft().close()
                i += 1
        finally:
            while held:
                held.popleft().close()

    def _insider(self):
        keys = auth.derive_keys(self.key)
        right = wire.Codec(self.key, wire.new_sender("rank", 1))
        wrong = wire.Codec(secrets.token_bytes(32), wire.new_sender("rank", 0))
        old = [right.encode(wire.Heartbeat(1, 1, "updated")) for _ in range(3)]
        newest = right.encode(wire.Heartbeat(1, 1, "updated"))  # seq 4: the older three are stale
        lay = Layout(dp_rank=1, dp_size=2, replica_count=2, instance_id=1)
        forged = [wrong.encode(wire.Heartbeat(0, 1, "updated")),
                  wrong.encode(wire.Register(1, 4, 1, "mallory", lay, "/tmp", "run"))]
        oversize = b"\x00" * (self.max_bytes + wire.TRANSPORT_OVERHEAD + 1024)
        kinds = {b"x": "insider_garbage", oversize: "insider_oversize", newest: "insider_replayed"}
        kinds.update({f: "insider_forged" for f in forged})
        kinds.update({f: "insider_old_seq" for f in old})
        frames = [newest] + ([b"x"] * 4 + forged + old + [newest]) * 200 + [oversize]
        socks = [self._dealer(keys, ident=b"insider-" + secrets.token_bytes(4)) for _ in range(4)]
        try:
            self._send_loop(socks, frames, lambda f: kinds[f])
        finally:
            for s in socks:
                s.close(linger=0)


def _attacker_main(argv=None):
    p = argparse.ArgumentParser(description="flood a mindspeed-ha controller port (test attacker)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--key-hex", required=True, help="the job's key, for the insider part of the attack")
    p.add_argument("--stats", required=True)
    p.add_argument("--loss-log", default=None, help="record when training started (first loss line)")
    a = p.parse_args(argv)
    flood = Flood(a.port, bytes.fromhex(a.key_hex))
    signal.signal(signal.SIGTERM, lambda *_: flood.stop.set())
    signal.signal(signal.SIGINT, lambda *_: flood.stop.set())
    stats = {"started": time.time(), "training_seen": None}

    def watch_training():
        while not flood.stop.is_set() and stats["training_seen"] is None:
            if a.loss_log and os.path.exists(a.loss_log) and os.path.getsize(a.loss_log) > 0:
                stats["training_seen"] = time.time()
            flood.stop.wait(0.05)

    watcher = threading.Thread(target=watch_training, daemon=True)
    watcher.start()
    left = flood.run()
    watcher.join(5)
    stats.update(stopped=time.time(), first_connected=flood.first_connected, counts=dict(flood.counts),
                 threads_left=len(left))
    with open(a.stats, "w") as f:
        json.dump(stats, f)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(_attacker_main())
