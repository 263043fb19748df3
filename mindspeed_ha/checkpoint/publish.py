"""Publish a dying checkpoint that validated but whose commit failed (a full disk, say).

    python -m mindspeed_ha.checkpoint.publish SAVE_DIR ITERATION

The failed commit kept ``SAVE_DIR/.mindspeed_ha_dying_iter_XXXXXXX/iter_XXXXXXX`` (marked
validated: :mod:`mindspeed_ha.checkpoint.staging`) and logged this command. It runs that
commit again (:func:`mindspeed_ha.checkpoint.commit.commit`, the format recognised from
the staged files): validation, fsync, rename to ``SAVE_DIR/iter_XXXXXXX``, the tracker
(temp + fsync + rename); what stands in the way is handled as the commit handles it
(a complete regular save of the iteration is published instead, anything else moved
aside, never deleted).

Exit status: 0 published; 1 it failed (what and why on stderr; nothing published);
2 bad arguments, or no validated copy of that iteration.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional


def publish(save_dir: str, iteration: int) -> str:
    """Publish the validated staging copy of ``iteration`` in ``save_dir`` as the dying
    checkpoint's commit would (:func:`mindspeed_ha.checkpoint.commit.commit`, its format
    recognised from the staged files: what is in the way is moved aside, never deleted).
    Returns what the commit says.

    Raises:
        FileNotFoundError: no validated staging copy of ``iteration``.
        CheckpointError, OSError: validation or a write failed (nothing published).
    """
    from mindspeed_ha.checkpoint import commit, formats, staging
    from mindspeed_ha.errors import CheckpointError
    from mindspeed_ha.integrations import megatron_lm as mlm

    root = staging.staging_root(save_dir, iteration)
    staged = mlm.get_checkpoint_name(root, iteration, return_base_dir=True)
    if not staging.is_validated(root) or not os.path.isdir(staged):
        raise FileNotFoundError(f"{root}: no validated dying checkpoint of iteration {iteration}")
    names = [n for n in formats.registered_formats() if formats.get_format(n).recognizes(staged)]
    if len(names) != 1:
        raise CheckpointError(f"{staged}: recognised by {names or 'no format'}")
    return commit.commit(save_dir, iteration, names[0])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mindspeed_ha.checkpoint.publish", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("save_dir", help="the run's --save directory")
    ap.add_argument("iteration", type=int, help="iteration of the kept dying checkpoint (>= 0)")
    ns = ap.parse_args(argv)
    if ns.iteration < 0 or not os.path.isdir(ns.save_dir):
        print(f"publish: {ns.save_dir!r} must be a directory and ITERATION >= 0 (got {ns.iteration})",
              file=sys.stderr)
        return 2
    try:
        final = publish(ns.save_dir, ns.iteration)
    except FileNotFoundError as exc:
        print(f"publish: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line, the status says it failed
        print(f"publish: failed, nothing published: {exc}", file=sys.stderr)
        return 1
    print(f"published {final}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
