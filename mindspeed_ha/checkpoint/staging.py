"""The dying checkpoint's staging directory: whose it is, whether it validated, and its end.

``<save>/.mindspeed_ha_dying_iter_XXXXXXX/`` (hidden: Megatron-LM's loader reads the
tracker and never lists ``<save>``) holds what the savers write. Two marker files:

* ``.mindspeed_ha_owner`` (:func:`create`, before the first write): written by
  mindspeed-ha for that iteration. With our name it makes the directory *provably ours*.
* ``.mindspeed_ha_validated`` (:func:`mark_validated`, by the committer once the staged
  ``iter_XXXXXXX`` validated): a complete checkpoint. It is never deleted by us; a
  failed commit leaves it there and logs the one command that publishes it
  (:func:`publish_command`, :mod:`mindspeed_ha.checkpoint.publish`).

At start-up (:func:`sweep_stale`, rank 0): a staging dir of ours that never validated
(a save killed half-way) is deleted; a validated one is kept and its publish command
logged again; one with our name but no owner marker (not provably ours) is moved aside.
Each with a log line.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import socket
import sys
import time
from typing import List, Optional

from mindspeed_ha.checkpoint import files
from mindspeed_ha.errors import CheckpointError

log = logging.getLogger("mindspeed_ha.checkpoint.staging")

PREFIX = ".mindspeed_ha_dying_iter_"
OWNER_FILE = ".mindspeed_ha_owner"
VALIDATED_FILE = ".mindspeed_ha_validated"
#: prefix of a staging-like directory that is not provably ours, moved aside at start-up
UNKNOWN_PREFIX = ".mindspeed_ha_unknown_"
_NAME = re.compile(r"^\.mindspeed_ha_dying_iter_(\d{7})(\.discard\.[0-9a-f.]+)?$")
_TOOL = "mindspeed-ha"


def staging_root(save_dir: str, iteration: int) -> str:
    """Hidden staging directory for the dying checkpoint of ``iteration`` (same filesystem as ``save_dir``)."""
    return os.path.join(save_dir, f"{PREFIX}{iteration:07d}")


def _read_marker(root: str, name: str) -> Optional[dict]:
    try:
        fd = os.open(os.path.join(root, name), os.O_RDONLY | files.NOFOLLOW)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read(4096))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("tool") == _TOOL else None


def _write_marker(root: str, name: str, doc: dict) -> None:
    try:
        fd = files.create_new(os.path.join(root, name))
    except FileExistsError:
        return  # another saver of the same save wrote it
    with os.fdopen(fd, "w") as f:
        json.dump({"tool": _TOOL, **doc}, f)
        f.flush()
        os.fsync(f.fileno())


def create(save_dir: str, iteration: int) -> str:
    """The staging dir of ``iteration``, created (mode ``0o777`` less the umask) with its
    owner marker unless there already (several savers call this at once). Returns it.

    Raises:
        CheckpointError: the name is taken by something else than a directory (a link).
    """
    root = staging_root(save_dir, iteration)
    os.makedirs(save_dir, exist_ok=True)
    try:
        os.mkdir(root)
    except FileExistsError:
        if os.path.islink(root) or not os.path.isdir(root):
            raise CheckpointError(f"{root}: exists and is not a directory; refusing to write through it") from None
    _write_marker(root, OWNER_FILE, {"iteration": iteration, "host": socket.gethostname(), "pid": os.getpid(),
                                     "created": time.time()})
    return root


def iteration_of(root: str) -> Optional[int]:
    """The iteration in a staging dir's name (a moved ``.discard.`` one too), else None."""
    m = _NAME.match(os.path.basename(root))
    return int(m.group(1)) if m else None


def is_ours(root: str) -> bool:
    """Our name, a real directory (not a link), and our owner marker for that iteration."""
    it = iteration_of(root)
    if it is None or os.path.islink(root) or not os.path.isdir(root):
        return False
    doc = _read_marker(root, OWNER_FILE)
    return doc is not None and doc.get("iteration") == it


def mark_validated(root: str, iteration: int) -> None:
    """Record that the staged ``iter_XXXXXXX`` of ``iteration`` validated (fsynced)."""
    _write_marker(root, VALIDATED_FILE, {"iteration": iteration, "validated": time.time()})
    files.fsync_dir(root)


def is_validated(root: str) -> bool:
    doc = _read_marker(root, VALIDATED_FILE) if is_ours(root) else None
    return doc is not None and doc.get("iteration") == iteration_of(root)


def publish_command(save_dir: str, iteration: int) -> str:
    """The command that publishes a validated staging copy (:mod:`mindspeed_ha.checkpoint.publish`)."""
    return (f"{shlex.quote(sys.executable)} -m mindspeed_ha.checkpoint.publish "
            f"{shlex.quote(os.path.abspath(save_dir))} {iteration}")


def remove(root: str) -> bool:
    """Delete a staging dir: renamed away first (atomic), then removed, so a commit still
    running elsewhere never publishes a directory being emptied and concurrent removals
    never delete the same files twice. Returns False when it was already gone."""
    moved = ".discard." in os.path.basename(root)
    trash = root if moved else f"{root}.discard.{os.getpid()}.{time.time_ns():x}"
    if trash != root:
        try:
            os.rename(root, trash)
        except FileNotFoundError:
            return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def sweep_stale(save_dir: str, keep_failed: bool = False) -> List[str]:
    """At start-up, before any save of this run: what killed dying checkpoints left in
    ``save_dir`` (see the module). ``keep_failed``: ours are kept too (debugging).
    Returns one line per directory handled (each also logged)."""
    if not os.path.isdir(save_dir):
        return []
    out = []
    for name in sorted(os.listdir(save_dir)):
        root = os.path.join(save_dir, name)
        it = iteration_of(root)
        if it is None:
            continue
        trash = ".discard." in name  # renamed for removal (a published or failed save's), never kept
        if not trash and is_validated(root):
            line = (f"{root}: validated dying checkpoint of iteration {it}, never published; kept. "
                    f"Publish it with: {publish_command(save_dir, it)}")
        elif is_ours(root):
            if keep_failed and not trash:
                line = f"{root}: staging of a failed dying checkpoint kept (keep-failed-staging)"
            else:
                remove(root)
                line = f"{root}: staging of a dying checkpoint that never validated (a killed save): removed"
        else:
            aside = os.path.join(save_dir, f"{UNKNOWN_PREFIX}{name}.{os.getpid()}.{time.time_ns():x}")
            try:
                os.rename(root, aside)
            except FileNotFoundError:
                continue
            line = f"{root}: staging-like directory without our owner marker: not deleted, moved to {aside}"
        log.warning("%s", line)
        out.append(line)
    return out
