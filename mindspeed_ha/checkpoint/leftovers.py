"""``iter_XXXXXXX`` directories the tracker does not name: moved aside, never deleted.

Megatron-LM core_v0.12.1 writes a regular checkpoint straight into its final directory
and publishes it afterwards (megatron/training/checkpointing.py ``save_checkpoint``):
``--ckpt-format torch`` ``torch.save``\\ s ``iter_XXXXXXX/mp_rank_*/...`` (and
``distrib_optim.pt``), ``torch_dist`` runs ``dist_checkpointing.save`` into
``iter_XXXXXXX/`` (``common.pt``, ``__*.distcp``, ``.metadata``, then ``metadata.json``);
then every rank meets at a barrier and only after it rank 0 writes
``latest_checkpointed_iteration.txt``. So a directory ``iter_X`` with ``X`` above the
tracker's iteration (or with no tracker at all) was not published: its save was
interrupted (it may be half-written) or its tracker write was lost (it may be complete).
Such a directory is not ours (Megatron-LM wrote it) and we cannot always tell a partial
one from one we cannot read (a layout we do not know, EACCES, EIO), so none is ever
deleted here. When the dying checkpoint of ``k`` is committed
(:func:`mindspeed_ha.checkpoint.commit.commit`):

* one of iteration ``k`` that validates is published as it is (tracker updated); one
  that does not is moved aside (:func:`move_aside`) and the dying checkpoint takes its name;
* every one of a later iteration is moved aside (a resumed run saves those iterations
  again, and ``dist_checkpointing.save`` refuses a non-empty directory);
* if the commit fails, each is put back (:func:`put_back`).

A moved directory goes into a new hidden container ``<save>/.mindspeed_ha_interrupted_
iter_XXXXXXX.<unique>/`` (created exclusively, never reused) beside a record of the
commit that moved it. Every move and put-back is logged with both paths. At start-up
(:func:`at_start_up`): a container whose commit never published (the tracker is below
its iteration) is put back, the others are kept and logged (remove them by hand once
they are not needed).

No collectives; safe to run on several ranks at once (every move is one rename).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from dataclasses import dataclass
from typing import List, Optional, Tuple

from mindspeed_ha.checkpoint import files, staging
from mindspeed_ha.integrations import megatron_lm as mlm

log = logging.getLogger("mindspeed_ha.recovery.leftovers")  # the name log lines have carried

#: prefix of the container a directory is moved into (hidden: the loader never lists ``save_dir``)
ASIDE_PREFIX = ".mindspeed_ha_interrupted_"
RECORD_FILE = "moved.json"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


@dataclass(frozen=True)
class Aside:
    """A directory moved aside: ``<container>/<name>`` was ``<save_dir>/<name>``."""

    save_dir: str
    name: str
    container: str

    @property
    def path(self) -> str:
        return os.path.join(self.container, self.name)

    @property
    def original(self) -> str:
        return os.path.join(self.save_dir, self.name)


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
        if m and os.path.isdir(path) and not os.path.islink(path):
            it = int(m.group(1))
            if it >= at_least and (tracked is None or it > tracked):
                out.append((it, path))
    return sorted(out)


def _new_container(save_dir: str, name: str) -> str:
    """A new, empty directory ``ASIDE_PREFIX + name + .<pid>.<random>`` (``mkdir`` is exclusive)."""
    while True:
        container = os.path.join(save_dir, f"{ASIDE_PREFIX}{name}.{os.getpid()}.{secrets.token_hex(6)}")
        try:
            os.mkdir(container)
            return container
        except FileExistsError:
            continue


def move_aside(save_dir: str, path: str, commit_of: int, why: str) -> Optional[Aside]:
    """Move ``path`` (an ``iter_XXXXXXX`` of ``save_dir``) into a new container, with a
    record of the commit (of ``commit_of``) that moved it; logged with ``why``. Returns
    None when it was gone already (another rank moved it).

    Raises:
        OSError: the container or its record could not be created (nothing was moved).
    """
    name = os.path.basename(path)
    container = _new_container(save_dir, name)
    try:
        files.write_atomically(os.path.join(container, RECORD_FILE),
                               json.dumps({"name": name, "commit_of": commit_of}).encode())
        os.rename(path, os.path.join(container, name))
    except FileNotFoundError:
        _drop_container(container)
        return None
    except BaseException:
        _drop_container(container)
        raise
    aside = Aside(save_dir, name, container)
    log.warning("%s: %s: moved to %s (never deleted by mindspeed-ha)", path, why, aside.path)
    return aside


def _drop_container(container: str) -> None:
    """Remove an emptied container (ours: the record and nothing else)."""
    try:
        os.unlink(os.path.join(container, RECORD_FILE))
    except FileNotFoundError:
        pass
    try:
        os.rmdir(container)
    except OSError as exc:
        log.warning("%s: not removed (%s)", container, exc)


def set_aside(save_dir: str, iteration: int, moved: Optional[List[Aside]] = None) -> List[Aside]:
    """Before publishing the dying checkpoint of ``iteration``: every unpublished
    ``iter_XXXXXXX`` of a later iteration moved aside (see the module). Returns them
    (for :func:`put_back` if the commit fails), appended to ``moved`` when given (so a
    caller holds what was moved even when a later move raises)."""
    moved = [] if moved is None else moved
    for it, path in unpublished(save_dir, iteration + 1):
        aside = move_aside(save_dir, path, iteration,
                           f"iteration {it} above the dying checkpoint's {iteration}, not in the tracker")
        if aside is not None:
            moved.append(aside)
    return moved


def put_back(asides: List[Aside]) -> List[Aside]:
    """Move each directory back to its name (a failed commit); one whose name is taken
    again stays where it is (logged). Returns those left aside."""
    left = []
    for a in asides:
        if os.path.lexists(a.original):
            log.error("%s: name taken again; %s stays at %s", a.original, a.name, a.path)
            left.append(a)
            continue
        try:
            os.rename(a.path, a.original)
        except OSError as exc:
            log.error("%s: could not be put back to %s (%s)", a.path, a.original, exc)
            left.append(a)
            continue
        _drop_container(a.container)
        log.warning("%s: put back to %s (the commit failed)", a.path, a.original)
    return left


def containers(save_dir: str) -> List[Tuple[Aside, Optional[int]]]:
    """``(moved directory, iteration of the commit that moved it)`` for each container in
    ``save_dir`` with a readable record."""
    if not os.path.isdir(save_dir):
        return []
    out = []
    for entry in sorted(os.listdir(save_dir)):
        container = os.path.join(save_dir, entry)
        if not entry.startswith(ASIDE_PREFIX) or os.path.islink(container) or not os.path.isdir(container):
            continue
        try:
            with os.fdopen(os.open(os.path.join(container, RECORD_FILE), os.O_RDONLY | files.NOFOLLOW)) as f:
                rec = json.load(f)
            name = rec["name"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(name, str) and _ITER_DIR.match(name):
            out.append((Aside(save_dir, name, container), rec.get("commit_of")))
    return out


def at_start_up(save_dir: str, keep_failed_staging: bool = False) -> List[str]:
    """Start-up clean-up of ``save_dir`` (rank 0, before any save of this run): stale
    staging dirs (:func:`mindspeed_ha.checkpoint.staging.sweep_stale`), then each moved
    directory whose commit never published (the tracker names no iteration at or above
    the commit's) put back, the others kept. Returns the log lines."""
    lines = staging.sweep_stale(save_dir, keep_failed_staging)
    tracked = mlm.read_tracker_iteration(save_dir)
    for aside, commit_of in containers(save_dir):
        published = isinstance(commit_of, int) and tracked is not None and tracked >= commit_of
        if published or put_back([aside]):
            line = f"{aside.path}: moved aside by the dying checkpoint of {commit_of}; kept (remove it by hand)"
            log.warning("%s", line)
        else:
            line = f"{aside.path}: its dying checkpoint ({commit_of}) was never published: put back"
        lines.append(line)
    return lines
