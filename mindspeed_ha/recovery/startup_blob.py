"""The start-up record of a rank as stored: one msgpack blob, its store key, its lease copy.

:mod:`mindspeed_ha.recovery.rejoin` records a rank's start-up collectives (incarnation 0)
and replays them in a restarted process (incarnation >= 1). This module is where the
record lives between the two:

* format: ONE msgpack blob (:func:`encode`, no pickle): a header (``format``
  :data:`FORMAT`, ``version`` :data:`VERSION`, ``status`` ``ok`` / ``too_big`` /
  ``unsupported``, ``reason``, ``rank``, ``torch``) plus ``entries``, one per recorded op:
  ``{"index", "op", "group", "ranks", "site", "out": [[dtype, shape, bytes or None], ...]}``,
  and one ``{"op": "load_checkpoint", "returned": [iteration, flops], ...}`` (version 2) where
  the start-up's ``load_checkpoint`` ran (its collectives are not recorded:
  ``rejoin.load_section``); :func:`decode` refuses anything else, and a status other than ``ok``;
* where: the default store (torchrun's TCPStore, ``distributed_c10d._get_default_store()``)
  under :data:`KEY`; with controller failover (a lease directory on the shared filesystem,
  ``ha_env.LEASE_DIR``) also a file ``startup-rank<r>.msgpack`` there, read when the store
  has no record (torchrun's store lives in node 0's agent and dies with node 0);
* sealed: both copies carry an HMAC-SHA256 line keyed with the job's key
  (``MINDSPEED_HA_AUTH_KEY``) over the store key and the blob
  (:mod:`mindspeed_ha.control.sealed`). torchrun's store listens on every interface
  without authentication: a stranger can read a record (it holds start-up collective
  results, no key) and overwrite it, but a record that does not verify is refused with a
  :class:`RejoinError` saying so, never replayed.
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional, Tuple

from mindspeed_ha import env as ha_env
from mindspeed_ha.errors import RejoinError

log = logging.getLogger("mindspeed_ha.recovery.rejoin")

#: store key of a rank's start-up record (in the default store, under its ``default_pg`` prefix)
KEY = "mindspeed_ha/startup/{rank}"
#: blob format name and version (the header's ``format`` / ``version``)
FORMAT = "mindspeed_ha.startup"
VERSION = 2


def encode(header: dict, entries: List[dict]) -> bytes:
    """One msgpack blob: ``header`` (format, version, status, ...) + ``entries``.

    An entry is ``{"op", "group", "ranks", "out": [[dtype, shape, bytes], ...]}``.
    """
    import msgpack

    return msgpack.packb(dict(header, entries=entries), use_bin_type=True)


def decode(blob: bytes) -> dict:
    """The record in ``blob``.

    Raises:
        RejoinError: not a record of this format/version, or its status is not ``ok``
            (``too_big``, ``unsupported``).
    """
    import msgpack

    try:
        rec = msgpack.unpackb(blob, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - any decoding error means "not ours"
        raise RejoinError(f"rejoin: start-up record is not msgpack ({exc})") from exc
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise RejoinError("rejoin: start-up record has no mindspeed_ha.startup header")
    if rec.get("version") != VERSION:
        raise RejoinError(f"rejoin: start-up record version {rec.get('version')} (this build reads {VERSION})")
    if rec.get("status") != "ok":
        raise RejoinError(f"rejoin: the first incarnation's start-up record is {rec.get('status')!r}: "
                          f"{rec.get('reason')}; a rejoin cannot replay it")
    return rec


def header(status: str, reason: str) -> dict:
    """The blob header of this rank: ``status`` ``ok`` / ``too_big`` / ``unsupported``."""
    import torch

    return {"format": FORMAT, "version": VERSION, "status": status, "reason": reason,
            "rank": default_store_and_rank()[1], "torch": torch.__version__}


def default_store_and_rank() -> Tuple[object, int]:
    """The default group's store (torchrun's TCPStore) and this process's rank in the default group."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store(), c10d._world.default_pg.rank()


def _job_key() -> bytes:
    """The job's key (``MINDSPEED_HA_AUTH_KEY``, set on every rank by the runtime's start-up).

    Raises:
        RejoinError: unset or not hex.
    """
    from mindspeed_ha.config import auth_key_from
    from mindspeed_ha.errors import ConfigError

    try:
        key = auth_key_from(os.environ)
    except ConfigError as exc:
        raise RejoinError(f"rejoin: cannot seal or verify a start-up record: {exc}") from None
    if not key:
        raise RejoinError(f"rejoin: cannot seal or verify a start-up record without the job's key ({ha_env.AUTH_KEY})")
    return key


def save(blob: bytes) -> int:
    """Write this rank's ``blob``, sealed with the job's key, into the default store under
    :data:`KEY` (and its lease copy, see :func:`write_lease_copy`). Returns this rank.

    Raises:
        RuntimeError: the store write failed. RejoinError: no job key.
    """
    from mindspeed_ha.control import sealed

    default_store, rank = default_store_and_rank()
    key = KEY.format(rank=rank)
    default_store.set(key, sealed.seal(_job_key(), key, blob))
    write_lease_copy(rank, blob)
    return rank


def load(store=None, rank: Optional[int] = None) -> dict:
    """Read and decode rank ``rank``'s record from ``store`` (default: the default store).

    Raises:
        RejoinError: no record (the first incarnation died before its first train_step),
            or :func:`decode`'s errors.
    """
    if store is None or rank is None:
        s, r = default_store_and_rank()
        store = s if store is None else store
        rank = r if rank is None else rank
    from mindspeed_ha.control import sealed

    key = KEY.format(rank=rank)
    if not store.check([key]):
        blob = read_lease_copy(rank)
        if blob is not None:  # node 0 and torchrun's store with it were lost: the lease directory's copy
            return decode(blob)
        raise RejoinError(f"rejoin: no start-up record {key!r} in the store (the first incarnation of "
                          f"rank {rank} did not reach its first train_step); a rejoin is impossible")
    try:
        blob = sealed.unseal(_job_key(), key, bytes(store.get(key)))
    except sealed.SealError as exc:
        raise RejoinError(f"rejoin: the start-up record {key!r} in the store is refused: {exc}; a record "
                          f"not sealed with the job's key is never replayed: a rejoin of rank {rank} is impossible") from None
    return decode(blob)


_LEASE_COPY = "startup-rank{rank}.msgpack"


def _lease():
    """The job's lease directory (a ``LeaseDir``), or None without controller failover."""
    from mindspeed_ha.control.lease import LeaseDir

    base = os.environ.get(ha_env.LEASE_DIR)
    return LeaseDir(base, _job_key()) if base else None


def write_lease_copy(rank: int, blob: bytes) -> None:
    """With controller failover (a lease directory on the shared filesystem), a sealed copy
    of the record there: torchrun's store lives in node 0's agent and dies with node 0.
    Best effort: an OSError is logged, not raised."""
    lease = _lease()
    if lease is None:
        return
    try:
        lease.write_blob(_LEASE_COPY.format(rank=rank), blob)
    except OSError as exc:  # best effort: only a rejoin after node 0's loss needs it
        log.warning("rejoin: cannot keep rank %d's start-up record in %s: %s", rank, lease.path, exc)


def read_lease_copy(rank: int) -> Optional[bytes]:
    """The lease directory's copy of rank ``rank``'s record, or None (no lease directory,
    no copy, or one that is not sealed with the job's key: logged)."""
    lease = _lease()
    return None if lease is None else lease.read_blob(_LEASE_COPY.format(rank=rank))
