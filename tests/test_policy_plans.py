"""The policy's typed plans: str Enums that are their wire strings, params derived from
the plan, and one decide function per job phase."""

import json

import msgpack
import pytest

from mindspeed_ha.control.policy import (PHASES, ActionKind, Decision, DrainPlan, ExitPlan, RecoveryMode,
                                         RecoveryPlan, StopPlan, VerifyPlan)
from mindspeed_ha.control.state import IN_STEP, Phase, StepPosition
from mindspeed_ha.faults import FaultKind


@pytest.mark.parametrize("member", [*RecoveryMode, *StepPosition])
def test_wire_enums_are_their_strings(member):
    assert member == member.value and f"{member}" == str(member) == "%s" % member == member.value
    assert msgpack.packb(member) == msgpack.packb(member.value)
    assert json.dumps({"m": member}) == json.dumps({"m": member.value})


def test_recovery_plan_mode_is_an_enum_and_its_params_plain_strings():
    plan = RecoveryPlan(5, 1, FaultKind.UCE, 0, {1: 0}, "why", mode="forward")
    assert plan.mode is RecoveryMode.FORWARD
    params = plan.to_params()
    assert type(params["mode"]) is str and params["mode"] == "forward"
    assert RecoveryPlan.from_params(params) == plan
    with pytest.raises(ValueError, match="mode must be one of"):
        RecoveryPlan(5, 1, FaultKind.UCE, 0, mode="sideways")


def test_step_positions_in_a_step():
    assert IN_STEP == {"", "train_step", "update", "update_done"} and "rejoin" not in IN_STEP


@pytest.mark.parametrize("plan, params", [
    (StopPlan(2, FaultKind.NETWORK, 1.5), {"rank": 2, "kind": "network", "at": 1.5}),
    (StopPlan(2, FaultKind.UCE, 1.5, in_place=True), {"rank": 2, "kind": "uce", "at": 1.5, "in_place": True}),
    (StopPlan(-1, FaultKind.UNKNOWN, 3.0, recover=True), {"rank": -1, "kind": "unknown", "at": 3.0, "recover": True}),
    (StopPlan(graceful=True), {"graceful": True}),
    (DrainPlan(-1), {"until": -1}),
    (ExitPlan(76, "no data"), {"code": 76, "reason": "no data"}),
    (VerifyPlan(((1, "silent"),)), {"unavailable": [[1, "silent"]]}),
])
def test_decision_params_are_the_plans_wire_form(plan, params):
    d = Decision(ActionKind.NOOP, "r", plan)
    assert d.params == params and d.params is not d.params  # a fresh dict each time
    assert Decision(ActionKind.NOOP, "r").params == {}


def test_every_phase_has_a_decide_function():
    assert set(PHASES) == set(Phase)
