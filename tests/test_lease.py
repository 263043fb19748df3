"""The controller lease (mindspeed_ha.control.lease): one holder per term, and a leader that
stalls stops acting before a standby may start (no split brain), on fake clocks."""

import dataclasses
import json
import logging
import os
import stat
import threading

import pytest

from mindspeed_ha.control import sealed
from mindspeed_ha.control.lease import Leadership, LeaseDir, Term, Watch

pytestmark = pytest.mark.timeout(60)

#: the job's key (MINDSPEED_HA_AUTH_KEY): every lease file is sealed with it
KEY = bytes(range(32))


def _term(t, node=0):
    return Term(t, "127.0.0.1", 1000 + t, 0, node, 1)


def test_at_most_one_holder_per_term_among_racing_standbys(tmp_path):
    lease = LeaseDir(str(tmp_path / "lease"), KEY)
    wins, barrier = [], threading.Barrier(8)

    def contend(node):
        barrier.wait()
        if lease.take(_term(1, node)):
            wins.append(node)

    threads = [threading.Thread(target=contend, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert lease.current() == _term(1, wins[0])
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "lease").iterdir())


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_stalled_leader_stops_acting_before_a_standby_may_take_over(tmp_path):
    lease = LeaseDir(str(tmp_path / "lease"), KEY)
    assert lease.take(_term(0))
    clock = _Clock()
    leader = Leadership(lease, _term(0), lease_s=4.0, clock=clock)
    standby = Watch(lease, lease_s=4.0, clock=clock)
    assert standby.expired() is None
    lease.renew(0, 1)  # the standby sees the lease alive once
    leader._renewed_at = clock.t
    leader.stop()  # then its renewing thread stalls (a frozen process): no renewal from now on
    assert standby.expired() is None and leader.may_act()
    clock.t = 2.5  # past half a lease without renewal: the leader fences itself ...
    assert not leader.may_act() and "no lease renewal" in leader.lost
    assert standby.expired() is None  # ... while the standby must still wait
    clock.t = 3.9
    assert standby.expired() is None
    clock.t = 4.1  # a full lease of silence as the standby saw it: 2 s after the leader fenced itself
    assert standby.expired() == _term(0)
    assert lease.take(_term(1, node=1)) and not lease.take(_term(1, node=2))
    assert not leader.may_act()  # never again, even if it renewed


def test_a_live_lease_never_expires_and_a_higher_term_deposes(tmp_path):
    lease = LeaseDir(str(tmp_path / "lease"), KEY)
    assert lease.take(_term(0))
    clock = _Clock()
    lost = []
    leader = Leadership(lease, _term(0), lease_s=4.0, on_lost=lost.append, clock=clock)
    leader.stop()
    standby = Watch(lease, lease_s=4.0, clock=clock)
    for beat in range(1, 20):
        clock.t += 1.0
        lease.renew(0, beat)  # renewals keep coming
        leader._renewed_at = clock.t
        assert standby.expired() is None and leader.may_act()
    deposed = Leadership(lease, _term(0), lease_s=0.4, on_lost=lost.append)  # real clock, renewing thread
    assert lease.take(_term(1, node=1))  # e.g. an operator's mistake: a second leader appears
    deposed._thread.join(5)  # its next turn sees term 1 and gives up
    assert not deposed.may_act() and lost and "term 1" in lost[0]

def test_a_frozen_leader_that_wakes_up_late_never_renews(tmp_path):
    """The renewing thread may run first after a freeze: it must see it is too late and not
    renew (else may_act would be True again while a successor leads)."""
    lease = LeaseDir(str(tmp_path / "lease"), KEY)
    assert lease.take(_term(0))
    clock = _Clock()
    leader = Leadership(lease, _term(0), lease_s=0.2, clock=clock)
    clock.t = 100.0  # frozen for 100 s, as its thread saw it on waking
    leader._thread.join(5)  # its next turn finds the renewal too old and gives up
    assert not leader._thread.is_alive() and leader.lost and "no lease renewal" in leader.lost
    assert lease.beat(0) == 0 and not leader.may_act()


def test_a_term_left_by_an_earlier_run_never_expires(tmp_path):
    lease = LeaseDir(str(tmp_path / "lease"), KEY)
    assert lease.take(_term(3))
    lease.renew(3, 7)  # the last beat of a job that ended without clearing its lease
    clock = _Clock()
    standby = Watch(lease, lease_s=1.0, clock=clock)
    for t in range(1, 10):
        clock.t = float(t)
        assert standby.expired() is None


class _Turns(LeaseDir):
    """A lease directory that says when its leader renewed a second time (a whole turn of
    the renewing thread, higher-term check included, went by)."""

    def __init__(self, path):
        super().__init__(path, KEY)
        self.turned = threading.Event()

    def renew(self, term, beat):
        super().renew(term, beat)
        if beat >= 2:
            self.turned.set()


def _plain(t):
    return json.dumps(dataclasses.asdict(_term(t, node=9))).encode()


def test_a_forged_higher_term_deposes_nobody(tmp_path, caplog):
    """A stranger who can write the lease directory (shared filesystem) plants higher terms:
    one without a MAC (the old format), one sealed with another key, one that is a sealed
    term file of ours copied to a higher name. None counts: the leader keeps renewing and
    acting, a standby keeps seeing term 0, each file is logged once."""
    caplog.set_level(logging.WARNING, "mindspeed_ha.control.lease")
    lease = _Turns(str(tmp_path / "lease"))
    assert lease.take(_term(0))
    d = tmp_path / "lease"
    (d / "term-7.json").write_bytes(_plain(7))
    (d / "term-8.json").write_bytes(sealed.seal(b"k" * 32, "term-8.json", _plain(8)))
    (d / "term-9.json").write_bytes((d / "term-0.json").read_bytes())
    (d / "beat-0").write_bytes(b"12345")  # a forged counter (no MAC) is no counter
    lease.renew(0, 1)
    assert lease.current() == _term(0) and lease.beat(0) == 1
    leader = Leadership(lease, _term(0), lease_s=0.2, clock=lambda: 0.0)  # real turns, a clock that never ages
    try:
        assert lease.turned.wait(30), leader.lost
        assert leader.lost is None and leader.may_act()
    finally:
        leader.stop()
    for name in ("term-7.json", "term-8.json", "term-9.json"):
        assert caplog.text.count(f"{name} ignored") == 1, caplog.text
    assert "not a sealed file" in lease.refused["term-7.json"]
    assert "does not match" in lease.refused["term-8.json"] and "does not match" in lease.refused["term-9.json"]


def test_malformed_lease_files_are_ignored_never_fatal(tmp_path, caplog):
    """Whatever lies in the lease directory, reading it never raises and never blocks:
    the renewing thread, a standby's watch and a rank's I/O thread (which read it) live on.
    Sealed with the job's key but malformed (wrong types, the wrong term number, not
    JSON), a directory, a symbolic link, a FIFO, an oversized file, names with
    non-ASCII digits: all count as absent."""
    caplog.set_level(logging.WARNING, "mindspeed_ha.control.lease")
    lease = _Turns(str(tmp_path / "lease"))
    assert lease.take(_term(0))
    d = tmp_path / "lease"
    bad = dict(json.loads(_plain(5)), term="5")  # the old thread died comparing "5" > 0
    for name, payload in (("term-5.json", json.dumps(bad).encode()),
                          ("term-6.json", _plain(3)),  # holds term 3 under the name of term 6
                          ("term-10.json", b"[1, 2]"), ("term-11.json", b"\xff\x00"),
                          ("roster.json", b"[]"), ("beat-0", b"many")):
        (d / name).write_bytes(sealed.seal(KEY, name, payload))
    (d / "term-12.json").mkdir()
    os.symlink(d / "term-0.json", d / "term-13.json")
    os.mkfifo(d / "term-14.json")  # opening it for reading without O_NONBLOCK would block forever
    (d / "term-15.json").write_bytes(b"x" * (1 << 20))
    (d / "term-\u0661\u0666.json").write_bytes(_plain(16))  # Arabic-Indic digits: int() reads them
    assert lease.current() == _term(0)
    assert lease.beat(0) is None and lease.read_roster() == {}
    watch = Watch(lease, lease_s=1.0)
    assert watch.expired() is None
    leader = Leadership(lease, _term(0), lease_s=0.2, clock=lambda: 0.0)
    try:
        assert lease.turned.wait(30), leader.lost
        assert leader._thread.is_alive() and leader.lost is None and leader.may_act()
    finally:
        leader.stop()
    assert set(lease.refused) >= {"term-5.json", "term-6.json", "term-10.json", "term-11.json", "term-12.json",
                                  "term-13.json", "term-14.json", "term-15.json", "roster.json"}, lease.refused
    assert "holds term 3, not 6" in lease.refused["term-6.json"]
    assert "symbolic link" in lease.refused["term-13.json"] and "not a regular file" in lease.refused["term-14.json"]


def test_the_renewing_thread_survives_an_error_in_a_turn(tmp_path):
    """An unexpected error inside one renewal turn is logged; the thread renews on (the
    fence of may_act still holds if it cannot)."""
    lease = _Turns(str(tmp_path / "lease"))
    assert lease.take(_term(0))
    real, calls = lease.current, []

    def current():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("surprise")
        return real()

    lease.current = current
    leader = Leadership(lease, _term(0), lease_s=0.2, clock=lambda: 0.0)
    try:
        assert lease.turned.wait(30) and leader.lost is None and leader._thread.is_alive()
    finally:
        leader.stop()


def test_lease_files_are_private_and_never_follow_a_planted_link(tmp_path, monkeypatch, caplog):
    """Under umask 002 the directory is still 0700 and the files 0600; a group-writable
    directory of ours is closed (logged); a lease directory that is a symbolic link is
    refused; a symbolic link planted at a temporary name (the old predictable ones, or the
    new one if guessed) is never written through."""
    old = os.umask(0o002)
    try:
        lease = LeaseDir(str(tmp_path / "lease"), KEY)
        assert lease.take(_term(0))
        lease.renew(0, 1)
        lease.write_roster({"ranks": {}})
        d = tmp_path / "lease"
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        for name in ("term-0.json", "beat-0", "roster.json"):
            assert stat.S_IMODE((d / name).stat().st_mode) == 0o600, name
        os.chmod(d, 0o775)
        caplog.set_level(logging.WARNING, "mindspeed_ha.control.lease")
        assert LeaseDir(str(d), KEY).take(_term(1))
        assert stat.S_IMODE(d.stat().st_mode) == 0o700 and "set to 0700" in caplog.text
    finally:
        os.umask(old)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.symlink(victim, d / f".term-2.{os.getpid()}.{threading.get_ident()}.tmp")  # the old names
    os.symlink(victim, d / f".beat-1.{os.getpid()}.tmp")
    assert LeaseDir(str(d), KEY).take(_term(2))
    LeaseDir(str(d), KEY).renew(1, 5)
    monkeypatch.setattr(sealed.secrets, "token_hex", lambda n: "guessed")
    os.symlink(victim, d / ".beat-1.guessed.tmp")
    with pytest.raises(FileExistsError):
        LeaseDir(str(d), KEY).renew(1, 6)
    assert victim.read_text() == "precious" and LeaseDir(str(d), KEY).beat(1) == 5
    os.symlink(d, tmp_path / "link")
    with pytest.raises(PermissionError, match="symbolic link"):
        LeaseDir(str(tmp_path / "link"), KEY).take(_term(3))


def _listening_addresses(port):
    """The local addresses of the LISTEN sockets on ``port`` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(addr)
    return found


def test_a_successor_hosts_its_rebuild_store_on_the_job_interface_only(tmp_path):
    """The TCPStore a standby hosts when it takes over (process-group rebuilds) listens on
    the address the job uses, not on every interface (torch's TCPStore server binds the
    wildcard address whatever its host argument says)."""
    import types

    from mindspeed_ha.config import HAConfig
    from mindspeed_ha.launch.standby import Standby

    cfg = HAConfig(enabled=True, auth_key=KEY, controller_addr="127.0.0.1", save_dir=None)
    me = types.SimpleNamespace(config=cfg, lease=LeaseDir(str(tmp_path / "lease"), KEY), world_size=1, node_rank=1,
                               state=types.SimpleNamespace(controller=None, old_links=[], link=None), store=None)
    try:
        assert Standby._take_over(me, 1)
        assert me.lease.current().store_port == me.store.port
        assert _listening_addresses(me.store.port) == {"0100007F"}  # 127.0.0.1, nothing else
        me.store.set("k", b"v")
    finally:
        if me.state.controller is not None:
            me.state.controller.leadership.stop()
            me.state.controller.stop()


def test_node0s_static_rendezvous_store_listens_on_the_master_address_only(tmp_path, monkeypatch):
    """Node 0's agent hosts torchrun's static-rendezvous store (the default group's, where
    the start-up records live) on ``--master-addr`` only; torch's own would listen on every
    interface."""
    import socket

    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    from mindspeed_ha.agent import WorkerRebootAgent

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    handler = StaticTCPRendezvous("127.0.0.1", port, 0, 1, "run", 30)
    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=handler, entrypoint="python", args=())
    monkeypatch.setattr(LocalElasticAgent, "_rendezvous", lambda self, group: None)  # torch's part: not under test
    agent = WorkerRebootAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path)))
    agent._rendezvous(agent._worker_group)
    try:
        assert handler._store is not None and handler._store.port == port
        assert _listening_addresses(port) == {"0100007F"}
    finally:
        handler._store = None


def test_a_ranks_io_thread_reading_a_malformed_lease_lives_on(tmp_path, monkeypatch):
    """A rank's link looks into the lease directory at start-up and whenever its connection
    is closed (to follow a new leader); a stranger's or malformed term there neither raises
    nor redirects it."""
    from mindspeed_ha.config import HAConfig
    from mindspeed_ha.control.link import ControlLink

    lease = LeaseDir(str(tmp_path / "lease"), KEY)
    assert lease.take(_term(0))
    d = tmp_path / "lease"
    bad = dict(json.loads(_plain(5)), term="5")
    (d / "term-5.json").write_bytes(sealed.seal(KEY, "term-5.json", json.dumps(bad).encode()))
    (d / "term-6.json").write_bytes(json.dumps(bad | {"term": 6}).encode())  # a stranger's: no MAC
    monkeypatch.setenv("MINDSPEED_HA_LEASE_DIR", str(d))
    cfg = HAConfig(enabled=True, auth_key=KEY, controller_addr="127.0.0.1", save_dir=None)
    link = ControlLink(cfg, 0, None, None, None, None, addr=None, port=None, handle=print, register_body=dict,
                       on_lost=print, end=print)
    assert (link.addr, link.port) == ("127.0.0.1", _term(0).port)
    assert link._follow_leader(1e9) is False  # nothing higher than the term it follows


def test_a_host_name_that_resolves_to_loopback_keeps_torchs_wildcard(monkeypatch):
    """``--master-addr node0`` where /etc/hosts maps node0 to 127.0.1.1 (Debian's default):
    binding that address would shut the other nodes out, so such a name keeps torch's
    wildcard (with a warning); IP literals and localhost are bound as given."""
    import socket

    from mindspeed_ha.launch import stores

    real = socket.getaddrinfo
    monkeypatch.setattr(stores.socket, "getaddrinfo", lambda name, *a, **k: (
        [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))] if name == "node0" else real(name, *a, **k)))
    assert stores._loopback_alias("node0")
    assert not any(map(stores._loopback_alias, ("127.0.0.1", "[::1]", "localhost", "10.0.0.1")))


# ---------------------------------------------------------------------- the roster (issue 19)
class _Recording:
    """A lease directory stand-in: records each roster payload; the first write may be held."""

    path = "<recording>"

    def __init__(self):
        self.payloads = []
        self.hold = threading.Event()
        self.hold.set()

    def write_roster_payload(self, payload):
        self.hold.wait(10)
        self.payloads.append(payload)


def test_roster_writer_writes_the_newest_version_off_the_thread_and_never_an_older_one_after_it():
    from mindspeed_ha.control.failover import RosterWriter

    fenced = []
    writer = RosterWriter(lambda: not fenced, min_interval_s=60.0)  # the thread waits until flushed
    lease = _Recording()
    try:
        writer.submit(lease, lambda: b"v1")
        assert writer.flush()
        writer.submit(lease, lambda: b"v2")  # superseded before the thread's interval is over
        writer.submit(lease, lambda: b"v3")
        assert writer.flush()
        assert lease.payloads == [b"v1", b"v3"]
        writer.submit(lease, lambda: b"v4")  # pending, then overtaken by the I/O thread's own write
        writer.write_now(lease, b"v5")
        assert writer.flush()
        assert lease.payloads == [b"v1", b"v3", b"v5"]
        fenced.append(True)  # a fenced leader writes nothing any more
        writer.submit(lease, lambda: b"v6")
        writer.write_now(lease, b"v7")
        assert writer.flush()
        assert lease.payloads == [b"v1", b"v3", b"v5"]
    finally:
        writer.close()
    assert not any(t.name == "mindspeed-ha-roster" and t.is_alive() for t in threading.enumerate())


def test_roster_is_kept_per_rank_and_reads_back_as_registered(tmp_path):
    """The roster a successor reads: each rank's registration (made once, when it registered)
    and the recoveries so far, the same JSON object as built from the ranks' state."""
    from mindspeed_ha.config import HAConfig
    from mindspeed_ha.control.controller import Controller
    from mindspeed_ha.control.state import Layout, RankInfo

    ctl = Controller(HAConfig(enabled=True, auth_key=KEY, controller_addr="127.0.0.1"), 3, port=0)
    ctl.lease = LeaseDir(str(tmp_path / "lease"), KEY)
    try:
        for r in range(3):
            info = RankInfo(rank=r, layout=Layout(tp_rank=r % 2, tp_size=2, dp_size=2, dp_rank=r // 2), pid=100 + r,
                            host=f"h{r}", save_dir="/ckpt", sender=f"s{r}")
            info.incarnation, info.rejoins, info.verifies = r, bool(r % 2), True
            ctl.state.ranks[r] = info
            ctl.failover.note_rank(info)
        ctl.state.recoveries.append({"iteration": 3, "generation": 1, "ranks": {0: "x"}})
        expected = {"ranks": {str(r): {"layout": dataclasses.asdict(i.layout), "pid": i.pid, "host": i.host,
                                       "save_dir": "/ckpt", "incarnation": r, "rejoins": bool(r % 2), "verifies": True}
                              for r, i in ctl.state.ranks.items()},
                    "recoveries": [{"iteration": 3, "generation": 1, "ranks": {}}]}
        assert ctl.roster() == expected
        assert ctl.failover.may_decide(0.0)  # the roster changed: handed to the writer thread
        assert ctl.failover.writer.flush()
        assert ctl.lease.read_roster() == expected and ctl.failover.writer.writes == 1
        ctl.failover.write_roster()  # the one a RETRY needs: written at once
        assert ctl.failover.writer.writes == 2
    finally:
        ctl.failover.close()
