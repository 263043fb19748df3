"""The dying checkpoint the ranks plan themselves when the controller is lost. Pure.

Every rank runs :func:`~.drain.agree_pause`, then :func:`plan_without_controller` on the
statuses all ranks exchanged (over a process group made for this at start-up), so every
rank gets the same plan without anyone deciding for the others.
"""

from __future__ import annotations

from typing import Mapping, Optional, Tuple, Union

from mindspeed_ha.control.policy.dying import DumpPlan, NoCompleteData, select_dying_checkpoint
from mindspeed_ha.control.policy.save import NOTHING_COMPLETED
from mindspeed_ha.control.state import RankInfo
from mindspeed_ha.faults import EXIT_CONTROLLER_LOST, EXIT_FAULT_UNRECOVERABLE, EXIT_NO_COMPLETE_DATA


def plan_without_controller(ranks: Mapping[int, RankInfo], save_dir: Optional[str], world_size: int,
                            verified: bool = False) -> Union[DumpPlan, Tuple[int, str]]:
    """The dying checkpoint the ranks write themselves when the controller is lost.

    Every rank must be there: the exchange is a collective, and without a controller
    nothing else can say which ranks are gone.

    Args:
        ranks: rank -> RankInfo (layout, status, iteration; ``stopped`` set for ranks
            paused at the agreed iteration; ``integrity`` when it verified).
        save_dir: ``--save`` (None: nothing can be written).
        world_size: ranks in the job.
        verified: apply the integrity rule (every rank that can verify sent a report).

    Returns:
        The DumpPlan, or ``(exit code, reason)``: 77 without ``--save``; 78 when a rank is
        missing; 76 when no complete data or no iteration completed.
    """
    if not save_dir:
        return EXIT_FAULT_UNRECOVERABLE, "no --save directory: a checkpoint cannot be written; nothing written"
    missing = sorted(set(range(world_size)) - set(ranks))
    if missing:
        return EXIT_CONTROLLER_LOST, f"ranks {missing} did not take part; nothing written"
    choice = select_dying_checkpoint(ranks, None, verified=verified)
    if isinstance(choice, NoCompleteData):
        return EXIT_NO_COMPLETE_DATA, choice.reason + "; nothing written"
    if choice.iteration == 0:
        return EXIT_NO_COMPLETE_DATA, NOTHING_COMPLETED
    return choice


__all__ = ["plan_without_controller"]
