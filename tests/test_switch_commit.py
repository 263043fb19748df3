"""A hot switch after its commit point, the controller's bookkeeping (control/switch_commit.py):
the answers a plan waits for, and the replica fallback's claim of a dead outgoing process
(the pause's decision must not see it as a fault while the fallback runs, and must see it
again when the fallback fails). No processes, no sockets."""

import dataclasses
import json
import types

from mindspeed_ha.control.policy import ActionKind, decide
from mindspeed_ha.control.policy.switch import Switch, SwitchAction, SwitchPhase, SwitchStep
from mindspeed_ha.control.state import OptimizerStatus, Phase, RankInfo
from mindspeed_ha.control.switch_commit import FALLBACK_STAGES, SWITCH_STAGES, Answers, ReplicaFallback
from mindspeed_ha.events import EventRecorder
from mindspeed_ha.faultspec import FaultSpec
from mindspeed_ha.testing.injector import Injector

from test_switch_policy import ARF, _outgoing_died, _paused_after


def test_answers_of_a_plan():
    a = Answers(deadline=30.0)
    a.expect(("rank", 0), 7)
    a.expect(("incoming", 1), 8)
    assert not a.note(("rank", 0), 6, True, "{}")  # an answer to an earlier plan
    assert a.note(("rank", 0), 7, True, json.dumps({"rebuild": 0.25}))
    assert a.late() == [("incoming", 1)] and a.failed() == {}
    assert a.note(("incoming", 1), 8, False, "Connection reset by peer")
    assert a.failed() == {("incoming", 1): "Connection reset by peer"} and a.late() == []
    assert a.stage_seconds(SWITCH_STAGES, {}) == {"rebuild": 0.25}
    assert a.stage_seconds(FALLBACK_STAGES, {"rebuild": 0.25}) == {"rebuild": 0.25}


def _ctl(st):
    server = types.SimpleNamespace(ident={1: b"old-1"}, rank_of_ident={b"old-1": 1}, forgotten=[])
    server.forget_rank = server.forgotten.append
    return types.SimpleNamespace(state=st, server=server, failover=types.SimpleNamespace(roster_dirty=False),
                                 recorder=EventRecorder("controller"))


def test_the_claim_hides_the_death_from_the_pause_and_a_failure_gives_it_back():
    st = _outgoing_died(_paused_after(9))
    st.recoveries.append({"iteration": 9, "mode": "switch", "generation": 2, "repairs": [[1, 1]]})
    before = decide(20.0, st, ARF)
    assert before.action is ActionKind.STOP_ALL and before.next_phase is Phase.STOPPING  # what main did
    sw = Switch("r1", (1,), 1.0, phase=SwitchPhase.COMMITTED, iteration=9)
    new = RankInfo(rank=1, layout=st.ranks[1].layout, last_heartbeat=19.5, pid=4321)
    ctl = _ctl(st)
    fb = ReplicaFallback()
    fb.claim(ctl, 19.9, sw, SwitchStep(SwitchAction.FALLBACK, "rank 1 died", sources={1: 3}), {1: new})
    assert sw.fallback == {1: 3} and "died" in sw.marks
    assert st.ranks[1] is new and (new.status, new.iteration) == (OptimizerStatus.UPDATED, 9)
    assert ctl.server.forgotten == [1] and ctl.server.rank_of_ident == {} and ctl.failover.roster_dirty
    (event,) = ctl.recorder.events("SwitchFallback")
    assert event.detail["detail"]["sources"] == {"1": 3}
    d = decide(20.0, st, ARF)
    assert d.action is ActionKind.NOOP and d.next_phase is None and "paused after iteration 9" in d.reason, d

    plan = fb.plan(st, sw, SwitchStep(SwitchAction.REPAIR, "repair", sources={1: 3}))
    assert (plan.mode, plan.generation, plan.iteration, plan.repairs, plan.rejoin) == \
        ("switch_repair", 2, 9, {1: 3}, (1,))
    assert st.recoveries[-1]["repairs"] == [[1, 3]]

    fb.restore(st)
    assert st.ranks[1].pid != 4321 and not st.ranks[1].alive and fb.claimed == {}
    assert decide(20.0, st, ARF).next_phase is Phase.STOPPING  # the job's fault handling again


def test_the_handoff_point_fires_in_the_first_handoff_of_the_named_process():
    spec = FaultSpec.parse("rank=1,iteration=1,point=handoff,fault=kill")
    assert (spec.point, spec.fault, spec.incarnation) == ("handoff", "kill", 0)
    inj = Injector(1, [spec, dataclasses.replace(spec, rank=2)])
    assert inj.armed("handoff", 1) == spec and inj.armed("handoff", 2) is None and inj.armed("recover", 1) is None
    assert Injector(2, [spec]).armed("handoff", 1) is None
