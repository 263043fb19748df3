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
    assert names["switch"] == ["rebuild"]  # a hot switch's paused ranks (the outgoing one hands over instead)
    assert names["switch_repair"] == ["repair"]  # its replica fallback: the groups stay as rebuilt
    assert {m: [n for n, _ in s] for m, s in stages.REJOINING.items()} == {
        "rejoin": ["rebuild", "repair"], "forward": ["rebuild", "repair"], "reload": ["rebuild", "reload", "repair"],
        "switch": ["rebuild", "repair"], "switch_repair": ["repair"]}


def _plan(mode="rollback", generation=1, **kw):
    return RecoveryPlan(iteration=4, generation=generation, kind=FaultKind.UCE, fault_rank=0, mode=mode, **kw)


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


# ---- a failed recovery follows the controller's next action -------------------------------------
class _Processor:
    """The processor's side of a recovery: results and faults recorded, the controller's
    answers to the faults given in order."""

    incarnation = 1

    def __init__(self, *answers):
        self.answers = list(answers)
        self.results, self.faults = [], []

    def action_result(self, action_id, ok, detail):
        self.results.append((action_id, ok))

    def report_fault(self, exc, iteration, where="train_step"):
        self.faults.append((str(exc), iteration, where))
        return self.answers.pop(0)

    def wait_to_rejoin(self, timeout=None):
        return self.report_fault("rejoin point", -1, where="rejoin")


def _action(action_id, kind="retry", store=None, **plan):
    params = _plan(**plan).to_params() if kind == "retry" else {"code": 75, "reason": "dying checkpoint"}
    if store is not None:  # a controller successor names its rendezvous store
        params["store"] = store
    return types.SimpleNamespace(action_id=action_id, kind=kind, params=params)


def _runtime(processor):
    from mindspeed_ha.runtime.core import HARuntime

    rt = HARuntime(config=types.SimpleNamespace(hbm_repair=False, action_timeout_s=5), args=types.SimpleNamespace())
    rt.processor, rt.current = processor, 5
    return rt


def _store_lost_at_generation_1(ran):
    def rebuild(c):
        ran.append(c.plan.generation)
        if c.plan.generation == 1:  # the controller's node (and its store) died during the rebuild
            raise RuntimeError("rebuild_process_groups: rank 2 could not create 0.ha1")

    return rebuild


def test_a_failed_recovery_runs_again_with_the_controller_s_next_plan(monkeypatch):
    """The rebuild fails (the store died with the controller's node): the failure is sent as
    the RETRY result, reported as a fault, and the successor's RETRY (a new generation, its
    store) is carried out; not re-raised."""
    ran = []
    monkeypatch.setitem(stages.IN_PLACE, "rollback", (("rebuild", _store_lost_at_generation_1(ran)),))
    processor = _Processor(_action(9, generation=2, store="127.0.0.1:29999"))
    rt = _runtime(processor)
    times = rt.recover(_action(7))
    assert ran == [1, 2] and list(times) == ["rebuild"] and rt.recoveries == 1
    assert processor.results == [(7, False), (9, True)]
    assert processor.faults == [("rebuild_process_groups: rank 2 could not create 0.ha1", 5,
                                 "train_step")]


def test_a_failed_rebuild_keeps_no_old_group_alive_through_its_exception_chain(monkeypatch):
    """The failed rebuild's error is raised ``from`` gloo's (``DistNetworkError`` in
    ``groups._create_like``, whose frame holds the old group) and the fault report keeps it:
    once the next plan runs, no frame of that chain may still hold the group (before: only
    the outer traceback was cleared; the next rebuild found the destroyed WORLD group alive
    and took the whole-heap walk, seconds of GIL beside CPU hogs, rank 2 silent 10 s)."""
    import gc
    import weakref

    class Group:  # stands for an old process group
        pass

    box = [Group()]
    old = weakref.ref(box[0])

    def create_like(group):  # groups._create_like: the group in its locals when gloo raises
        raise ConnectionError("Failed to recv, got 0 bytes")

    def rebuild(c):
        if c.plan.generation == 1:
            try:
                create_like(box.pop())
            except ConnectionError as exc:
                raise RuntimeError("rebuild_process_groups: rank 2 could not create 0.ha1") from exc

    monkeypatch.setitem(stages.IN_PLACE, "rollback", (("rebuild", rebuild),))
    processor = _Processor(_action(9, generation=2, store="127.0.0.1:29999"))
    kept, report = [], processor.report_fault
    processor.report_fault = lambda exc, *a, **k: (kept.append(exc), report(exc, *a, **k))[1]
    _runtime(processor).recover(_action(7))
    gc.collect()
    assert processor.results == [(7, False), (9, True)] and isinstance(kept[0].__cause__, ConnectionError)
    assert old() is None, gc.get_referrers(old())


def test_a_failed_repair_of_a_uce_is_reported_as_the_damage_still_there(monkeypatch):
    """Issue 21 item 8: rank 2's UCE is to be repaired from its replica, but the rebuild
    fails (the controller's node, with the store and the replica, is lost). The failure is
    reported as the UCE it still is (UnrepairedDamage, classified UCE, from the failure),
    so the successor's plan never takes this rank's state as a source (before: reported as
    a network fault, and the successor's rejoin plan copied the damaged parameters to the
    restarted ranks: exit 0, wrong losses). Once a recovery succeeds, the damage is gone."""
    from mindspeed_ha.errors import UnrepairedDamage
    from mindspeed_ha.faults import FaultKind, classify

    ran = []
    monkeypatch.setitem(stages.IN_PLACE, "rollback", (("rebuild", _store_lost_at_generation_1(ran)),))
    processor = _Processor(_action(7), _action(9, generation=2, store="127.0.0.1:29999"))
    kinds = []
    report = processor.report_fault
    processor.report_fault = lambda exc, *a, **k: (kinds.append(classify(exc)), report(exc, *a, **k))[1]
    rt = _runtime(processor)
    rt.rank = 2
    action = rt.handle_fault(RuntimeError("CUDA error: uncorrectable ECC error encountered"))
    assert rt.unrepaired is not None and "UCE in iteration 5" in rt.unrepaired
    rt.recover(action)
    assert ran == [1, 2] and processor.results == [(7, False), (9, True)]
    assert kinds == [FaultKind.UCE, FaultKind.UCE], kinds
    assert "rank 2: the UCE in iteration 5" in processor.faults[1][0] and "not repaired" in processor.faults[1][0]
    assert "could not create 0.ha1" in processor.faults[1][0]
    assert rt.unrepaired is None  # the second plan's recovery succeeded
    # the answer is not a RETRY: the raised failure is the damage, from the rebuild's error
    ran.clear()
    processor = _Processor(_action(7), _action(11, kind="exit"))
    rt = _runtime(processor)
    rt.handle_fault(RuntimeError("CUDA error: uncorrectable ECC error encountered"))
    with pytest.raises(UnrepairedDamage, match="not repaired: the recovery failed") as failure:
        rt.recover(_action(7))
    assert "could not create 0.ha1" in str(failure.value.__cause__)


def test_a_failed_recovery_follows_an_exit_and_is_reported_once(monkeypatch):
    """Any answer but a RETRY (the dying checkpoint's EXIT, which normally ends the process
    first): the failure is raised; an outer guard that sees it gets the same answer without
    a second report."""
    ran = []
    monkeypatch.setitem(stages.IN_PLACE, "rollback", (("rebuild", _store_lost_at_generation_1(ran)),))
    exit_action = _action(11, kind="exit")
    processor = _Processor(exit_action)
    rt = _runtime(processor)
    with pytest.raises(RuntimeError, match="could not create 0.ha1") as failure:
        rt.recover(_action(7))
    assert ran == [1] and processor.results == [(7, False)] and len(processor.faults) == 1
    assert rt.handle_fault(failure.value, where="train") is exit_action and len(processor.faults) == 1


def test_a_failed_roll_forward_inside_the_update_follows_only_a_roll_forward(monkeypatch):
    """Inside the optimizer update (the bracket recovers from there, while handling the
    update's fault): the failure is news though raised during a reported fault; a RETRY of
    another mode is not carried out there but raised with the failure (the train_step
    wrapper gets that action)."""
    ran = []
    monkeypatch.setitem(stages.IN_PLACE, "forward", (("rebuild", _store_lost_at_generation_1(ran)),))
    rollback = _action(9, generation=2)
    processor = _Processor(_action(8, mode="forward"), rollback)
    rt = _runtime(processor)
    try:
        raise RuntimeError("uncorrectable ECC error")
    except RuntimeError as fault:
        action = rt.handle_fault(fault, where="update")
        with pytest.raises(RuntimeError, match="could not create") as failure:
            rt.recover(action, where="update", modes=("forward",))
    assert [w for _, _, w in processor.faults] == ["update", "update"] and ran == [1]
    assert rt.handle_fault(failure.value) is rollback


def test_a_failed_rejoin_rejoins_again_with_the_controller_s_next_plan(monkeypatch):
    """A restarted process (ARF) whose rejoin failed reports it and rejoins with the next plan."""
    ran = []
    monkeypatch.setitem(stages.REJOINING, "rejoin", (("rebuild", _store_lost_at_generation_1(ran)),))
    rejoin = {"mode": "rejoin", "rejoin": (2,), "repairs": {2: 0}}
    processor = _Processor(_action(7, **rejoin), _action(9, generation=2, **rejoin))
    rt = _runtime(processor)
    rt.rank = 2
    rt.rejoin_after_setup(model=None, optimizer=None, opt_param_scheduler=None)
    assert ran == [1, 2] and processor.results == [(7, False), (9, True)] and rt.recoveries == 1
    assert [w for _, _, w in processor.faults] == ["rejoin", "rejoin"]


def test_a_skipped_update_is_reported_as_an_update_that_changed_nothing():
    """fp16: an iteration whose inf/nan check skips the update never enters the update
    bracket; the runtime reports UPDATING(k) then UPDATED(k) at its end (UPDATED(k-1) ->
    UPDATED(k) directly is an illegal move that stopped every fp16 run at iteration 1)."""
    from mindspeed_ha.control.state import OptimizerStatus, RankState

    class Status:
        def __init__(self):
            self.state = RankState(0, OptimizerStatus.UPDATED, 0)

        def begin_update(self, k):
            self.state.transition(OptimizerStatus.UPDATING, k)

        def end_update(self, k):
            self.state.transition(OptimizerStatus.UPDATED, k)

    rt = _runtime(Status())
    rt.completed, rt.current = 0, 1
    rt.take_snapshot(0)
    rt.iteration_done()  # train_step returned without an update
    assert rt.processor.state.snapshot() == (OptimizerStatus.UPDATED, 1) and rt.snapshot.iteration == 1
