"""The node relay (``control/relay.py``): a node's ranks over one CURVE connection.

In one process over real sockets (the controller's CURVE port, the relay's ipc socket):
the ranks register and are stopped through the relay with their own frames (the
controller checks each rank's HMAC), a forged frame through the relay is rejected by the
controller, a rank's closed local connection is its death, the relay's socket is private
to the user, and ranks whose relay is gone go on connected directly. Teardown and leak
checks are test_control's fixtures.
"""

import contextlib
import dataclasses
import logging
import os
import pathlib
import shutil
import stat
import tempfile
import time

import pytest
import zmq

from mindspeed_ha import env as ha_env
from mindspeed_ha.control import wire
from mindspeed_ha.control.controller import Controller
from mindspeed_ha.control.relay import NodeRelay, usable_socket
from mindspeed_ha.control.state import Layout, Phase

from test_control import CFG, KEY, WORLD, Job, assert_dying_checkpoint, closing, no_leaks  # noqa: F401


@pytest.fixture
def short_tmp():
    """A fresh directory with a short path: a socket's path must fit AF_UNIX's 108 bytes,
    which pytest's tmp_path under xdist does not leave room for."""
    d = tempfile.mkdtemp(prefix="msha-", dir="/tmp")
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)  # made by mkdtemp above: ours


def _relay(stack, monkeypatch, port, tmp_path):
    relay = NodeRelay(CFG.max_message_bytes, KEY, "127.0.0.1", port, 0, directory=str(tmp_path)).open()
    stack.callback(relay.close)
    monkeypatch.setenv(ha_env.RELAY, relay.path)
    return relay


def _wait(cond, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _relayed_job(stack, monkeypatch, tmp_path):
    """test_control's Job, its processors started with the relay's socket in the environment."""
    ctl = Controller(CFG, WORLD, "127.0.0.1", 0, tick_s=0.01).start()
    stack.callback(ctl.stop)
    relay = _relay(stack, monkeypatch, ctl.port, tmp_path)
    j = Job(stack, ctl=ctl)
    j.relay = relay
    return j


def test_ranks_register_and_die_through_the_relay(closing, monkeypatch, short_tmp):
    j = _relayed_job(closing, monkeypatch, short_tmp)
    for r, p in enumerate(j.procs):
        assert p.link.relay == j.relay.path
        assert isinstance(j.ctl.server.ident[r], tuple), "rank registered on a connection of its own"
    assert j.ctl.server.relayed_messages >= 1 and j.relay.up_frames >= WORLD
    j.step(1)
    j.step(2)
    t0 = time.monotonic()
    j.procs[2].close(None)  # the process vanishes: its local connection closes, the relay says so
    for r in (0, 1, 3):
        assert j.procs[r].stop_event.wait(10)
        assert j.procs[r].stop_received_at >= t0
    out = assert_dying_checkpoint(j, dead=2, iteration=2)  # STOP, DUMP, ... reached the ranks through the relay
    assert "control connection closed" in out.events[0].reason
    assert j.relay.closes >= 1 and j.relay.down_frames >= 3


def test_forged_frame_through_the_relay_is_rejected(closing, monkeypatch, short_tmp):
    ctl = Controller(CFG, 1, "127.0.0.1", 0, tick_s=0.01).start()
    closing.callback(ctl.stop)
    relay = _relay(closing, monkeypatch, ctl.port, short_tmp)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    closing.callback(wire.close_all, ctx, raw)
    wire.configure_socket(raw, CFG.max_message_bytes)
    raw.connect(relay.endpoint)
    reg = wire.Register(0, 1, os.getpid(), "h", Layout(), None, "")
    forged = wire.Codec(b"x" * 32, wire.new_sender("rank", 0)).encode(reg)  # another key: its HMAC is wrong
    raw.send(forged)
    raw.send(forged[:32] + forged[32:].replace(b"rank", b"RANK", 1))  # a body changed after tagging
    _wait(lambda: ctl.codec.rejected["bad_mac"] >= 2, "the forged frames were not rejected by the controller")
    assert 0 not in ctl.state.ranks and not raw.poll(200)
    raw.send(wire.Codec(KEY, wire.new_sender("rank", 0)).encode(reg))  # the same REGISTER, tagged with the key
    assert raw.poll(10000), "no answer through the relay"
    assert wire.Codec(KEY, "t").decode(raw.recv()).body.accepted
    assert isinstance(ctl.server.ident[0], tuple)


def test_the_relay_socket_is_private(closing, short_tmp):
    relay = NodeRelay(CFG.max_message_bytes, KEY, "127.0.0.1", 1, 0, directory=str(short_tmp)).open()
    closing.callback(relay.close)
    assert stat.S_IMODE(os.stat(relay.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(relay.path).st_mode) == 0o600 and stat.S_ISSOCK(os.stat(relay.path).st_mode)
    assert usable_socket(relay.path)
    os.chmod(relay.dir, 0o755)  # a directory others can enter: the rank connects directly instead
    assert not usable_socket(relay.path)
    os.chmod(relay.dir, 0o700)
    plain = short_tmp / "plain"
    plain.write_bytes(b"")
    assert not usable_socket(str(plain)) and not usable_socket(None) and not usable_socket("0")
    d = relay.dir
    relay.close()
    assert not os.path.exists(d)


def test_ranks_go_direct_when_their_relay_is_gone(closing, monkeypatch, short_tmp):
    j = _relayed_job(closing, monkeypatch, short_tmp)
    j.step(1)
    j.relay.close()  # the launcher's relay ends: every rank connects directly and registers again
    _wait(lambda: all(type(j.ctl.server.ident.get(r)) is bytes and j.procs[r].link.registered.is_set()
                      for r in range(WORLD)), "the ranks did not register directly")
    assert all(p.link.relay is None and p.link.handshakes >= 2 for p in j.procs)
    j.step(2)
    for p in j.procs:
        p.close(0)
    out = j.ctl.wait_done(10)
    assert out.phase is Phase.DONE and out.exit_code is None and out.fault_rank is None, out.reason


def _failover(stack, monkeypatch, short_tmp, cfg, relay_lease_dir):
    """A relayed job led by term 0's controller, then term 0's controller gone and term 1's
    (a successor started from its roster) in the lease directory the ranks read; the relay
    reads ``relay_lease_dir`` (the same one, or one where no successor ever appears)."""
    from mindspeed_ha.control.lease import LeaseDir, Term

    lease = LeaseDir(str(short_tmp / "lease"), KEY)
    monkeypatch.setenv(ha_env.LEASE_DIR, lease.path)
    first = Controller(cfg, WORLD, "127.0.0.1", 0, tick_s=0.01).start()
    stack.callback(first.stop)
    assert lease.take(Term(0, "127.0.0.1", first.port, 0, 0, os.getpid()))
    relay_lease = lease if relay_lease_dir is None else LeaseDir(str(relay_lease_dir), KEY)
    relay = NodeRelay(cfg.max_message_bytes, KEY, "127.0.0.1", first.port, 0, directory=str(short_tmp),
                      lease=relay_lease, term=0, follow_s=60.0).open()
    stack.callback(relay.close)
    monkeypatch.setenv(ha_env.RELAY, relay.path)
    j = Job(stack, cfg=cfg, ctl=first)
    j.relay = relay
    j.step(1)
    _wait(lambda: all(first.state.ranks[r].iteration == 1 for r in range(WORLD)), "iteration 1 not reported")
    second = Controller(cfg, WORLD, "127.0.0.1", 0, tick_s=0.01)
    second.take_over(first.roster())
    stack.callback(second.stop)
    second.start()
    first.stop()  # the leader's process is gone: the relay's connection to it closes
    assert lease.take(Term(1, "127.0.0.1", second.port, 0, 1, os.getpid()))
    j.ctl = second
    return j


def _registered_with(j, relayed):
    """Every rank registered with ``j.ctl`` (a processor's REGISTER, not the roster's entry),
    on a relayed connection ``(relay, sub)`` or a direct one."""
    ctl = j.ctl
    return all(j.procs[r].link.registered.is_set() and r in ctl.state.ranks and ctl.state.ranks[r].sender
               and isinstance(ctl.server.ident.get(r), tuple if relayed else bytes) for r in range(WORLD))


def _end_cleanly(j):
    j.step(2)
    for p in j.procs:
        p.close(0)
    out = j.ctl.wait_done(20)
    assert out.phase is Phase.DONE and out.exit_code is None and out.fault_rank is None, out.reason
    assert all(not j.ctl.state.ranks[r].dead_reason or "goodbye" in j.ctl.state.ranks[r].dead_reason
               for r in range(WORLD)), {r: i.dead_reason for r, i in j.ctl.state.ranks.items()}


def test_the_relay_follows_a_new_leader_and_its_ranks_stay_on_it(closing, monkeypatch, short_tmp):
    """Controller failover: the relay's controller connection closes, it tells its ranks,
    connects to term 1's leader (the lease directory's, CURVE with the job's keys) and the
    ranks register with it again through the relay: no rank taken for dead, none left the
    relay, the job ends normally under the successor (before: the relay ended and every
    rank connected directly)."""
    cfg = dataclasses.replace(CFG, heartbeat_timeout_s=20.0)  # the relay's grace: 5 s (load), takeover 20 s
    j = _failover(closing, monkeypatch, short_tmp, cfg, None)
    _wait(lambda: _registered_with(j, relayed=True), "the ranks did not register with the successor via the relay")
    assert j.relay.followed == 1 and j.relay.ended is None
    assert all(p.link.relay == j.relay.path and p.link.handshakes == 1 for p in j.procs)  # never left the relay
    assert not any(i.dead_reason for i in j.ctl.state.ranks.values())
    _end_cleanly(j)


def test_ranks_leave_a_relay_that_does_not_reach_the_new_leader(closing, monkeypatch, short_tmp):
    """The relay follows a lease directory where no successor appears (it cannot reach the
    leader the ranks see): after RELAY_FOLLOW_GRACE of their loss budget the ranks connect
    to term 1's leader directly and register, before its takeover window ends."""
    cfg = dataclasses.replace(CFG, heartbeat_timeout_s=4.0)  # the ranks' grace: 1 s; the takeover window 4 s
    j = _failover(closing, monkeypatch, short_tmp, cfg, short_tmp / "elsewhere")
    _wait(lambda: _registered_with(j, relayed=False), "the ranks did not register with the successor directly")
    assert j.relay.followed == 0 and all(p.link.relay is None for p in j.procs)
    assert not any(i.dead_reason for i in j.ctl.state.ranks.values())
    _end_cleanly(j)


def test_frames_sent_while_the_relay_follows_wait_and_reach_the_new_leader(closing, monkeypatch, short_tmp):
    """A frame a rank sends between the relay's two notices is not lost: it waits on the
    relay's socket and is the first the new leader gets from that rank (its REGISTER, sent
    once, is answered by the successor)."""
    from mindspeed_ha.control.lease import LeaseDir, Term
    from mindspeed_ha.control.relay import NOTICE_CLOSED, NOTICE_OPEN

    lease = LeaseDir(str(short_tmp / "lease"), KEY)
    first = Controller(CFG, 1, "127.0.0.1", 0, tick_s=0.01).start()
    closing.callback(first.stop)
    assert lease.take(Term(0, "127.0.0.1", first.port, 0, 0, os.getpid()))
    relay = NodeRelay(CFG.max_message_bytes, KEY, "127.0.0.1", first.port, 0, directory=str(short_tmp),
                      lease=lease, term=0, follow_s=60.0).open()
    closing.callback(relay.close)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    closing.callback(wire.close_all, ctx, raw)
    wire.configure_socket(raw, CFG.max_message_bytes)
    raw.connect(relay.endpoint)
    codec, rx = wire.Codec(KEY, wire.new_sender("rank", 0)), wire.Codec(KEY, "t")
    reg = wire.Register(0, 1, os.getpid(), "h", Layout(), None, "")
    raw.send(codec.encode(reg))
    assert raw.poll(10000) and rx.decode(raw.recv()).body.accepted
    second = Controller(CFG, 1, "127.0.0.1", 0, tick_s=0.01)
    second.take_over(first.roster())
    closing.callback(second.stop)
    second.start()
    first.stop()
    assert raw.poll(10000) and raw.recv() == NOTICE_CLOSED
    raw.send(codec.encode(reg))  # while the relay follows: waits on its socket
    assert not raw.poll(300)
    assert lease.take(Term(1, "127.0.0.1", second.port, 0, 1, os.getpid()))
    assert raw.poll(10000) and raw.recv() == NOTICE_OPEN
    assert raw.poll(10000) and rx.decode(raw.recv()).body.accepted  # the successor answered the waiting REGISTER
    assert second.state.ranks[0].sender == codec.sender and isinstance(second.server.ident[0], tuple)
    assert relay.followed == 1


def _unstarted_controller():
    """A 4-rank controller never started (no socket), reading a stand-in ROUTER on a fake
    clock, and a codec per rank: (controller, router, rank -> codec, the clock)."""
    from test_controller_scale import Clock, SlowRouter

    clock = Clock()
    ctl = Controller(CFG, 4, "127.0.0.1", 0, tick_s=0.05, clock=clock)
    router = SlowRouter(clock)
    ctl._router = router
    return ctl, router, {r: wire.Codec(KEY, wire.new_sender("processor", r)) for r in range(4)}, clock


def test_register_resend_waits_longer_in_a_larger_job():
    """The first REGISTER re-send's mean delay: 1 s up to 4,096 ranks, then 1 s per 4,096
    (at 16,384 ranks a 1 s delay had most ranks re-send before the controller answered)."""
    from mindspeed_ha.control.link import RegisterBackoff

    assert [RegisterBackoff.for_job(n).first_s for n in (8, 4096, 16384, 10 ** 6)] == [1.0, 1.0, 4.0, 8.0]
    b = RegisterBackoff.for_job(16384)
    b.rng = lambda: 0.5
    assert [b.next_delay() for _ in range(3)] == [4.0, 8.0, 8.0]


def test_a_gone_relays_directory_is_removed_and_nothing_else(short_tmp):
    """A SIGKILLed launcher leaves its relay's directory (its socket file, nobody listening):
    the next relay removes it; a live relay's, one with another file in it, and one whose
    socket is not there yet are left alone."""
    import socket

    from mindspeed_ha.control.relay import remove_stale

    def relay_dir(name, listen, extra=False, sock=True):
        d = short_tmp / name
        d.mkdir(mode=0o700)
        s = None
        if sock:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(d / "relay.sock"))
            if listen:
                s.listen(1)
            else:
                s.close()
        if extra:
            (d / "other").write_text("x")
        return d, s

    gone, _ = relay_dir("mindspeed-ha-relay-0-gone", listen=False)
    live, s = relay_dir("mindspeed-ha-relay-0-live", listen=True)
    other, _ = relay_dir("mindspeed-ha-relay-0-other", listen=False, extra=True)
    starting, _ = relay_dir("mindspeed-ha-relay-0-starting", listen=False, sock=False)
    not_ours, _ = relay_dir("something-else", listen=False)
    try:
        assert remove_stale(str(short_tmp)) == [str(gone)]
    finally:
        s.close()
    assert not gone.exists() and live.exists() and other.exists() and starting.exists() and not_ours.exists()


def test_a_socket_path_too_long_for_af_unix_moves_to_tmp(tmp_path):
    """A deep TMPDIR (pytest's own under xdist is one) would make the socket's path longer
    than AF_UNIX takes: the relay's directory goes to /tmp instead."""
    from mindspeed_ha.control.relay import MAX_SOCKET_PATH, socket_base

    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    assert len(str(deep)) + len("/mindspeed-ha-relay-0-xxxxxxxx/relay.sock") > MAX_SOCKET_PATH
    assert socket_base(str(deep), 0) == "/tmp"
    assert socket_base("/tmp", 0) == "/tmp"


def test_merged_heartbeats_name_only_the_ranks_heard_and_still_connected(closing, monkeypatch, short_tmp):
    """Heartbeat merging (wire schema 13): the relay forwards no HEARTBEAT frame, it names
    the ranks it heard in one NODE_BEAT per interval; a rank that stopped sending (or sent a
    HEARTBEAT that does not verify) or whose local connection closed is never named again
    (no false liveness at the controller)."""
    import dataclasses

    from mindspeed_ha.control import handlers

    cfg = dataclasses.replace(CFG, heartbeat_timeout_s=60.0)  # silence is not what this test is about
    ctl = Controller(cfg, 3, "127.0.0.1", 0, tick_s=0.01).start()
    closing.callback(ctl.stop)
    relay = NodeRelay(CFG.max_message_bytes, KEY, "127.0.0.1", ctl.port, 0, directory=str(short_tmp),
                      heartbeat_ms=50).open()
    closing.callback(relay.close)
    named = []  # (relay ident, the ranks a NODE_BEAT named), in arrival order
    original = handlers.node_beat

    def recorded(c, now, ident, body):
        named.append({c.server.rank_of_ident.get((ident, s)) for s in body.subs})
        original(c, now, ident, body)
    monkeypatch.setattr(handlers, "node_beat", recorded)
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(3)]
    closing.callback(wire.close_all, ctx, *socks)
    codecs = [wire.Codec(KEY, wire.new_sender("processor", r)) for r in range(3)]
    for r, s in enumerate(socks):
        wire.configure_socket(s, CFG.max_message_bytes)
        s.connect(relay.endpoint)
        s.send(codecs[r].encode(wire.Register(r, 3, os.getpid(), "h", Layout(), None, "")))
    _wait(lambda: len(ctl.state.ranks) == 3, "the ranks did not register through the relay")
    forwarded = relay.up_frames

    def beat(r):
        socks[r].send(codecs[r].encode(wire.Heartbeat(r, 0, "updated")))

    for r in range(3):
        beat(r)
    _wait(lambda: set().union(*named) >= {0, 1, 2}, "the three heartbeats were not named in NODE_BEATs")
    assert relay.up_frames == forwarded and relay.merged == 3, "a HEARTBEAT frame was forwarded"
    # rank 1 stops sending; rank 2's local connection closes (its process is gone)
    socks[2].close(linger=0)
    _wait(lambda: not ctl.state.ranks[2].alive, "the closed connection was not reported")
    with ctl._lock:
        quiet_since, credited = ctl.state.ranks[1].last_heartbeat, ctl.busy_credited_s
    seen = len(named)
    # a HEARTBEAT that does not verify (another key) is no liveness: forwarded, and the controller rejects it
    socks[1].send(wire.Codec(b"x" * 32, wire.new_sender("processor", 1)).encode(wire.Heartbeat(1, 0, "updated")))
    _wait(lambda: ctl.codec.rejected["bad_mac"] >= 1, "the forged heartbeat did not reach the controller")
    for _ in range(3):  # rank 0 goes on: three more beats name it, and only it
        k = len(named)
        beat(0)
        _wait(lambda: len(named) > k and 0 in named[-1], "rank 0's heartbeat was not named")
    assert all(n == {0} for n in named[seen:]), named[seen:]
    with ctl._lock:  # (a busy turn of the controller's own is credited to every rank: controller.credit_busy)
        moved = ctl.state.ranks[1].last_heartbeat - quiet_since - (ctl.busy_credited_s - credited)
    assert moved <= 1e-6, f"a silent rank was reported alive ({moved} s)"
    assert not ctl.state.ranks[2].alive and ctl.beat_unknown == 0


def test_a_node_beat_counts_only_for_the_relays_own_live_ranks():
    """The controller's side (handlers.node_beat): a sub stamps the rank whose connection is
    (relay, sub) now, if alive; another relay's rank, a dead rank, an unknown sub and a beat
    carried as a relayed rank's frame stamp nothing."""
    from mindspeed_ha.control import handlers
    from mindspeed_ha.control.state import RankInfo

    ctl = Controller(CFG, 4, "127.0.0.1", 0)  # not started: its state and tables only
    for r, ident in enumerate([(b"A", b"s0"), (b"A", b"s1"), (b"B", b"s0"), (b"A", b"s3")]):
        ctl.state.ranks[r] = RankInfo(rank=r, layout=Layout(), last_heartbeat=0.0)
        ctl.server.ident[r], ctl.server.rank_of_ident[ident] = ident, r
    ctl.state.mark_dead(3, "control connection closed", None, 0.0)
    handlers.node_beat(ctl, 5.0, b"A", wire.NodeBeat(0, [b"s0", b"s1", b"s3", b"zz"]))
    handlers.node_beat(ctl, 6.0, (b"A", b"s0"), wire.NodeBeat(0, [b"s1"]))
    assert [ctl.state.ranks[r].last_heartbeat for r in range(4)] == [5.0, 5.0, 0.0, 0.0]
    assert ctl.beat_unknown == 1 and ctl.node_beats == 1
    with pytest.raises(wire.WireError):
        wire.NodeBeat(0, [b"x" * 256])


def test_a_relayed_close_is_a_death_once_its_batch_is_handled():
    """A relay reports a close after that connection's last frames, on the same connection:
    the controller takes it as the rank's death at the end of the turn that read it, its
    GOODBYE (read before) handled first, without waiting for the ROUTER to be read empty
    (another rank's flood keeps it busy here; at 16,384 ranks that wait was 2 s)."""
    from mindspeed_ha.control.server import MAX_FRAMES_PER_TURN

    ctl, router, out, clock = _unstarted_controller()
    ident = {r: (b"n0", b"r%d" % r) for r in range(4)}
    for r in range(4):
        router.push(ident[r], out[r].encode(wire.Register(r, 4, 100 + r, "h", Layout(), None, "run")))
    ctl._turn()
    assert len(ctl.state.ranks) == 4
    router.push(ident[1], out[1].encode(wire.Goodbye(1, 0)))
    router.push(ident[1], b"")  # rank 1: GOODBYE, then its local connection closes
    router.push(ident[2], b"")  # rank 2: its process is gone
    for _ in range(2 * MAX_FRAMES_PER_TURN):  # rank 3 floods: the ROUTER is not read empty in this turn
        router.push(ident[3], out[3].encode(wire.Heartbeat(3, 0, "updated")))
    clock.t += 0.1
    ctl._turn()
    assert any(router.queues.values()), "the flood was read in one turn: the test proves nothing"
    assert not ctl.state.ranks[2].alive and ctl.state.ranks[2].dead_reason == "control connection closed"
    assert "goodbye" in ctl.state.ranks[1].dead_reason, ctl.state.ranks[1].dead_reason


class _LocalFrame:
    """A frame read from the relay's local socket (zmq.Frame's ``bytes``, ``get(SRCFD)``, ``len``)."""

    def __init__(self, data, fd):
        self.bytes, self.fd = data, fd

    def get(self, option):
        return self.fd

    def __len__(self):
        return len(self.bytes)


class _Local:
    """The relay's local ROUTER: scripted [sub, frame] reads, the sends recorded."""

    def __init__(self, reads=()):
        self.reads, self.sent = list(reads), []

    def recv_multipart(self, flags=0, copy=True):
        if not self.reads:
            raise zmq.Again()
        return self.reads.pop(0)

    def send_multipart(self, parts, flags=0, copy=True):
        self.sent.append([getattr(p, "bytes", p) for p in parts])


def _bare_relay(reads):
    """A NodeRelay never opened: its forwarding path over stand-ins of its sockets."""
    relay = NodeRelay(CFG.max_message_bytes, KEY, "127.0.0.1", 1, 0)
    relay._local, relay._up = _Local(reads), _Local()
    relay._sub_of_fd = {10 + i: b"s%d" % i for i in range(4)}  # each rank's connection, bound already
    return relay


def test_a_rounds_answers_go_up_merged_and_each_rank_in_its_order():
    """Answer merging (wire schema 14): verified STOPPED / ACTION_RESULT ok / FAULT aborted of a
    turn go up as NODE_ANSWERS (one per common body), each placed before the next frame of a
    rank it names; a FAULT of another kind, a failed ACTION_RESULT, a frame that does not verify
    and a STATUS go up unchanged (fails when the relay forwards every frame: nothing merged)."""
    rank = [wire.Codec(KEY, wire.new_sender("processor", r)) for r in range(4)]
    forged = wire.Codec(b"x" * 32, wire.new_sender("processor", 3))
    script = [  # (rank, codec, body) in the order the relay reads them
        (0, rank[0], wire.Status(0, "updating", 5)),
        (0, rank[0], wire.Stopped(0, "updated", 5)),
        (1, rank[1], wire.Stopped(1, "updated", 5)),
        (2, rank[2], wire.Stopped(2, "updating", 6)),  # another body: a group of its own
        (1, rank[1], wire.Fault(1, 6, "uce", "UCE", "updated")),  # not merged; rank 1's STOPPED goes up first
        (0, rank[0], wire.Fault(0, 6, "aborted", "aborted", "updated")),
        (1, rank[1], wire.Fault(1, 6, "aborted", "aborted", "updated")),
        (2, rank[2], wire.ActionResult(7, 2, False, "disk full")),  # a failure: not merged
        (3, forged, wire.Stopped(3, "updated", 5)),  # does not verify: forwarded, the controller rejects it
        (3, rank[3], wire.ActionResult(7, 3, True, "")),
    ]
    relay = _bare_relay([[_LocalFrame(b"s%d" % r, 10 + r), _LocalFrame(c.encode(b), 10 + r)] for r, c, b in script])
    relay._forward_up()
    (parts,) = relay._up.sent  # one message this turn
    controller = wire.Codec(KEY, "controller")
    seen = []  # (rank, message type, body) in the order the controller gets them
    for sub, frame in zip(parts[::2], parts[1::2]):
        if sub == b"":
            msg = controller.decode(frame)
            assert msg.type is wire.MsgType.NODE_ANSWERS and msg.sender.startswith("relay-0-")
            assert [b"s%d" % r for r in msg.body.ranks] == msg.body.subs
            seen += [(b.rank, msg.body.answer, b) for b in msg.body.bodies()]
        else:
            try:
                msg = controller.decode(frame)
            except wire.WireError:
                seen.append((int(sub[1:]), "rejected", None))
                continue
            seen.append((msg.body.rank, msg.type.value, msg.body))
    expected = [(r, "rejected" if c is forged else wire._TYPE_OF[type(b)].value, None if c is forged else b)
                for r, c, b in script]
    for r in range(4):  # every rank's messages, each once, in the order it sent them
        assert [s for s in seen if s[0] == r] == [e for e in expected if e[0] == r], r
    merged = sum(1 for sub in parts[::2] if sub == b"")
    assert relay.answers_merged == 6 and merged == 4, (relay.answers_merged, merged)
    assert len(parts) // 2 == 10 - 6 + merged


def test_a_fan_out_through_the_relay_is_one_frame_for_its_ranks():
    """Down: [b"", frame, packed subs] hands the one frame to each sub named; pairs as before;
    a packing the relay did not get from the controller is dropped whole."""
    from mindspeed_ha.control.server import pack_subs, unpack_subs

    subs = [b"s0", b"\x00k\x8b\x45\x67", b"x" * 255]
    assert unpack_subs(pack_subs(subs)) == subs
    for bad in (b"\x05ab", b"\x00"):
        with pytest.raises(ValueError):
            unpack_subs(bad)
    relay = _bare_relay([])
    relay._up = _Local([[_LocalFrame(p, None) for p in m]
                        for m in ([b"", b"F", pack_subs(subs)], [b"", b"G", b"\x05ab"], [b"s1", b"H"])])
    relay._forward_down()
    assert relay._local.sent == [[s, b"F"] for s in subs] + [[b"s1", b"H"]]


def test_node_answers_count_only_for_the_relays_own_ranks_in_order():
    """The controller's side: NODE_ANSWERS from a relay's message (sub b"") is handled in order
    among the ranks' frames of the same turn, each named rank's answer as its own frame; a sub
    that is not the named rank's connection through that relay, and the frame carried as a
    relayed rank's own, change nothing (fails when the relay's frame is handled after the
    ranks' frames of its turn: rank 1's later STATUS would be overwritten by its STOPPED)."""
    ctl, router, out, clock = _unstarted_controller()
    ident = {r: (b"n0", b"r%d" % r) for r in range(3)}
    ident[3] = (b"n1", b"r3")
    for r in range(4):
        router.push(ident[r], out[r].encode(wire.Register(r, 4, 100 + r, "h", Layout(), None, "run")))
    ctl._turn()
    assert len(ctl.state.ranks) == 4
    relay = wire.Codec(KEY, wire.new_sender("relay", 0))
    body = {"status": "updated", "iteration": 5, "pause_at": -1, "step": 6}
    # one message of relay n0: rank 1's merged STOPPED, then rank 1's STATUS; rank 3 is n1's, and
    # b"r2" is rank 2's sub, not rank 0's
    router.push((b"n0", b""), relay.encode(wire.NodeAnswers(0, "stopped", body, [b"r1", b"r3", b"r2"], [1, 3, 0])))
    router.push(ident[1], out[1].encode(wire.Status(1, "updating", 6, 7)))
    router.push(ident[2], relay.encode(wire.NodeAnswers(0, "stopped", body, [b"r2"], [2])))  # as a rank's frame
    clock.t += 0.1
    ctl._turn()
    info = ctl.state.ranks
    assert info[1].stopped and (info[1].status.value, info[1].iteration) == ("updating", 6), "out of order"
    assert not any(info[r].stopped for r in (0, 2, 3))
    assert ctl.node_answers == 1 and ctl.codec.rejected["unregistered"] == 2
    assert ctl.codec.rejected["unexpected_type"] == 1


@pytest.mark.parametrize("answer,common", [
    ("stopped", {"status": "updated", "iteration": 5, "pause_at": -1, "step": 6}),
    ("stopped", {"status": "updating", "iteration": 6, "pause_at": 4, "step": 7}),  # a first-round pause
    ("fault", {"iteration": 6, "kind": "aborted", "message": "aborted", "status": "updated", "where": "train_step"}),
    ("action_result", {"action_id": 1, "ok": True, "detail": "done"}),
])
def test_node_answers_do_what_each_ranks_own_frame_does(answer, common):
    """The controller hands the merged answer's common body to each named rank's handler (no
    body per rank): every rank's state, the action's results and the log lines are those of
    the ranks' own frames (fails if a handler reads the body's ``rank``: the results go to the
    first rank)."""
    from mindspeed_ha.control.state import PendingAction

    states = []
    for merged in (False, True):
        ctl, router, out, clock = _unstarted_controller()
        ident = {r: (b"n0", b"r%d" % r) for r in range(4)}
        for r in range(4):
            router.push(ident[r], out[r].encode(wire.Register(r, 4, 100 + r, "h", Layout(), None, "run")))
        ctl._turn()
        ctl.state.pending = PendingAction(1, "retry", (0, 1, 2, 3), clock.t)
        clock.t += 0.1
        if merged:
            relay = wire.Codec(KEY, wire.new_sender("relay", 0))
            router.push((b"n0", b""), relay.encode(wire.NodeAnswers(0, answer, common, [b"r3", b"r1", b"r2"],
                                                                    [3, 1, 2])))
        else:
            cls = wire.BODY_TYPES[wire.MsgType(answer)]
            for r in (3, 1, 2):
                router.push(ident[r], out[r].encode(cls(rank=r, **common)))
        with _caught_log() as lines:
            ctl._turn()
        st = ctl.state
        ranks = [{k: v for k, v in dataclasses.asdict(st.ranks[r]).items() if k != "sender"} for r in range(4)]
        states.append((ranks, dict(st.pending.results), lines))
    assert states[0] == states[1]
    assert answer != "action_result" or sorted(states[1][1]) == [1, 2, 3]


@contextlib.contextmanager
def _caught_log():
    lines = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append((record.levelno, record.getMessage()))
    logger = logging.getLogger("mindspeed_ha.control.controller")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def test_a_rank_stays_on_a_relay_that_reached_the_leader_while_its_register_is_unanswered(monkeypatch, short_tmp):
    """After the relay's NOTICE_OPEN the rank awaits the leader's REGISTERED through the
    relay under its loss clock, however long the leader takes: it never leaves the relay
    then (leaving closes its relayed connection, which the leader, once it registered the
    rank through the relay, takes for the rank's death). Before NOTICE_OPEN, RELAY_FOLLOW_GRACE still applies. Fails without the
    fix: the rank leaves the relay RELAY_FOLLOW_GRACE x lost_after_s after NOTICE_OPEN."""
    import threading

    from mindspeed_ha.control import link as link_mod
    from mindspeed_ha.control.lease import LeaseDir, Term
    from mindspeed_ha.control.relay import NOTICE_CLOSED, NOTICE_OPEN

    lease = LeaseDir(str(short_tmp / "lease"), KEY)
    assert lease.take(Term(0, "127.0.0.1", 1001, 0, 0, os.getpid()))
    monkeypatch.setenv(ha_env.LEASE_DIR, lease.path)

    class Proto:
        def resend_fault_locked(self):
            pass

    class Outbox:
        cond = threading.Lock()

    link = link_mod.ControlLink(CFG, 0, None, None, Proto(), Outbox(), addr=None, port=None, handle=print,
                                register_body=dict, on_lost=print, end=print)
    link.relay, left = "relay.sock", []
    monkeypatch.setattr(link, "_leave_relay", lambda now: left.append(now))
    link.registered.set()
    grace = link_mod.RELAY_FOLLOW_GRACE * link.lost_after_s
    link._relay_notice(NOTICE_CLOSED, 0.0)
    assert lease.take(Term(1, "127.0.0.1", 1002, 0, 1, os.getpid()))  # the successor leads
    assert link._follow_leader(1.0) is False  # the relay has RELAY_FOLLOW_GRACE from here
    link._relay_notice(NOTICE_OPEN, 2.0)  # it reached the leader; the rank's REGISTER goes through it
    assert (link._term, link.port) == (1, 1002)  # the rank follows term 1 too
    for now in (3.0, 3.0 + grace, 4.0 + grace, 2.0 + link._lost_after() - 0.5):
        assert link._follow_leader(now) is False and left == [], now
    # registered with term 1 through the relay; the relay's connection closes again, no new
    # leader: no grace (the relay reconnects to term 1, where the rank's relayed connection is
    # bound); then term 2 leads: the relay has RELAY_FOLLOW_GRACE to reach it, then is left
    link.disconnected_at = None  # the leader's REGISTERED
    link.registered.set()
    link._relay_notice(NOTICE_CLOSED, 100.0)
    assert link._follow_leader(101.0) is False and link._follow_leader(110.0 + grace) is False and left == []
    assert lease.take(Term(2, "127.0.0.1", 1003, 0, 2, os.getpid()))
    assert link._follow_leader(120.0) is False and left == []
    assert link._follow_leader(121.0 + grace) is True and left == [121.0 + grace]
    # a relay that reached a leader is not left for a newer term seen before REGISTERED came
    # (its connection to the deposed leader closes: then NOTICE_CLOSED, and the grace)
    link.relay, link._term = "relay.sock", 2
    link._relay_notice(NOTICE_CLOSED, 200.0)
    assert lease.take(Term(3, "127.0.0.1", 1004, 0, 3, os.getpid()))
    link._relay_notice(NOTICE_OPEN, 201.0)
    assert lease.take(Term(4, "127.0.0.1", 1005, 0, 4, os.getpid()))
    assert link._follow_leader(202.0) is False and link._follow_leader(203.0 + grace) is False
    assert left == [121.0 + grace]
