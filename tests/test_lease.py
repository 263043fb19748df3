"""The controller lease (mindspeed_ha.control.lease): one holder per term, and a leader that
stalls stops acting before a standby may start (no split brain), on fake clocks."""

import threading

import pytest

from mindspeed_ha.control.lease import Leadership, LeaseDir, Term, Watch

pytestmark = pytest.mark.timeout(60)


def _term(t, node=0):
    return Term(t, "127.0.0.1", 1000 + t, 0, node, 1)


def test_at_most_one_holder_per_term_among_racing_standbys(tmp_path):
    lease = LeaseDir(str(tmp_path / "lease"))
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
    lease = LeaseDir(str(tmp_path / "lease"))
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
    lease = LeaseDir(str(tmp_path / "lease"))
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
    lease = LeaseDir(str(tmp_path / "lease"))
    assert lease.take(_term(0))
    clock = _Clock()
    leader = Leadership(lease, _term(0), lease_s=0.2, clock=clock)
    clock.t = 100.0  # frozen for 100 s, as its thread saw it on waking
    leader._thread.join(5)  # its next turn finds the renewal too old and gives up
    assert not leader._thread.is_alive() and leader.lost and "no lease renewal" in leader.lost
    assert lease.beat(0) == 0 and not leader.may_act()


def test_a_term_left_by_an_earlier_run_never_expires(tmp_path):
    lease = LeaseDir(str(tmp_path / "lease"))
    assert lease.take(_term(3))
    lease.renew(3, 7)  # the last beat of a job that ended without clearing its lease
    clock = _Clock()
    standby = Watch(lease, lease_s=1.0, clock=clock)
    for t in range(1, 10):
        clock.t = float(t)
        assert standby.expired() is None
