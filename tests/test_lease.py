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
    leader.stop()  # its renewing thread stalls (a frozen process): no renewal from now on
    standby = Watch(lease, lease_s=4.0, clock=clock)
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
    assert lease.take(_term(1, node=1))  # e.g. an operator's mistake: a second leader appears
    assert not leader.may_act() and lost and "term 1" in lost[0]
