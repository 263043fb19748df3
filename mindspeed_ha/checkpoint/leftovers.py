"""Leftovers of an interrupted regular save: ``iter_XXXXXXX`` directories never published.

Megatron-LM core_v0.12.1 writes a regular checkpoint straight into its final directory
and publishes it afterwards (megatron/training/checkpointing.py ``save_checkpoint``):
``--ckpt-format torch`` ``torch.save``\\ s ``iter_XXXXXXX/mp_rank_*/...`` (and
``distrib_optim.pt``), ``torch_dist`` runs ``dist_checkpointing.save`` into
``iter_XXXXXXX/`` (``common.pt``, ``__*.distcp``, ``.metadata``, then ``metadata.json``);
then every rank meets at a barrier and only after it rank 0 writes
``latest_checkpointed_iteration.txt``. So a directory ``iter_X`` with ``X`` above the
tracker's iteration (or with no tracker at all) was never published: its save was
interrupted and it may be half-written. The stock loader reads the tracker and never
opens it, but

* a dying checkpoint of the same iteration needs the name: the half-written directory is
  moved aside (:func:`set_aside`, a hidden name no loader looks at), the dying checkpoint
  is published in its place, and then the moved directory is deleted (:func:`remove`);
* one of a later iteration is removed unless it validates (a complete save whose
  tracker update was lost is kept: it is ignored by the loader, never published by us);
* a set-aside directory left by a committer that died is removed by the next commit or
  discard (:func:`sweep`).

A save is complete once the tracker names it: then nothing here touches it.

No collectives; safe to run on several ranks at once (every removal renames first).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Callable, List, Optional, Tuple

from mindspeed_ha.errors import CheckpointError
from mindspeed_ha.integrations import megatron_lm as mlm

log = logging.getLogger("mindspeed_ha.recovery.leftovers")  # the name log lines have carried

#: prefix of a directory moved aside (hidden: Megatron-LM's loader never lists ``save_dir``)
ASIDE_PREFIX = ".mindspeed_ha_interrupted_"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


def _tracked(save_dir: str) -> Tuple[bool, Optional[int]]:
    """``(usable, iteration)``: usable is False when a tracker exists but names no iteration
    (``release`` or unreadable): then nothing is judged unpublished."""
    tracker = mlm.get_checkpoint_tracker_filename(save_dir)
    it = mlm.read_tracker_iteration(save_dir)
    return (it is not None or not os.path.exists(tracker)), it


def unpublished(save_dir: str, at_least: int = 0) -> List[Tuple[int, str]]:
    """``(iteration, path)`` of every ``iter_XXXXXXX`` in ``save_dir`` with iteration
    ``>= at_least`` that the tracker does not cover (iteration above the tracker's), sorted."""
    usable, tracked = _tracked(save_dir)
    if not usable or not os.path.isdir(save_dir):
        return []
    out = []
    for name in os.listdir(save_dir):
        m = _ITER_DIR.match(name)
        path = os.path.join(save_dir, name)
        if m and os.path.isdir(path):
            it = int(m.group(1))
            if it >= at_least and (tracked is None or it > tracked):
                out.append((it, path))
    return sorted(out)


def _move_aside(save_dir: str, path: str) -> Optional[str]:
    aside = os.path.join(save_dir, f"{ASIDE_PREFIX}{os.path.basename(path)}.{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another rank moved it first
        return None
    return aside


def set_aside(save_dir: str, iteration: int, validate: Callable[[str, int], object]) -> List[str]:
    """Before publishing the dying checkpoint of ``iteration``: move an unpublished
    ``iter_XXXXXXX`` of that iteration aside, and one of a later iteration too unless it
    validates (``validate(path, iteration)``, the run's checkpoint format's check: raises
    :class:`~mindspeed_ha.errors.CheckpointError` when incomplete). Returns the moved
    directories (for :func:`remove` once the dying checkpoint is published)."""
    moved = []
    for it, path in unpublished(save_dir, iteration):
        if it > iteration:
            try:
                validate(path, it)
                log.warning("%s: complete but never published (no tracker update); left as it is", path)
                continue
            except CheckpointError:
                pass
        aside = _move_aside(save_dir, path)
        if aside is not None:
            log.warning("%s: half-written regular save (its tracker update never happened): moved to %s",
                        path, aside)
            moved.append(aside)
    return moved


def remove(paths: List[str]) -> None:
    """Delete directories moved aside by :func:`set_aside`."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def sweep(save_dir: str) -> List[str]:
    """Delete every set-aside directory in ``save_dir`` (renamed first, so concurrent sweeps
    never delete the same files twice); returns what was removed."""
    if not os.path.isdir(save_dir):
        return []
    removed = []
    for name in sorted(os.listdir(save_dir)):
        if not name.startswith(ASIDE_PREFIX):
            continue
        path = os.path.join(save_dir, name)
        trash = f"{path}.sweep.{os.getpid()}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(path)
    return removed
