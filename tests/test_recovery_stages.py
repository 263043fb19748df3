"""Recovery as plans of stages (unit): the mode -> stages table, the executor's timing
into rank phase events and its RETRY result, the fault ledger, the catch-up answer."""

from __future__ import annotations

import gc
import json
import types

import pytest

from mindspeed_ha.control.recovery_plan import MODES, RecoveryPlan
from mindspeed_ha.events import EventRecorder
from mindspeed_ha.faults import FaultKind
from mindspeed_ha.recovery import executor, stages
from mindspeed_ha.runtime.fault_report import FaultLedger, FaultReport
from mindspeed_ha.runtime.state import StepState


def test_every_plan_mode_has_its_stages_in_the_order_the_result_reports():
    assert set(stages.IN_PLACE) == set(MODES)
    names = {mode: [n for n, _ in stages.IN_PLACE[mode]] for mode in MODES}
    assert names["rollback"] == names["rejoin"] == ["clean", "rebuild", "repair", "rollback"]
    assert names["forward"] == ["clean", "rebuild", "repair"]
    assert names["reload"] == ["clean", "rebuild", "reload", "repair"]
    assert {m: [n for n, _ in s] for m, s in stages.REJOINING.items()} == {
        "rejoin": ["rebuild", "repair"], "forward": ["rebuild", "repair"], "reload": ["rebuild", "reload", "repair"]}


def _plan(mode="rollback", **kw):
    return RecoveryPlan(iteration=4, generation=1, kind=FaultKind.UCE, fault_rank=0, mode=mode, **kw)


def test_a_plan_that_does_not_rejoin_this_rank_is_refused():
    with pytest.raises(RuntimeError, match="does not rejoin"):
        stages.rejoining(_plan("rollback"), 1)
    with pytest.raises(RuntimeError, match="does not rejoin"):
        stages.rejoining(_plan("rejoin", rejoin=(2,), repairs={2: 0}), 1)
    assert stages.rejoining(_plan("rejoin", rejoin=(1,), repairs={1: 0}), 1) is stages.REJOINING["rejoin"]


def test_the_executor_times_each_stage_as_a_phase_event():
    recorder = EventRecorder("rank-3")
    ran = []
    c = stages.RecoveryContext(rt=types.SimpleNamespace(rank=3), plan=_plan())
    times = executor.run_stages((("clean", lambda c: ran.append("clean")), ("rebuild", lambda c: ran.append("rb"))),
                                c, recorder)
    assert ran == ["clean", "rb"] and list(times) == ["clean", "rebuild"]
    events = recorder.events()
    assert [e.name for e in events] == ["clean", "rebuild"] and all(e.source == "rank-3" for e in events)
    assert times == {e.name: round(e.seconds, 6) for e in events}
    assert events[0].iteration == 4 and events[0].detail["mode"] == "rollback"


def test_a_failed_stage_is_an_event_with_ok_false_and_the_rest_does_not_run():
    recorder = EventRecorder("rank-0")
    c = stages.RecoveryContext(rt=types.SimpleNamespace(rank=0), plan=_plan())

    def boom(c):
        raise RuntimeError("rebuild failed")

    with pytest.raises(RuntimeError, match="rebuild failed"):
        executor.run_stages((("rebuild", boom), ("repair", lambda c: pytest.fail("ran"))), c, recorder)
    (event,) = recorder.events()
    assert not event.ok and "rebuild failed" in event.detail["error"]


def test_recover_sends_the_retry_result_built_from_the_stage_events(monkeypatch):
    results = []
    rt = types.SimpleNamespace(rank=1, ctx=None, events=EventRecorder("rank-1"), recoveries=0,
                               processor=types.SimpleNamespace(action_result=lambda *a: results.append(a)))
    rt.mark_recovered = lambda: setattr(rt, "recoveries", rt.recoveries + 1)
    monkeypatch.setitem(stages.IN_PLACE, "rollback", (("clean", lambda c: None), ("repair", lambda c: None)))
    action = types.SimpleNamespace(action_id=7, params=_plan().to_params())
    times = executor.recover(rt, action)
    (aid, ok, detail), = results
    assert aid == 7 and ok and rt.recoveries == 1
    assert json.loads(detail) == dict(times, rank=1, iteration=4, generation=1, repaired=False, mode="rollback")


def test_a_fault_is_reported_once_and_its_chain_is_known():
    ledger = FaultLedger()
    first = RuntimeError("first")
    assert not ledger.seen(first)
    ledger.remember(first, FaultReport("RuntimeError: first", "network", 3, "train_step", True, "RETRY"))
    assert ledger.seen(first) and ledger.report_of(first).action == "RETRY"
    try:
        try:
            raise first
        except RuntimeError:
            raise ValueError("during")
    except ValueError as exc:
        later = exc
    assert ledger.seen(later) and ledger.report_of(later) is None  # raised during a reported one
    ledger.step_completed()  # a built-in type is held until the step completes
    assert not ledger.seen(first)

    class Injected(RuntimeError):
        pass

    weak = Injected("weak")
    ledger.remember(weak, FaultReport("Injected: weak", "network", 3, "train_step"))
    assert ledger.seen(weak)
    ref = __import__("weakref").ref(weak)
    del weak
    gc.collect()
    assert ref() is None  # the ledger keeps no Python-defined exception (nor its frames) alive


def test_the_catch_up_step_answers_the_attached_optimizer_once():
    from mindspeed_ha.runtime.core import HARuntime

    rt = HARuntime(config=None, args=types.SimpleNamespace())
    opt, other = object(), object()
    rt.state.catching_up = {"grad_norm": 1.5, "num_zeros": 0}
    rt.state.catch_up_optimizer = opt
    rt.current = 5
    assert rt.catch_up_step(other) is None
    assert rt.catch_up_step(opt) == (True, 1.5, 0)
    assert rt.snapshot.iteration == 5 and rt.state.update_depth == 0
    assert rt.catch_up_step(opt) is None  # once


def test_step_state_lists_every_replay_wrapper():
    state = StepState()
    state.replays = {1: ("it", "w", ["a", "b"]), 2: ("it2", "w2", ["c"])}
    assert state.replay_wrappers() == ["a", "b", "c"]
