"""Phase 3 of the dying checkpoint, and the clean-up of a failed one; the same for every format.

:func:`commit` (one rank): the savers' parts merged by the format, the staged
``iter_XXXXXXX`` validated (then marked so: :func:`mindspeed_ha.checkpoint.staging.mark_validated`),
fsynced, renamed into ``<save>``, then ``latest_checkpointed_iteration.txt`` updated
(temp + fsync + rename). Until then a loader cannot see anything: the staging dir starts
with a dot and the tracker still points at the previous checkpoint. Directories the
tracker does not name are handled by :mod:`.leftovers` (never deleted).

:func:`discard` (every rank that took part, from the runtime's exit handler): the
staging dir of a failed dying checkpoint removed, unless its checkpoint validated (then
it is kept and the command that publishes it is logged); the tracker is never touched.
``MINDSPEED_HA_KEEP_FAILED_STAGING=1`` keeps the staging dir for inspection.

No collectives.
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional

from mindspeed_ha import env as ha_env
from mindspeed_ha.checkpoint import leftovers, staging
from mindspeed_ha.checkpoint.formats import checkpoint_format, get_format
from mindspeed_ha.checkpoint.staging import staging_root
from mindspeed_ha.checkpoint.steps import Steps, gc_paused
from mindspeed_ha.errors import CheckpointError
from mindspeed_ha.integrations import megatron_lm as mlm

log = logging.getLogger("mindspeed_ha.checkpoint.commit")

#: set to "1" to keep the staging directory of a failed dying checkpoint (debugging)
ENV_KEEP_FAILED_STAGING = ha_env.KEEP_FAILED_STAGING


def run_format(ckpt_format: Optional[str]) -> str:
    """``ckpt_format``, or when None the ``--ckpt-format`` of Megatron-LM's global args
    (``torch`` without Megatron-LM's training loop: the built-in trainer writes only that)."""
    return ckpt_format or checkpoint_format(mlm.current_args())


def commit(save_dir: str, iteration: int, ckpt_format: Optional[str] = None) -> str:
    """Phase 3 on one rank: merge, validate, rename into ``save_dir``, update the tracker.

    What is already in ``save_dir`` under the name ``iter_XXXXXXX``:

    * the tracker names ``iteration`` (a regular save of it completed): kept, this one dropped;
    * not named, and it validates (a regular save whose tracker update was lost):
      published as it is (tracker updated), this one dropped;
    * not named and not valid (interrupted, or unreadable to us): moved aside, this one
      published in its place. Later unpublished iterations are moved aside too
      (:mod:`.leftovers`: never deleted, put back if the commit fails).

    Args:
        ckpt_format: the run's ``--ckpt-format`` (None: :func:`run_format`).

    Returns:
        The published directory, with the seconds of each step.

    Raises:
        CheckpointError, OSError: nothing was published: a staged directory already
            renamed to ``iter_XXXXXXX`` is moved back into the staging dir unless the
            tracker already names it; what was moved aside is put back; the tracker is
            untouched. A staging copy that validated is kept (:func:`discard` keeps it)
            and the command that publishes it is logged.
        ConfigError: an unknown ``ckpt_format``.
    """
    fmt = get_format(run_format(ckpt_format))
    root = staging_root(save_dir, iteration)
    staged = mlm.get_checkpoint_name(root, iteration, return_base_dir=True)
    final = mlm.get_checkpoint_name(save_dir, iteration, return_base_dir=True)
    if os.path.isdir(final) and mlm.read_tracker_iteration(save_dir) == iteration:
        fmt.validate(final, iteration)  # published by a regular save: keep it
        staging.remove(root)  # ours, and the same iteration is published
        return f"{final} (already saved by a periodic checkpoint)"
    moved: List[leftovers.Aside] = []
    steps = Steps()
    validated = []
    try:
        leftovers.set_aside(save_dir, iteration, moved)
        if os.path.isdir(final) and not os.path.islink(final):
            try:
                with steps("validate_regular"):
                    fmt.validate(final, iteration)
            except (CheckpointError, OSError) as exc:
                aside = leftovers.move_aside(save_dir, final, iteration,
                                             f"regular save of {iteration} not in the tracker and not valid ({exc})")
                moved += [aside] if aside is not None else []
            else:
                mlm.write_tracker(save_dir, iteration)
                log.warning("%s: complete regular save of %d whose tracker update was lost: published", final,
                            iteration)
                staging.remove(root)  # ours, and the same iteration is published
                return f"{final} (a complete regular save of {iteration}: published) [{steps}]"

        def validate(path: str, it: int):
            names = fmt.validate(path, it)
            staging.mark_validated(root, it)
            validated.append(path)
            return names

        with gc_paused():  # a full collection here cost 0.2 s (measured)
            fmt.merge(save_dir, iteration, staged, steps)
            with steps("publish"):
                fmt.commit(staged, save_dir, iteration, validate=validate)
    except BaseException:
        renamed = os.path.isdir(final) and not os.path.exists(staged)
        if renamed and mlm.read_tracker_iteration(save_dir) != iteration:
            os.rename(final, staged)  # not published: a loader never sees a half-committed dir
        leftovers.put_back(moved)
        if validated and os.path.isdir(staged):
            log.error("dying checkpoint of iteration %d validated but not published; kept at %s. Publish it "
                      "with: %s", iteration, staged, staging.publish_command(save_dir, iteration))
        raise
    with steps("cleanup"):
        staging.remove(root)
    return f"{final} [{steps}]"


def discard(save_dir: str, iteration: int) -> str:
    """Remove the staging dir of a failed dying checkpoint; never touches the tracker.

    Kept instead when its checkpoint validated (the commit failed later: the command that
    publishes it is logged) or when ``MINDSPEED_HA_KEEP_FAILED_STAGING=1`` (to inspect
    what was written). Idempotent and safe to run on several ranks at once. Returns what
    was done.
    """
    root = staging_root(save_dir, iteration)
    if staging.is_validated(root):
        return (f"kept {root}: its checkpoint validated; publish it with: "
                f"{staging.publish_command(save_dir, iteration)}")
    if os.environ.get(ENV_KEEP_FAILED_STAGING) == "1":
        return f"kept {root} ({ENV_KEEP_FAILED_STAGING}=1)"
    # Moved away (atomic) before deleting: a commit still running elsewhere (the
    # controller timed it out) has then either renamed its complete, validated
    # iter_XXXXXXX out already or fails on that rename; it never publishes a directory
    # that is being emptied. A saver still writing recreates ``root``, and removes it on
    # its own EXIT after its last write.
    if not staging.remove(root):
        return f"{root}: already removed"
    return f"removed {root}"
