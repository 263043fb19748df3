"""The rank's step protocol table (control/protocol.py), without sockets or threads."""

import threading

import pytest

from mindspeed_ha.control import wire
from mindspeed_ha.control.link import Outbox
from mindspeed_ha.control.protocol import STEP_MOVES, RecoveryHooks, StepProtocol, StepState
from mindspeed_ha.errors import ProcessorExited


class Aborted(Exception):
    pass


def _proto(**hooks):
    cond = threading.Condition(threading.Lock())
    p = StepProtocol(3, cond, Outbox(cond), freeze_deadline_s=5.0, iteration=4)
    calls = []
    p.hooks = RecoveryHooks(abort=lambda why: calls.append(("abort", why)), aborted=Aborted,
                            use_store=lambda ep: calls.append(("store", ep)))
    return p, calls


def _queued(p):
    out = []
    with p.cond:
        while True:
            body = p.outbox.pop_locked()
            if body is None:
                return out
            out.append(body)


def test_the_table_names_every_state_and_exited_is_terminal():
    assert set(STEP_MOVES) == set(StepState)
    assert STEP_MOVES[StepState.EXITED] == {StepState.EXITED}
    for state, moves in STEP_MOVES.items():
        assert state in moves  # a repeated message is no move
        if state is not StepState.EXITED:
            assert StepState.EXITED in moves


def test_an_illegal_move_is_logged_and_rejected(caplog):
    p, _ = _proto()
    with p.cond:
        assert p.transition(StepState.FROZEN)
        assert not p.transition(StepState.OBSERVED)
    assert p.state is StepState.FROZEN
    assert "illegal step protocol move frozen -> observed" in caplog.text


def test_a_stop_never_lowers_the_hold_and_retry_ends_it():
    p, calls = _proto()
    p.on_stop(wire.Stop("fault", recover=False, freeze=True))
    p.on_stop(wire.Stop("in place", recover=False, freeze=False))
    assert p.state is StepState.FROZEN and p.stop_event.is_set()
    assert [type(b).__name__ for b in _queued(p)] == ["Stopped", "Stopped"]
    with p.cond:
        p.deliver_locked(wire.Action(7, "retry", {}))
    assert p.state is StepState.RUNNING and not p.stop_event.is_set() and p.stop_received_at is None
    assert calls == []


def test_stop_recover_aborts_through_the_hook_and_the_step_raises_until_retry():
    p, calls = _proto()
    p.on_stop(wire.Stop("uce", recover=True))
    assert p.state is StepState.RECOVERING and calls == [("abort", "uce")]
    with pytest.raises(Aborted, match="step aborted for in-place recovery"):
        p.begin_update(5)
    with pytest.raises(Aborted):
        p.pause_point(4, lost=False)
    with p.cond:
        p.deliver_locked(wire.Action(8, "retry", {}))
    p.begin_update(5)
    p.end_update(5)
    assert p.status()[1] == 5


def test_drain_sets_the_limit_and_a_later_retry_keeps_draining():
    p, _ = _proto()
    p.on_drain(wire.Drain("sigterm", -1))
    assert p.state is StepState.DRAINING and p.limit == 5
    assert isinstance(_queued(p)[0], wire.Draining)
    p.on_stop(wire.Stop("fault"))
    with p.cond:
        p.deliver_locked(wire.Action(9, "retry", {}))
    assert p.state is StepState.DRAINING


def test_exited_ends_a_paused_training_thread():
    p, _ = _proto()
    p.on_drain(wire.Drain("sigterm", 4))
    done = {}

    def pause():
        try:
            p.pause_point(4, lost=False)
        except ProcessorExited as exc:
            done["exc"] = exc

    t = threading.Thread(target=pause)
    t.start()
    with p.cond:
        while p.paused_at is None:
            p.cond.wait(5)
        assert p.frozen
        p.end_locked(75, "committed")
        p.exit_returned = True
        p.cond.notify_all()
    t.join(5)
    assert "job ended (committed)" in str(done["exc"]) and p.state is StepState.EXITED
    with p.cond:
        assert not p.transition(StepState.RUNNING)
