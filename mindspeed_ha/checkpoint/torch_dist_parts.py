"""Dying checkpoint in Megatron's ``--ckpt-format torch_dist`` layout, without collectives.

A regular ``torch_dist`` save is a collective: every rank plans its shards, the
coordinator gathers the plans and writes one ``.metadata`` (PyTorch Distributed
Checkpoint, DCP). Survivors of a fault cannot do that (they may be stuck in a
collective with the dead peer), so each saver writes a *part* on its own and one rank
merges the parts' metadata afterwards:

1. :func:`write_part` (each saver, processor thread): megatron-core's own save
   preprocessing (``apply_factories``, ``extract_nonpersistent``,
   ``extract_sharded_base``), its translation to DCP (``mcore_to_pyt_state_dict``,
   ``MCoreSavePlanner``), then ``torch.distributed.checkpoint.save(no_dist=True)`` into
   ``<part dir>``. The saver stands in for DP rank 0 / optimizer instance 0 of its
   stage: the data-parallel coordinate of every ``replica_id`` is set to 0, so it
   writes exactly what the main replica would have written (TP/PP replication is
   left as it is: a TP peer still does not write a layer norm that TP rank 0 owns).
2. :func:`merge_parts` (one rank): the union of the parts' DCP metadata, each part's
   data files renamed to unique names, ``common.pt`` and ``metadata.json``; then
   :func:`validate_metadata` checks that every tensor's chunks tile its global shape
   exactly once (a missing or doubly written shard fails here, never at load time).

The result is the directory layout a regular save writes (``.metadata``,
``__*_*.distcp``, ``common.pt``, ``metadata.json``; megatron/core/dist_checkpointing,
core_v0.12.1: ``serialization.save``, ``strategies/torch.py``, ``strategies/common.py``)
and loads with Megatron-LM's stock ``--load`` / ``--ckpt-format torch_dist``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
from typing import Any, Dict, Iterable, List

from mindspeed_ha.checkpoint import files, safe_load
from mindspeed_ha.errors import TorchDistCheckpointError

COMMON_FILE = "common.pt"
CONFIG_FILE = "metadata.json"
METADATA_FILE = ".metadata"
#: megatron-core's torch_dist backend name and version (dist_checkpointing/strategies/torch.py).
BACKEND = ("torch_dist", 1)


def _as_dp_main(sh):
    """``sh`` with the data-parallel coordinate of its ``replica_id`` set to 0."""
    rid = sh.replica_id
    if isinstance(rid, int):
        new = 0
    elif isinstance(rid, tuple) and rid:
        new = (*rid[:-1], 0)
    else:
        return sh
    return sh if new == rid else dataclasses.replace(sh, replica_id=new)


def split_common(state_dict: Dict[str, Any]):
    """megatron-core's save preprocessing, without its collective validation.

    Returns:
        ``(sharded_part, common_state_dict)`` as ``dist_checkpointing.save`` would
        split them (``state_dict_utils.save_preprocess``).
    """
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, apply_factories
    from megatron.core.dist_checkpointing.state_dict_utils import (
        extract_nonpersistent, filter_out_empty_flatten_tensor)

    apply_factories(state_dict)
    _, state_dict = extract_nonpersistent(state_dict)
    sharded, common = extract_matching_values(state_dict, lambda v: isinstance(v, ShardedBase))
    return filter_out_empty_flatten_tensor(sharded), common


def write_part(sharded_part: Dict[str, Any], part_dir: str) -> List[str]:
    """Write the main-replica shards of ``sharded_part`` (this saver's role) to ``part_dir``.

    Args:
        sharded_part: nested dict of megatron ``ShardedTensor`` / ``ShardedObject``.
        part_dir: new directory (created; FileExistsError if it exists) on the
            checkpoint's filesystem.

    Returns:
        The DCP keys written.
    """
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)

    dict_list_map_inplace(_as_dp_main, sharded_part)
    flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_part, keep_only_main_replica=True)
    os.makedirs(os.path.dirname(os.path.abspath(part_dir)), exist_ok=True)
    os.mkdir(part_dir)  # new and ours: DCP's writer opens its files in it with plain open()
    if not flat:
        return []
    pyt = mcore_to_pyt_state_dict(flat, False)
    planner = MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
    writer = dcp.FileSystemWriter(part_dir, single_file_per_rank=True, sync_files=True)
    dcp.save(pyt, storage_writer=writer, planner=planner, no_dist=True)
    return sorted(pyt)


def write_common(common_state_dict: Dict[str, Any], part_dir: str) -> None:
    """``common.pt`` as megatron-core's ``TorchCommonSaveStrategy.save_common`` writes it
    (through a new temporary file: :func:`mindspeed_ha.checkpoint.files.write_atomically`)."""
    import io

    import torch

    os.makedirs(part_dir, exist_ok=True)
    buf = io.BytesIO()
    torch.save(common_state_dict, buf)
    files.write_atomically(os.path.join(part_dir, COMMON_FILE), buf.getbuffer())


def _read_metadata(part_dir: str):
    """DCP's ``.metadata`` (a pickle: ``FileSystemReader.read_metadata``), read without
    running code from it (:func:`mindspeed_ha.checkpoint.safe_load.read_pickle_file`)."""
    from torch.distributed.checkpoint.metadata import Metadata

    md = safe_load.read_pickle_file(os.path.join(part_dir, METADATA_FILE))
    if not isinstance(md, Metadata):
        raise TorchDistCheckpointError(f"{part_dir}: {METADATA_FILE} holds {type(md).__name__}, not DCP Metadata")
    return md


def merge_parts(part_dirs: Iterable[str], out_dir: str):
    """Merge the parts into one ``torch_dist`` checkpoint directory ``out_dir``.

    Data files are moved (renamed, same filesystem), not copied. A shard written by two
    parts (e.g. two savers of a replicated tensor) is kept once.

    Returns:
        The merged DCP ``Metadata``.

    Raises:
        TorchDistCheckpointError: parts disagree on a tensor's shape/dtype, a common.pt is
            missing or duplicated, or the merged shards do not tile every tensor.
    """
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    os.makedirs(out_dir, exist_ok=True)
    state_md: Dict[str, Any] = {}
    storage: Dict[Any, Any] = {}
    mcore: Dict[str, Any] = {}
    seen_chunks: Dict[str, set] = {}
    commons = []
    for i, part in enumerate(sorted(part_dirs)):
        if os.path.exists(os.path.join(part, COMMON_FILE)):
            commons.append(part)
        if not os.path.exists(os.path.join(part, METADATA_FILE)):
            continue
        md = _read_metadata(part)
        renames = {}
        for name in sorted(os.listdir(part)):
            if name.endswith(".distcp"):
                renames[name] = f"__{i}_{len(renames)}.distcp"
                os.replace(os.path.join(part, name), os.path.join(out_dir, renames[name]))
        keep_index = _add_items(md, state_md, seen_chunks)
        for index, info in md.storage_data.items():
            offsets = None if index.offset is None else tuple(index.offset)
            if (index.fqn, offsets) in keep_index:
                storage[index] = dataclasses.replace(info, relative_path=renames[info.relative_path])
        mcore.update(getattr(md, "mcore_data", None) or {})
    if len(commons) != 1:
        raise TorchDistCheckpointError(f"expected exactly one {COMMON_FILE} among the parts, found {len(commons)}")
    os.replace(os.path.join(commons[0], COMMON_FILE), os.path.join(out_dir, COMMON_FILE))
    merged = Metadata(state_dict_metadata=state_md, planner_data=None, storage_data=storage,
                      storage_meta=StorageMeta(checkpoint_id=None))
    merged.mcore_data = mcore
    validate_metadata(merged)
    _write_durably(os.path.join(out_dir, METADATA_FILE), pickle.dumps(merged))
    config = {"sharded_backend": BACKEND[0], "sharded_backend_version": BACKEND[1],
              "common_backend": "torch", "common_backend_version": 1}
    _write_durably(os.path.join(out_dir, CONFIG_FILE), json.dumps(config).encode())
    for part in part_dirs:
        shutil.rmtree(part, ignore_errors=True)
    return merged


def _add_items(md, state_md: Dict[str, Any], seen_chunks: Dict[str, set]) -> set:
    """Add one part's items (DCP ``Metadata`` ``md``) to the merged ``state_md``: a tensor's
    chunks not seen yet, an object not seen yet. Returns the ``(key, offsets or None)`` of
    what was added (its stored data is kept).

    Raises:
        TorchDistCheckpointError: the part disagrees with an earlier one on a tensor's shape/dtype.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    keep_index = set()
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            have = state_md.get(key)
            if have is None:
                have = state_md[key] = TensorStorageMetadata(meta.properties, meta.size, [])
            elif have.size != meta.size or have.properties.dtype != meta.properties.dtype:
                raise TorchDistCheckpointError(f"{key}: parts disagree on shape/dtype "
                                               f"({have.size} {have.properties.dtype} vs "
                                               f"{meta.size} {meta.properties.dtype})")
            chunks = seen_chunks.setdefault(key, set())
            for chunk in meta.chunks:
                sig = (tuple(chunk.offsets), tuple(chunk.sizes))
                if sig not in chunks:
                    chunks.add(sig)
                    have.chunks.append(chunk)
                    keep_index.add((key, tuple(chunk.offsets)))
        elif key not in state_md:
            state_md[key] = meta
            keep_index.add((key, None))
    return keep_index


def validate_metadata(md) -> None:
    """Every tensor's chunks tile its global shape: no gap, no overlap; every item stored.

    Raises:
        TorchDistCheckpointError: naming the first tensor that is not covered exactly.
    """
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = {(i.fqn, None if i.offset is None else tuple(i.offset)) for i in md.storage_data}
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            if (key, None) not in stored:
                raise TorchDistCheckpointError(f"{key}: object has no stored data")
            continue
        total = math.prod(meta.size)
        covered = sum(math.prod(c.sizes) for c in meta.chunks)
        if covered != total:
            raise TorchDistCheckpointError(f"{key}: shards cover {covered} of {total} elements")
        for c in meta.chunks:
            if (key, tuple(c.offsets)) not in stored:
                raise TorchDistCheckpointError(f"{key}: shard at {tuple(c.offsets)} has no stored data")
            if any(o + s > d for o, s, d in zip(c.offsets, c.sizes, meta.size)):
                raise TorchDistCheckpointError(f"{key}: shard at {tuple(c.offsets)} exceeds {tuple(meta.size)}")


def _write_durably(path: str, data: bytes) -> None:
    files.write_atomically(path, data)


def validate_checkpoint_dir(ckpt_dir: str, iteration=None) -> List[str]:
    """Check a ``torch_dist`` ``iter_XXXXXXX`` directory; returns its files.

    Reads ``metadata.json``, ``.metadata`` and ``common.pt``'s pickle without running code
    from them (:mod:`mindspeed_ha.checkpoint.safe_load`); data files are only stat'ed.

    Raises:
        OSError: a file could not be opened or read (EACCES, EIO...).
        TorchDistCheckpointError: wrong backend in ``metadata.json``, unreadable or
            incomplete ``.metadata`` (:func:`validate_metadata`), a data file missing, an
            unloadable ``common.pt`` or a wrong ``iteration`` in it.
    """
    try:
        with open(os.path.join(ckpt_dir, CONFIG_FILE)) as f:
            backend = json.load(f).get("sharded_backend")
        md = _read_metadata(ckpt_dir)
        common = safe_load.read_torch_file(os.path.join(ckpt_dir, COMMON_FILE))
    except FileNotFoundError as exc:
        raise TorchDistCheckpointError(f"{ckpt_dir}: not a readable torch_dist checkpoint (a file is missing): {exc}") from exc
    except OSError:
        raise  # EACCES, EIO...: unreadable, which says nothing about completeness
    except Exception as exc:  # noqa: BLE001 - any malformed file makes the checkpoint invalid
        raise TorchDistCheckpointError(f"{ckpt_dir}: not a readable torch_dist checkpoint: {exc}") from exc
    if not isinstance(common, dict):
        raise TorchDistCheckpointError(f"{ckpt_dir}: {COMMON_FILE} holds no dict")
    if backend != BACKEND[0]:
        raise TorchDistCheckpointError(f"{ckpt_dir}: sharded backend {backend!r}, expected {BACKEND[0]!r}")
    validate_metadata(md)
    files = sorted({info.relative_path for info in md.storage_data.values()})
    missing = [f for f in files if not os.path.isfile(os.path.join(ckpt_dir, f))]
    if missing:
        raise TorchDistCheckpointError(f"{ckpt_dir}: data files missing: {missing[:5]}")
    if iteration is not None and common.get("iteration") != iteration:
        raise TorchDistCheckpointError(f"{ckpt_dir}: iteration {common.get('iteration')} != {iteration}")
    return [CONFIG_FILE, METADATA_FILE, COMMON_FILE, *files]
