"""In-place recovery plan (re-export): the planner and its types live in
:mod:`mindspeed_ha.control.policy` (:mod:`~mindspeed_ha.control.policy.recovery` for
RecoveryPlan, RecoveryMode, NoRecovery and the rules; :mod:`~mindspeed_ha.control.policy.in_place`
for ``plan_recovery``; :mod:`~mindspeed_ha.control.policy.arf` for the worker-restart plan).
This module keeps the names importable where the rank runtime and the tests find them."""

from mindspeed_ha.control.policy.in_place import plan_recovery
from mindspeed_ha.control.policy.recovery import (IN_STEP, MODES, REJOIN, NoRecovery, RecoveryMode, RecoveryPlan,
                                                  consecutive_retries, in_place_possible)

__all__ = ["IN_STEP", "MODES", "REJOIN", "NoRecovery", "RecoveryMode", "RecoveryPlan", "consecutive_retries",
           "in_place_possible", "plan_recovery"]
