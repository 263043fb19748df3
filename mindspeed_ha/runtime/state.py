"""The recovery state of the step in progress: what the step protocol keeps for a
recovery, shared by the runtime, the recovery stages and the reload (public fields of one
record, instead of modules writing each other's private attributes)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple


@dataclasses.dataclass
class StepState:
    """Mutable, one per runtime (training thread only).

    Attributes:
        update_depth: nesting of the optimizer update bracket (0: not inside an update).
        entry_rng: the RNG state at the entry of the attempt in progress (a re-run after a
            rollback draws the same dropout masks).
        entry_timers: Megatron's timers running at the attempt's entry (the clean-up keeps them).
        entry_scalers: the grad scalers' state at the attempt's entry (fp16; the clean-up puts it back).
        rerun_state: Megatron's rerun state machine between iterations (None: not captured).
        replays: id of a wrapped data iterator -> (iterator, wrapper, its replay wrappers).
        reruns: reload: iterations the ``train_step`` wrapper re-runs silently before the step.
        rejoin_rng: ARF: the RNG a restarted process starts its first step with.
        catch_up: ARF roll forward: the progress' forward part, until the first step.
        catching_up: ... during that first step, the catch-up step (see ``enter_iteration``).
        catch_up_optimizer: the optimizer whose next ``step()`` the catch-up step answers
            (once; patches/optimizer.py), else None.
        resume_consumed: ARF reload: k's consumed samples, put back at the first step.
        rejoin_reload: a restarted process loaded a checkpoint (its re-runs rebuild k's RNG).
        kept_from: a restarted process's data iterators start after this checkpoint.
        just_recovered: the next completed iteration is the first after a recovery.
    """

    update_depth: int = 0
    entry_rng: Optional[dict] = None
    entry_timers: Tuple[str, ...] = ()
    entry_scalers: Optional[list] = None
    rerun_state: Optional[dict] = None
    replays: Dict[int, Tuple[Any, Any, list]] = dataclasses.field(default_factory=dict)
    reruns: List[int] = dataclasses.field(default_factory=list)
    rejoin_rng: Optional[dict] = None
    catch_up: Optional[dict] = None
    catching_up: Optional[dict] = None
    catch_up_optimizer: Any = None
    resume_consumed: Optional[int] = None
    rejoin_reload: bool = False
    kept_from: Optional[int] = None
    just_recovered: bool = False

    def replay_wrappers(self) -> list:
        """Every data iterator's replay wrappers (:class:`~mindspeed_ha.recovery.rollback.ReplayIterator`)."""
        return [r for _, _, replays in self.replays.values() for r in replays]

    def capture_rerun_machine(self) -> None:
        """Remember Megatron's rerun state machine as it is now (between iterations)."""
        try:
            from mindspeed_ha.recovery.rollback import capture_rerun_machine

            self.rerun_state = capture_rerun_machine()
        except ImportError:  # a megatron-core without the rerun state machine
            self.rerun_state = None
