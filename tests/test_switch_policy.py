"""The hot switch's pure part (control/policy/switch.py): refusals, the decision of each
turn before the commit point, the phase machine and the published phase seconds."""

import dataclasses

import pytest

from mindspeed_ha.control.policy.switch import (SWITCH_MOVES, Switch, SwitchAction, SwitchPhase, committed,
                                                node_ranks, phase_seconds, refuse, step)
from mindspeed_ha.control.state import ClusterState, PauseRequest, Phase, StopRequest
from mindspeed_ha.faults import FaultKind

from test_control import CFG
from test_policy import cluster

ARF = dataclasses.replace(CFG, worker_reboot=True, heartbeat_timeout_s=100.0, connect_timeout_s=30.0)


def _running(**kw):
    st = ClusterState(world_size=4, ranks=cluster(1, 1, 4, 2, it=7), phase=Phase.RUNNING, phase_since=0.0, **kw)
    for info in st.ranks.values():
        info.stopped, info.rejoins, info.last_heartbeat = False, True, 10.0
    return st


def _dead(st):
    st.ranks[2].alive = False
    return st


def _fault(st):
    st.ranks[3].fault = FaultKind.NETWORK
    return st


def _unregistered(st):
    del st.ranks[3]
    return st


def _no_rejoin(st):
    st.ranks[1].rejoins = False
    return st


def _restarting(st):
    st.rejoin_wait[2] = 5.0
    return st


ONE = {"local": 1}  # the hosting launcher's warm spare
#: ranks 2 and 3 on another node (its agent link's routing id)
TWO_NODES = {2: "agent a1-x", 3: "agent a1-x"}


@pytest.mark.parametrize("case,ranks,spares,switching,change,cfg,expect", [
    ("ok", [1], ONE, (), None, ARF, None),
    ("rank 0 too", [0], ONE, (), None, ARF, None),
    ("no ranks", [], ONE, (), None, ARF, "at least one"),
    ("outside", [4], ONE, (), None, ARF, "outside the job's ranks 0..3"),
    ("negative", [-1], ONE, (), None, ARF, "outside"),
    ("twice", [1, 1], ONE, (), None, ARF, "named twice"),
    ("worker reboot off", [1], ONE, (), None, CFG, "--enable-worker-reboot"),
    ("already switching", [1], ONE, (1,), None, ARF, "already switching"),
    ("another switch", [1], ONE, (2,), None, ARF, "one switch at a time"),
    ("no spare reported", [1], None, (), None, ARF, "no spare"),
    ("no spare left", [1], {"local": 0}, (), None, ARF, "no spare parked on the node of ranks [1]"),
    # a whole node: one warm spare starts the first new process, the others start cold
    ("a whole node, one spare", [0, 1, 2, 3], ONE, (), None, ARF, None),
    ("a rank is gone", [1], ONE, (), _dead, ARF, "are gone"),
    ("a fault", [1], ONE, (), _fault, ARF, "a fault"),
    ("unregistered", [1], ONE, (), _unregistered, ARF, "not registered"),
    ("restarting", [1], ONE, (), _restarting, ARF, "being restarted"),
    ("no rejoin support", [1], ONE, (), _no_rejoin, ARF, "without rejoin support"),
])
def test_refusals(case, ranks, spares, switching, change, cfg, expect):
    st = _running()
    if change is not None:
        st = change(st)
    why = refuse(st, cfg, ranks, spares, switching)
    if expect is None:
        assert why is None, why
    else:
        assert why is not None and expect in why, why


@pytest.mark.parametrize("case,ranks,spares,expect", [
    ("the other node's rank, its spare", [2], {"local": 1, "agent a1-x": 1}, None),
    ("the other node's rank, a spare only here", [3], {"local": 1}, "no spare parked on the node of ranks [3]"),
    ("this node's rank, a spare only there", [1], {"local": 0, "agent a1-x": 1}, "node of ranks [1]"),
    ("both nodes, both spares", [1, 2], {"local": 1, "agent a1-x": 1}, None),
    ("both nodes, one spare", [1, 2, 3], {"local": 1}, "node of ranks [2, 3]"),
])
def test_each_node_of_a_switched_rank_needs_its_spare(case, ranks, spares, expect):
    why = refuse(_running(), ARF, ranks, spares, (), TWO_NODES)
    if expect is None:
        assert why is None, why
    else:
        assert why is not None and expect in why, why


def test_node_ranks_are_the_ranks_registered_from_that_host():
    st = _running()
    for r, info in st.ranks.items():
        info.host = "n0" if r < 2 else "n1"
    assert node_ranks(st, "n1") == ([2, 3], None)
    assert node_ranks(st, "n0") == ([0, 1], None)
    ranks, why = node_ranks(st, "n9")
    assert ranks == [] and "--node 'n9': no rank registered from it (hosts: ['n0', 'n1'])" in why


@pytest.mark.parametrize("phase", [Phase.PAUSED, Phase.RECOVERING, Phase.DRAINING, Phase.STOPPING])
def test_refused_outside_running(phase):
    st = _running()
    st.phase = phase
    assert "not running" in refuse(st, ARF, [1], ONE)


def test_refused_during_a_stop_or_a_pause():
    st = _running(stop_request=StopRequest(1.0, -1, "SIGTERM"))
    assert "graceful stop" in refuse(st, ARF, [1], ONE)
    st = _running(pause=PauseRequest(1.0))
    assert "pause" in refuse(st, ARF, [1], ONE)


def _switch(phase=SwitchPhase.STARTING, ready=(), at=10.0):
    sw = Switch("r1", (1,), at)
    sw.phase = phase
    sw.ready = {r: 100 + r for r in ready}
    return sw


@pytest.mark.parametrize("case,sw,job,now,gone,expect,words", [
    ("spare starting", _switch(), Phase.RUNNING, 20.0, {}, SwitchAction.WAIT, ""),
    ("spare READY", _switch(ready=(1,)), Phase.RUNNING, 20.0, {}, SwitchAction.PAUSE, "graceful pause"),
    ("READY never comes", _switch(), Phase.RUNNING, 40.5, {}, SwitchAction.ABORT, "not READY within 30 s"),
    ("spare died", _switch(), Phase.RUNNING, 20.0, {1: "exit -9"}, SwitchAction.ABORT, "spare died"),
    ("spare died while pausing", _switch(SwitchPhase.PAUSING, (1,)), Phase.PAUSING, 20.0, {1: "exit -9"},
     SwitchAction.ABORT, "before the commit point"),
    ("pausing", _switch(SwitchPhase.PAUSING, (1,)), Phase.PAUSING, 20.0, {}, SwitchAction.WAIT, ""),
    ("paused: commit", _switch(SwitchPhase.PAUSING, (1,)), Phase.PAUSED, 20.0, {}, SwitchAction.COMMIT, "iteration"),
    ("pause failed", _switch(SwitchPhase.PAUSING, (1,)), Phase.RUNNING, 20.0, {}, SwitchAction.ABORT,
     "did not hold"),
    ("a fault came first", _switch(), Phase.RECOVERING, 20.0, {}, SwitchAction.ABORT, "left running"),
    ("after the commit point", _switch(SwitchPhase.COMMITTED, (1,)), Phase.PAUSED, 99.0, {1: "gone"},
     SwitchAction.WAIT, ""),
])
def test_decisions_before_the_commit_point(case, sw, job, now, gone, expect, words):
    st = _running()
    st.phase, st.drain_until = job, 9
    d = step(now, sw, st, ARF, gone)
    assert d.action is expect, d
    assert words in d.reason


def test_a_fault_of_a_rank_aborts_a_starting_switch():
    st = _fault(_running())
    d = step(20.0, _switch(ready=(1,)), st, ARF, {})
    assert d.action is SwitchAction.ABORT and "fault" in d.reason


def test_a_rank_that_ended_aborts_a_starting_switch():
    """Training ended on a rank (GOODBYE 0) while the new process was starting."""
    st = _dead(_running())
    st.ranks[2].dead_reason = "said goodbye (exit code 0)"
    d = step(20.0, _switch(ready=(1,)), st, ARF, {})
    assert d.action is SwitchAction.ABORT and "ranks [2] ended before the pause (said goodbye" in d.reason


def test_phase_machine_rejects_illegal_moves_and_marks_each_phase():
    sw = _switch()
    with pytest.raises(ValueError, match="starting -> committed is not allowed"):
        sw.transition(SwitchPhase.COMMITTED, 11.0)
    sw.transition(SwitchPhase.READY, 12.0)
    sw.transition(SwitchPhase.PAUSING, 12.0)
    sw.mark("paused", 12.5)
    sw.transition(SwitchPhase.COMMITTED, 12.5)
    for name, at in (("answered", 13.0), ("resumed", 13.25)):
        sw.mark(name, at)
    sw.transition(SwitchPhase.DONE, 13.25, "switched")
    assert sw.ended and sw.reason == "switched"
    assert phase_seconds(sw.marks, {"rebuild": 0.125, "transfer": 0.25}) == {
        "spare_ready": 2.0, "pause": 0.5, "commit": 0.5, "resume": 0.25, "pause_window": 0.75, "total": 3.25,
        "rebuild": 0.125, "transfer": 0.25}
    with pytest.raises(ValueError):
        sw.transition(SwitchPhase.ABORTED, 14.0)  # an ended switch stays ended


def test_every_phase_has_its_moves_and_ended_phases_none():
    assert set(SWITCH_MOVES) == set(SwitchPhase)
    for p in (SwitchPhase.DONE, SwitchPhase.ABORTED, SwitchPhase.FAILED):
        assert SWITCH_MOVES[p] == frozenset()
    # before the commit point every phase may abort; after it never (the job's fault handling takes over)
    for p in (SwitchPhase.STARTING, SwitchPhase.READY, SwitchPhase.PAUSING):
        assert SwitchPhase.ABORTED in SWITCH_MOVES[p]
    assert SwitchPhase.ABORTED not in SWITCH_MOVES[SwitchPhase.COMMITTED]


def test_phase_seconds_leave_out_what_is_not_known():
    assert phase_seconds({"requested": 1.0, "ready": 3.5}) == {"spare_ready": 2.5}


def test_a_switch_record_is_no_retry_of_its_iteration():
    """The switch's generation is kept in ``ClusterState.recoveries`` (mode ``switch``); a fault
    right after it, rolled back to the same iteration, is still a first retry."""
    from mindspeed_ha.control.policy.recovery import consecutive_retries

    history = [{"iteration": 9, "mode": "rollback"}, {"iteration": 12, "mode": "switch", "generation": 2}]
    assert consecutive_retries(history, 12) == 0
    assert consecutive_retries(history + [{"iteration": 12, "mode": "rollback"}], 12) == 1


def _paused_after(k=9):
    st = _running()
    st.phase, st.drain_until = Phase.PAUSED, k
    return st


def _outgoing_died(st):
    st.ranks[1].alive, st.ranks[1].dead_reason = False, "control connection closed"
    return st


def _stopping(st):
    st.phase = Phase.STOPPING
    return st


def _no_replica(st):
    """--distributed-optimizer-no-replica: one optimizer instance, each shard on its own rank."""
    for r, info in st.ranks.items():
        info.layout = dataclasses.replace(info.layout, replica_count=1, instance_id=0, shard_id=r)
    return st


def _holder_died(st):
    st.ranks[3].alive, st.ranks[3].dead_reason = False, "control connection closed"
    return st


@pytest.mark.parametrize("case,change,gone,failed,late,now,expect,stop,words", [
    ("every answer ok", None, {}, {}, [], 20.0, SwitchAction.FINISH, False, "answered"),
    ("answers due", None, {}, {}, [("rank", 1)], 20.0, SwitchAction.WAIT, False, ""),
    ("answers late", None, {}, {}, [("rank", 1)], 31.0, SwitchAction.FAIL, True, "no answer from [('rank', 1)]"),
    ("a failed answer", None, {}, {("incoming", 1): "recv timed out"}, [], 20.0, SwitchAction.FAIL, True,
     "incoming 1: recv timed out"),
    ("the new process died", None, {1: "exited with -9"}, {}, [("incoming", 1)], 20.0, SwitchAction.FAIL, True,
     "a new process died after the commit point (rank 1: exited with -9)"),
    # the outgoing process dies in the middle of its handoff, --distributed-optimizer-no-replica:
    # the controller saw its death as a fault during the pause (its handling: the dying
    # checkpoint of K, impossible without a replica); no stop asked on top (as before the fallback)
    ("the outgoing process died, no replica", lambda st: _outgoing_died(_no_replica(st)), {}, {},
     [("rank", 1), ("incoming", 1)], 20.0, SwitchAction.FAIL, False,
     "ranks [1] ended after the commit point (control connection closed): the job's fault handling"),
    ("no replica: the new process's handoff failed first", _no_replica, {}, {("incoming", 1): "Connection closed"},
     [("rank", 1)], 20.0, SwitchAction.FAIL, True, "incoming 1: Connection closed"),
    # with replicas (rank 3 holds rank 1's shard): the replica fallback
    ("the outgoing process died, rank 3 holds its shard", _outgoing_died, {}, {}, [("rank", 1), ("incoming", 1)],
     20.0, SwitchAction.FALLBACK, False, "repaired from the replica holder rank 3 (of rank 1)"),
    ("its new process died too", _outgoing_died, {1: "exited with -9"}, {}, [("rank", 1), ("incoming", 1)], 20.0,
     SwitchAction.FAIL, False, "the job's fault handling takes over"),
    ("its replica holder died too", lambda st: _outgoing_died(_holder_died(st)), {}, {}, [("rank", 1)], 20.0,
     SwitchAction.FAIL, False, "ranks [1, 3] ended after the commit point"),
    ("a staying rank died", _holder_died, {}, {}, [("rank", 1)], 20.0, SwitchAction.FAIL, False,
     "ranks [3] ended after the commit point"),
    ("the outgoing died, the job left the pause", lambda st: _outgoing_died(_stopping(st)), {}, {}, [("rank", 1)],
     20.0, SwitchAction.FAIL, False, "the job's fault handling takes over"),
    # the new process's link breaks before the controller sees the outgoing process's death: its
    # failed answer waits for the outgoing process's answer or death (replicas only)
    ("the new process's handoff failed first", None, {}, {("incoming", 1): "Connection closed"}, [("rank", 1)],
     20.0, SwitchAction.WAIT, False, ""),
    ("... and the outgoing neither answered nor died in time", None, {}, {("incoming", 1): "Connection closed"},
     [("rank", 1)], 31.0, SwitchAction.FAIL, True, "incoming 1: Connection closed"),
    ("... and the outgoing answered a failure", None, {}, {("incoming", 1): "Connection closed",
                                                         ("rank", 1): "send failed"}, [], 20.0,
     SwitchAction.FAIL, True, "rank 1: send failed"),
    ("the job left the pause", _stopping, {}, {}, [("rank", 1)], 20.0, SwitchAction.FAIL, False,
     "left the pause"),
])
def test_decisions_after_the_commit_point(case, change, gone, failed, late, now, expect, stop, words):
    st = _paused_after()
    if change is not None:
        st = change(st)
    d = committed(now, _switch(SwitchPhase.COMMITTED, (1,)), st, gone, failed, late, deadline=30.0)
    assert d.action is expect and d.stop is stop, d
    assert words in d.reason
    assert dict(d.sources) == ({1: 3} if expect is SwitchAction.FALLBACK else {}), d


def _falling_back(repair_out=False):
    sw = _switch(SwitchPhase.COMMITTED, (1,))
    sw.fallback = {1: 3}
    sw.mark("died", 15.0)
    if repair_out:
        sw.mark("repair", 16.0)
    return sw


FIRST_ROUND_LATE = [("rank", 1)]  # the dead outgoing process never answers


@pytest.mark.parametrize("case,repair_out,change,gone,failed,late,parked,now,expect,words", [
    # the new process stands for rank 1 in the controller's view: every rank is alive
    ("staying ranks' answers due", False, None, {}, {}, [("rank", 0), ("incoming", 1)], (), 20.0,
     SwitchAction.WAIT, ""),
    ("its handoff failed, not parked again yet", False, None, {}, {("incoming", 1): "closed"}, FIRST_ROUND_LATE,
     (), 20.0, SwitchAction.WAIT, ""),
    ("parked again: the plan goes out", False, None, {}, {("incoming", 1): "closed"}, FIRST_ROUND_LATE, (1,),
     20.0, SwitchAction.REPAIR, "repaired from the replica holder rank 3 (of rank 1)"),
    ("never parked again", False, None, {}, {("incoming", 1): "closed"}, FIRST_ROUND_LATE, (), 31.0,
     SwitchAction.FAIL, "not parked again in time"),
    ("it received everything before the death", False, None, {}, {}, FIRST_ROUND_LATE, (), 20.0,
     SwitchAction.FINISH, "received its whole state"),
    ("a staying rank's rebuild failed", False, None, {}, {("incoming", 1): "closed", ("rank", 0): "rebuild"},
     FIRST_ROUND_LATE, (1,), 20.0, SwitchAction.FAIL, "rank 0: rebuild"),
    ("the plan out, answers due", True, None, {}, {}, [("rank", 3)], (1,), 20.0, SwitchAction.WAIT, ""),
    ("the plan out, every answer ok", True, None, {}, {}, [], (1,), 20.0, SwitchAction.FINISH,
     "repaired from its replica holder"),
    ("the plan out, the repair failed", True, None, {}, {("rank", 3): "send failed"}, [], (1,), 20.0,
     SwitchAction.FAIL, "the replica fallback failed (rank 3: send failed)"),
    ("the plan out, answers late", True, None, {}, {}, [("incoming", 1)], (1,), 31.0, SwitchAction.FAIL,
     "no answer from [('incoming', 1)]"),
    ("the new process died", True, None, {1: "exited with 1"}, {}, [("incoming", 1)], (1,), 20.0,
     SwitchAction.FAIL, "a new process died during the replica fallback"),
    ("the holder died", True, _holder_died, {}, {}, [("rank", 3)], (1,), 20.0, SwitchAction.FAIL,
     "ranks [3] ended during the replica fallback"),
    ("the job left the pause", False, _stopping, {}, {}, [], (1,), 20.0, SwitchAction.FAIL, "left the pause"),
])
def test_decisions_of_the_replica_fallback(case, repair_out, change, gone, failed, late, parked, now, expect, words):
    """An outgoing process died in its handoff, rank 3 holds its shard: every FAIL gives the
    death back to the job's fault handling (no stop on top: the dying checkpoint of K)."""
    st = _paused_after()
    if change is not None:
        st = change(st)
    d = committed(now, _falling_back(repair_out), st, gone, failed, late, 30.0, frozenset(parked))
    assert d.action is expect and not d.stop, d
    assert words in d.reason, d
    assert dict(d.sources) == ({1: 3} if expect is SwitchAction.REPAIR else {}), d


def test_the_fallback_phase_runs_from_the_death_to_the_answers():
    marks = {"requested": 0.0, "ready": 1.0, "paused": 1.5, "died": 1.75, "repair": 2.0, "answered": 2.5,
             "resumed": 2.5}
    seconds = phase_seconds(marks, {"rebuild": 0.125, "repair": 0.25})
    assert seconds["fallback"] == 0.75 and seconds["pause_window"] == 1.0 and seconds["repair"] == 0.25
    assert "fallback" not in phase_seconds({k: v for k, v in marks.items() if k != "died"})
