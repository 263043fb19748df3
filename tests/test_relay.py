"""The node relay (``control/relay.py``): a node's ranks over one CURVE connection.

In one process over real sockets (the controller's CURVE port, the relay's ipc socket):
the ranks register and are stopped through the relay with their own frames (the
controller checks each rank's HMAC), a forged frame through the relay is rejected by the
controller, a rank's closed local connection is its death, the relay's socket is private
to the user, and ranks whose relay is gone go on connected directly. Teardown and leak
checks are test_control's fixtures.
"""

import dataclasses
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
