"""Phase 3 of the dying checkpoint, and the clean-up of a failed one; the same for every format.

:func:`commit` (one rank): the savers' parts merged by the format, the staged
``iter_XXXXXXX`` validated, fsynced, renamed into ``<save>``, then
``latest_checkpointed_iteration.txt`` updated (temp + fsync + rename). Until then a
loader cannot see anything: the staging dir starts with a dot and the tracker still
points at the previous checkpoint.

:func:`discard` (every rank that took part, from the runtime's exit handler): the
staging dir of a failed dying checkpoint removed; the tracker is never touched.
``MINDSPEED_HA_KEEP_FAILED_STAGING=1`` keeps the staging dir for inspection.

No collectives.
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

from mindspeed_ha import env as ha_env
from mindspeed_ha.checkpoint import leftovers
from mindspeed_ha.checkpoint.formats import checkpoint_format, get_format
from mindspeed_ha.checkpoint.state import staging_root
from mindspeed_ha.checkpoint.steps import Steps, gc_paused
from mindspeed_ha.integrations import megatron_lm as mlm

#: set to "1" to keep the staging directory of a failed dying checkpoint (debugging)
ENV_KEEP_FAILED_STAGING = ha_env.KEEP_FAILED_STAGING


def run_format(ckpt_format: Optional[str]) -> str:
    """``ckpt_format``, or when None the ``--ckpt-format`` of Megatron-LM's global args
    (``torch`` without Megatron-LM's training loop: the built-in trainer writes only that)."""
    return ckpt_format or checkpoint_format(mlm.current_args())


def commit(save_dir: str, iteration: int, ckpt_format: Optional[str] = None) -> str:
    """Phase 3 on one rank: merge, validate, rename into ``save_dir``, update the tracker.

    An ``iter_XXXXXXX`` of ``iteration`` that the tracker names (a regular save that
    completed) is kept instead. One the tracker does not name was left by a regular save
    the fault interrupted: it is never published; it is moved aside and deleted once this
    checkpoint is published (:mod:`mindspeed_ha.checkpoint.leftovers`; a later-iteration
    one too, unless it validates).

    Args:
        ckpt_format: the run's ``--ckpt-format`` (None: :func:`run_format`).

    Returns:
        The published directory, with the seconds of each step.

    Raises:
        CheckpointError, OSError: nothing was published: a staged directory already renamed
            to ``iter_XXXXXXX`` is moved back into the staging dir (for :func:`discard`)
            unless the tracker already names it; the tracker is untouched.
        ConfigError: an unknown ``ckpt_format``.
    """
    fmt = get_format(run_format(ckpt_format))
    root = staging_root(save_dir, iteration)
    staged = mlm.get_checkpoint_name(root, iteration, return_base_dir=True)
    final = mlm.get_checkpoint_name(save_dir, iteration, return_base_dir=True)
    # A regular save interrupted by the fault left an unpublished (maybe half-written)
    # iter_XXXXXXX: never published, moved aside, deleted once this one is published.
    aside = leftovers.set_aside(save_dir, iteration, fmt.validate)
    if os.path.isdir(final):
        # A periodic save of the same iteration already published it (the tracker names it): keep it.
        fmt.validate(final, iteration)
        shutil.rmtree(root, ignore_errors=True)
        leftovers.remove(aside)
        return f"{final} (already saved by a periodic checkpoint)"
    steps = Steps()
    try:
        with gc_paused():  # validation unpickles; a full collection here cost 0.2 s (measured)
            fmt.merge(save_dir, iteration, staged, steps)
            with steps("publish"):
                fmt.commit(staged, save_dir, iteration)
    except BaseException:
        renamed = os.path.isdir(final) and not os.path.exists(staged)
        if renamed and mlm.read_tracker_iteration(save_dir) != iteration:
            os.rename(final, staged)  # not published: a loader never sees a half-committed dir
        raise
    with steps("cleanup"):
        shutil.rmtree(root, ignore_errors=True)
        leftovers.remove(aside)
    return f"{final} [{steps}]"


def discard(save_dir: str, iteration: int) -> str:
    """Remove the staging dir of a failed dying checkpoint; never touches the tracker.

    Kept instead when ``MINDSPEED_HA_KEEP_FAILED_STAGING=1`` (to inspect what was written).
    Idempotent and safe to run on several ranks at once. Returns what was done.
    """
    root = staging_root(save_dir, iteration)
    leftovers.sweep(save_dir)  # what a failed commit moved aside: never a checkpoint to keep
    if os.environ.get(ENV_KEEP_FAILED_STAGING) == "1":
        return f"kept {root} ({ENV_KEEP_FAILED_STAGING}=1)"
    # Move it away (atomic) before deleting: a commit still running elsewhere (the
    # controller timed it out) has then either renamed its complete, validated
    # iter_XXXXXXX out already or fails on that rename; it never publishes a directory
    # that is being emptied. A saver still writing recreates ``root``, and removes it on
    # its own EXIT after its last write.
    trash = f"{root}.discard.{os.getpid()}"
    try:
        os.rename(root, trash)
    except FileNotFoundError:
        return f"{root}: already removed"
    shutil.rmtree(trash, ignore_errors=True)
    return f"removed {root}"
