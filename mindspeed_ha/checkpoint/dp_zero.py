"""``distrib_optim.pt`` of a dying checkpoint, written in place by the shard savers.

The file is the DP-zero parameter state of megatron-core's distributed optimizer
(``DistributedOptimizer.get_parameter_state_dp_zero``, read back by
``load_parameter_state`` / ``load_parameter_state_from_dp_zero``;
megatron/core/optimizer/distrib_optimizer.py, core_v0.12.1)::

    {"buckets_coalesced": True,
     gbuf_idx: {dtype_key: {"param": T, "exp_avg": T, "exp_avg_sq": T,
                            "numel_unpadded": n}}}

one fp32 ``T`` of ``n`` elements (the buffer's unpadded size) per state, the buckets'
unpadded elements one after the other. Bucket ``b`` of world size ``W_b`` (a multiple of
the optimizer instance size ``c``) and unpadded size ``u_b`` starts at
``sum(u_0..u_{b-1})``; shard ``j`` holds its elements ``[j W_b/c, (j+1) W_b/c)``, of which
those below ``u_b`` are in the file. So the file is a function of the layout, which every
rank of a (TP, PP) stage knows, and of the shards' bytes:

* every shard saver plans the same ``torch.save`` layout (:mod:`.torch_file`), writes its
  ranges of the three tensors in place (shard 0 also the rest of the archive) and
  fsyncs, then records each range's CRC-32 in ``<staging>/ranges/`` (:func:`write_shard`);
* one rank per stage checks that the ranges tile every tensor exactly and sets the
  archive's CRC-32 fields (:func:`finalize`): a few bytes.

Every byte of the file is written once; nothing is staged and copied.
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Tuple

from mindspeed_ha.checkpoint import files, torch_file
from mindspeed_ha.errors import DPZeroError

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Bucket:
    """One bucket: world size ``world`` (elements), ``unpadded`` of them real, at ``offset`` in the buffer's tensors."""

    world: int
    unpadded: int
    offset: int


@dataclass(frozen=True)
class Group:
    """One (buffer, dtype) of the optimizer: ``numel`` unpadded elements in ``buckets``."""

    gbuf_idx: int
    dtype_key: Any
    numel: int
    buckets: Tuple[Bucket, ...]


def layout_of(opt) -> List[Group]:
    """The DP-zero layout of a megatron-core ``DistributedOptimizer`` (no collectives).

    Raises:
        DPZeroError: the buckets' unpadded sizes do not add up to the buffer's.
    """
    groups = []
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        buf = opt.buffers[gbuf_idx]
        for dtype_key, range_maps in gbuf_range_maps.items():
            buckets, offset = [], 0
            for bucket_idx in range(len(range_maps)):
                b = buf.buckets[bucket_idx]
                buckets.append(Bucket(b.grad_data.numel(), b.numel_unpadded, offset))
                offset += b.numel_unpadded
            if offset != buf.numel_unpadded:
                raise DPZeroError(f"buffer {gbuf_idx}: buckets cover {offset} of {buf.numel_unpadded} elements")
            groups.append(Group(gbuf_idx, dtype_key, buf.numel_unpadded, tuple(buckets)))
    return groups


class FilePlan:
    """Where each state tensor's elements go in ``distrib_optim.pt`` (one per (TP, PP) stage)."""

    def __init__(self, groups: List[Group]):
        import torch

        self.groups = groups
        state: Dict[Any, Any] = {"buckets_coalesced": True}
        self._tensors: Dict[Tuple[int, Any, str], Any] = {}
        for g in groups:
            world = {}
            for k in STATE_KEYS:
                # never touched: torch.empty pages stay unallocated; only the layout matters
                world[k] = self._tensors[(g.gbuf_idx, g.dtype_key, k)] = torch.empty((g.numel,), dtype=torch.float32)
            world["numel_unpadded"] = g.numel
            state.setdefault(g.gbuf_idx, {})[g.dtype_key] = world
        self.file = torch_file.plan(state)
        self.fingerprint = f"{self.file.size}:" + ",".join(
            f"{k}@{r.data_offset}+{r.nbytes}" for k, r in sorted(self.file.records.items()))

    def place(self, gbuf_idx: int, dtype_key, state_key: str) -> Tuple[str, int]:
        """``(record key, file offset of element 0)`` of one state tensor."""
        return self.file.storage_offset(self._tensors[(gbuf_idx, dtype_key, state_key)])


def ranges_dir(staging_root: str) -> str:
    return os.path.join(staging_root, "ranges")


def _ranges_path(staging_root: str, tp: int, pp: int, shard_id: int) -> str:
    return os.path.join(ranges_dir(staging_root), f"tp{tp:02d}_pp{pp:03d}_s{shard_id:04d}.json")


class ShardDigest(Protocol):
    """What :func:`write_shard` feeds, in order, with the bytes it is about to write."""

    def begin_bucket(self, item: Tuple) -> None:
        """A new bucket (the item :func:`write_shard` got)."""

    def begin_tensor(self, name: str, t) -> None:
        """A new state tensor of the bucket (``param``, ``exp_avg``, ``exp_avg_sq``; ``t``
        has its ``dtype`` and ``shape``); all its bytes follow through :meth:`update`
        (padding included)."""

    def update(self, data: memoryview) -> None:
        """The next bytes of the current tensor."""


def write_shard(path: str, plan: FilePlan, shard_id: int, num_shards: int,
                buckets: Iterable[Tuple[int, Any, int, int, Dict[str, Any]]],
                staging_root: str, tp: int, pp: int, iteration: int,
                digest: Optional[ShardDigest] = None, timer: Optional[Callable[[str], Any]] = None,
                fsync: Callable[[int], None] = os.fsync) -> int:
    """Write shard ``shard_id`` of ``num_shards`` into ``path`` in place; returns bytes written.

    Works through each tensor in chunks of ``CHUNK_BYTES`` (digest, CRC-32, ``pwrite``):
    each chunk is digested right before it is written, from the same memory; one
    ``fsync(fd)`` at the end.

    Args:
        buckets: this rank's shard, bucket by bucket, in layout order, as
            ``(gbuf_idx, buffer numel, dtype_key, bucket_idx, {state key: CPU fp32 tensor
            of W_b / c elements, or a list of contiguous CPU fp32 tensors that are it in
            order, ...})`` (:func:`mindspeed_ha.checkpoint.shards.shard_buckets`; with
            ``copy=False`` the parameters' own state: nothing copied). The tensors must not
            change until this returns.
        digest: fed every byte of every tensor, each chunk before it is written (the
            integrity digest: the bytes it sees are the bytes written).
        timer: ``timer(step)`` is a context manager timing ``gather`` (the shard's
            buckets produced), ``digest``, ``crc``, ``write``, ``fsync`` (for the benchmark's
            breakdown).
        fsync: called once with the file's descriptor after the last write (default
            ``os.fsync``; a :class:`mindspeed_ha.checkpoint.files.BackgroundFsync` lets the
            caller write its next file meanwhile: the shard is durable once it is joined).

    Raises:
        DPZeroError: a bucket does not match the plan.
        OSError: the write or fsync failed.
    """
    timer = timer or _no_timer
    # no O_EXCL, no O_TRUNC: other savers write the same file; never through a link
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | files.NOFOLLOW, files.FILE_MODE)
    ranges: List[Tuple[str, int, int, int]] = []  # (record key, offset in record, length, crc)
    written = 0
    try:
        os.ftruncate(fd, plan.file.size)  # idempotent; drops anything a failed earlier attempt left past the end
        if shard_id == 0:
            written += plan.file.write_skeleton(fd)
        groups = {(g.gbuf_idx, g.dtype_key): g for g in plan.groups}
        items = iter(buckets)
        while True:
            with timer("gather"):
                item = next(items, None)
            if item is None:
                break
            if digest is not None:
                digest.begin_bucket(item)
            written += _write_bucket(fd, plan, groups, item, shard_id, num_shards, digest, timer, ranges)
        with timer("fsync"):
            fsync(fd)
    finally:
        os.close(fd)
    _write_json(_ranges_path(staging_root, tp, pp, shard_id),
                {"iteration": iteration, "shard_id": shard_id, "num_shards": num_shards,
                 "layout": plan.fingerprint, "ranges": ranges})
    return written


def _write_bucket(fd: int, plan: FilePlan, groups: Dict[Tuple[int, Any], Group], item: Tuple,
                  shard_id: int, num_shards: int, digest: Optional[ShardDigest], timer: Callable[[str], Any],
                  ranges: List[Tuple[str, int, int, int]]) -> int:
    """One bucket of :func:`write_shard`: its three state tensors' ranges written in place,
    each range appended to ``ranges`` as ``(record key, offset in record, length, crc)``.
    Returns bytes written.

    Raises:
        DPZeroError: a tensor is not contiguous fp32 of the shard's size.
    """
    gbuf_idx, _, dtype_key, bucket_idx, shard = item
    b = groups[(gbuf_idx, dtype_key)].buckets[bucket_idx]
    local = b.world // num_shards
    lo, hi = shard_id * local, min((shard_id + 1) * local, b.unpadded)
    written = 0
    for k in STATE_KEYS:
        parts = shard[k] if isinstance(shard[k], (list, tuple)) else [shard[k]]
        if any(t.dtype != _fp32() or not t.is_contiguous() or t.device.type != "cpu" for t in parts) or \
                sum(t.numel() for t in parts) != local:
            raise DPZeroError(f"{k} of buffer {gbuf_idx} bucket {bucket_idx}: "
                              f"{', '.join(f'{t.dtype} x {t.numel()}' for t in parts)}, "
                              f"expected contiguous CPU float32 x {local}")
        if digest is not None:
            digest.begin_tensor(k, _TensorMeta(_fp32(), (local,)))
        key, base = plan.place(gbuf_idx, dtype_key, k)
        at = (b.offset + lo) * 4
        n = max(0, hi - lo) * 4
        crc = _write_chunks(fd, [memoryview(t.numpy()).cast("B") for t in parts if t.numel()], n, base + at,
                            digest, timer)
        if n:
            ranges.append((key, at, n, crc))
            written += n
    return written


#: bytes digested, checksummed and written per step (see :func:`write_shard`); a starting
#: writeback per chunk (``sync_file_range``) was measured: no gain on the benchmark's disk
CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class _TensorMeta:
    """What :meth:`ShardDigest.begin_tensor` reads of a state tensor given as pieces."""

    dtype: Any
    shape: Tuple[int, ...]


def _write_chunks(fd: int, pieces: List[memoryview], n: int, offset: int, digest: Optional[ShardDigest],
                  timer: Callable[[str], Any]) -> int:
    """Digest all of ``pieces`` (one byte string in order); write its first ``n`` bytes at
    ``offset``, straight from the pieces' memory; returns their CRC-32."""
    crc = 0
    pos = 0  # of the piece's first byte in the whole
    for whole in pieces:
        for at in range(0, len(whole), CHUNK_BYTES):
            chunk = whole[at:at + CHUNK_BYTES]
            if digest is not None:
                with timer("digest"):
                    digest.update(chunk)
            part = chunk[:max(0, min(len(chunk), n - pos - at))]
            if len(part):
                with timer("crc"):
                    crc = zlib.crc32(part, crc)
                with timer("write"):
                    torch_file.pwrite_all(fd, part, offset + pos + at)
        pos += len(whole)
    return crc & 0xFFFFFFFF


@contextlib.contextmanager
def _no_timer(_step: str):
    yield


def finalize(path: str, plan: FilePlan, num_shards: int, staging_root: str, tp: int, pp: int,
             iteration: int) -> None:
    """Check that the shard savers' ranges tile every tensor of ``path`` exactly, then set
    the archive's CRC-32 fields and fsync (one rank per (TP, PP), after every saver).

    Raises:
        DPZeroError: a saver's record is missing, for another iteration or layout, or a
            byte of a tensor was written twice or by nobody.
    """
    per_key: Dict[str, List[Tuple[int, int, int]]] = {k: [] for k in plan.file.records}
    for j in range(num_shards):
        p = _ranges_path(staging_root, tp, pp, j)
        try:
            with open(p) as f:
                rec = json.load(f)
        except (OSError, ValueError) as exc:
            raise DPZeroError(f"shard {j} of (tp={tp}, pp={pp}): no record of its writes ({exc})") from exc
        if (rec["iteration"], rec["num_shards"], rec["layout"]) != (iteration, num_shards, plan.fingerprint):
            raise DPZeroError(f"{p}: written for iteration {rec['iteration']} of {rec['num_shards']} shards, "
                              f"layout {rec['layout']!r}; expected {iteration}, {num_shards}, {plan.fingerprint!r}")
        for key, at, length, crc in rec["ranges"]:
            per_key[key].append((at, length, crc))
    fd = os.open(path, os.O_WRONLY | files.NOFOLLOW)
    try:
        if os.fstat(fd).st_size != plan.file.size:
            raise DPZeroError(f"{path}: {os.fstat(fd).st_size} bytes, expected {plan.file.size}")
        for key, record in plan.file.records.items():
            try:
                crc = torch_file.combine_ranges(record.nbytes, per_key[key])
            except torch_file.TorchFileError as exc:
                raise DPZeroError(f"{path} {record.name}: {exc}") from exc
            plan.file.patch_crc(fd, key, crc)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    files.write_atomically(path, json.dumps(obj).encode(), fsync=False)


def _fp32():
    import torch

    return torch.float32
