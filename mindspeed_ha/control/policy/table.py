"""``decide``: the controller's next step, one function per job phase (:data:`PHASES`). Pure.

Every phase function has the signature ``(now, state, config, gone) -> Decision``;
``gone`` is :func:`~.detect.gone_ranks` of the same ``now``. The graceful stop's
preemption deadline is checked first in the phases it covers (STOPPING to ASSEMBLING).
"""

from __future__ import annotations

from typing import Callable, Dict, Mapping

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.policy.decision import Decision, noop
from mindspeed_ha.control.policy.detect import gone_ranks, running
from mindspeed_ha.control.policy.drain import draining, past_preemption_deadline
from mindspeed_ha.control.policy.pause import paused, pausing
from mindspeed_ha.control.policy.recovering import recovering
from mindspeed_ha.control.policy.save import exiting, saving, stopping, verifying
from mindspeed_ha.control.state import ClusterState, Phase

PhaseStep = Callable[[float, ClusterState, HAConfig, Mapping[int, str]], Decision]


def _done(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]) -> Decision:
    return noop("job done")


def _deadline_first(step: PhaseStep) -> PhaseStep:
    """``step``, unless a graceful stop's preemption deadline has passed (EXIT(77))."""
    def phase_step(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]) -> Decision:
        late = past_preemption_deadline(now, state, config)
        return late if late is not None else step(now, state, config, gone)
    phase_step.__name__ = step.__name__
    phase_step.__doc__ = step.__doc__
    return phase_step


#: job phase -> the function that decides in it
PHASES: Dict[Phase, PhaseStep] = {
    Phase.RUNNING: running,
    Phase.RECOVERING: recovering,
    Phase.DRAINING: draining,
    Phase.PAUSING: pausing,
    Phase.PAUSED: paused,
    Phase.STOPPING: _deadline_first(stopping),
    Phase.VERIFYING: _deadline_first(verifying),
    Phase.DUMPING: _deadline_first(saving),
    Phase.ASSEMBLING: _deadline_first(saving),
    Phase.COMMITTING: saving,
    Phase.EXITING: exiting,
    Phase.DONE: _done,
}


def decide(now: float, state: ClusterState, config: HAConfig) -> Decision:
    """The controller's next step. Pure: reads ``state`` and ``config`` only.

    Args:
        now: monotonic time, seconds (same clock as RankInfo.last_heartbeat).
        state: the cluster state (not mutated).
        config: the job's HAConfig.

    Returns:
        A Decision; NOOP with ``next_phase=None`` when nothing is to be done.
    """
    return PHASES[state.phase](now, state, config, gone_ranks(now, state, config))


__all__ = ["PHASES", "PhaseStep", "decide"]
