"""Dying checkpoint [TTP]: surviving ranks write one consistent Megatron checkpoint.

Runs in the processor's action thread while the training thread may be blocked in a
collective with a dead peer, so nothing here uses a collective. Three phases, each
driven by the controller (``control.policy``):

1. ``dump``: every chosen *shard saver* writes its distributed-optimizer shard
   (main params, ``exp_avg``, ``exp_avg_sq``; fp32, ``gbuf_local`` layout) to
   ``<save>/.mindspeed_ha_dying_iter_XXXXXXX/shards/``; every chosen *model saver*
   writes ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`` into the staging dir.
2. ``assemble``: one rank per (TP, PP) concatenates the shard files into
   ``distrib_optim.pt`` in megatron-core's DP-zero format (the layout that
   ``DistributedOptimizer.get_parameter_state_dp_zero`` produces and
   ``load_parameter_state`` reads; megatron/core/optimizer/distrib_optimizer.py,
   core_v0.12.1), which is DP-size independent (buckets unpadded).
3. ``commit``: one rank validates the staged ``iter_XXXXXXX``, fsyncs, renames it into
   ``<save>`` and updates ``latest_checkpointed_iteration.txt`` (temp + fsync + rename).
   Until then a loader cannot see anything: the staging dir starts with a dot and the
   tracker still points at the previous checkpoint.

The state saved is the one consistent at the end of iteration ``k``: the controller
only picks ranks whose optimizer status is UPDATED(k) and that are frozen (they will
not start the update of ``k+1``); the RNG state is the snapshot taken when iteration
``k``'s optimizer update ended (:class:`IterationSnapshot`).

Failure (any exception in a phase, e.g. a full disk, or a saver's death): the controller
ends the job with EXIT(77) and every rank that took part removes the staging dir
(:func:`discard`, from the runtime's exit handler); the tracker is never touched and a
half-committed ``iter_XXXXXXX`` is moved back first (:func:`commit`).
``MINDSPEED_HA_KEEP_FAILED_STAGING=1`` keeps the staging dir for inspection.

Megatron-LM's names and file contents come from :mod:`mindspeed_ha.integrations.megatron_lm`.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from mindspeed_ha.integrations import megatron_lm as mlm

log = logging.getLogger("mindspeed_ha.dying")

_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")

#: set to "1" to keep the staging directory of a failed dying checkpoint (debugging)
ENV_KEEP_FAILED_STAGING = "MINDSPEED_HA_KEEP_FAILED_STAGING"


@dataclass
class IterationSnapshot:
    """Small per-iteration state taken when the optimizer update of ``iteration`` ends.

    Attributes:
        iteration: the iteration whose update just completed.
        rng_state: this rank's RNG state in Megatron-LM's checkpoint format.
        rerun_state: the rerun state machine's checkpoint entry, taken again when
            ``train_step`` of ``iteration`` returned (where a regular save takes it).
    """

    iteration: int
    rng_state: Any
    rerun_state: Any = None


def staging_root(save_dir: str, iteration: int) -> str:
    """Hidden staging directory for the dying checkpoint of ``iteration`` (same filesystem as ``save_dir``)."""
    return os.path.join(save_dir, f".mindspeed_ha_dying_iter_{iteration:07d}")


def shard_path(save_dir: str, iteration: int, tp: int, pp: int, shard_id: int) -> str:
    return os.path.join(staging_root(save_dir, iteration), "shards", f"tp{tp:02d}_pp{pp:03d}_s{shard_id:04d}.pt")


def _atomic_torch_save(obj, path: str) -> None:
    import torch

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _unwrap_distributed_optimizer(optimizer):
    """The single DistributedOptimizer inside ``optimizer`` (or None for non-distributed ones)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    dist = [o for o in opts if isinstance(o, DistributedOptimizer)]
    if not dist:
        return None
    if len(dist) != 1 or len(opts) != 1:
        raise NotImplementedError("dying checkpoint supports one DistributedOptimizer per rank")
    return dist[0]


def local_optimizer_shard(optimizer) -> Dict[str, Any]:
    """This rank's distributed-optimizer shard as CPU fp32 tensors, per buffer and bucket.

    Returns:
        ``{"num_shards": c, "buffers": {gbuf_idx: {"numel_unpadded": int, "dtypes":
        {dtype_key: [ {"gbuf_world_numel": int, "numel_unpadded": int, "param": T,
        "exp_avg": T, "exp_avg_sq": T} per bucket ]}}}}`` where each ``T`` has shape
        ``(gbuf_world_numel // c,)`` and ``c`` is the optimizer instance size.
    """
    import torch

    opt = _unwrap_distributed_optimizer(optimizer)
    num_shards = opt.data_parallel_group.size() if hasattr(opt.data_parallel_group, "size") else \
        torch.distributed.get_world_size(opt.data_parallel_group)
    buffers: Dict[int, Any] = {}
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        dtypes = {}
        for dtype_key, range_maps in gbuf_range_maps.items():
            buckets = []
            for bucket_idx, range_map in enumerate(range_maps):
                bucket = opt.buffers[gbuf_idx].buckets[bucket_idx]
                world_numel = bucket.grad_data.numel()
                local_numel = world_numel // num_shards
                shard = {k: torch.zeros((local_numel,), dtype=torch.float32) for k in _STATE_KEYS}
                for model_param, param_range in range_map["param_map"].items():
                    tensors = opt._get_main_param_and_optimizer_states(model_param)
                    lo, hi = param_range["gbuf_local"].start, param_range["gbuf_local"].end
                    for k in _STATE_KEYS:
                        shard[k][lo:hi].copy_(tensors[k].detach().to("cpu", torch.float32))
                shard["gbuf_world_numel"] = world_numel
                shard["numel_unpadded"] = bucket.numel_unpadded
                buckets.append(shard)
            dtypes[dtype_key] = buckets
        buffers[gbuf_idx] = {"numel_unpadded": opt.buffers[gbuf_idx].numel_unpadded, "dtypes": dtypes}
    return {"num_shards": num_shards, "buffers": buffers}


def assemble_dp_zero(shards: List[Dict[str, Any]]) -> Dict[Any, Any]:
    """Merge the ``c`` shards of one (TP, PP) stage, in shard order, into the DP-zero state.

    Raises:
        ValueError: shards missing, duplicated or of mismatching layout.
    """
    import torch

    if not shards:
        raise ValueError("no shards to assemble")
    c = shards[0]["num_shards"]
    if len(shards) != c or any(s["num_shards"] != c for s in shards):
        raise ValueError(f"expected {c} shards, got {len(shards)}")
    state: Dict[Any, Any] = {"buckets_coalesced": True}
    for gbuf_idx, buf in shards[0]["buffers"].items():
        dtype_state = {}
        for dtype_key, buckets in buf["dtypes"].items():
            total = buf["numel_unpadded"]
            world = {k: torch.zeros((total,), dtype=torch.float32) for k in _STATE_KEYS}
            world["numel_unpadded"] = total
            offset = 0
            for bucket_idx, b0 in enumerate(buckets):
                n = b0["numel_unpadded"]
                for k in _STATE_KEYS:
                    parts = [s["buffers"][gbuf_idx]["dtypes"][dtype_key][bucket_idx][k] for s in shards]
                    full = torch.cat(parts)
                    if full.numel() != b0["gbuf_world_numel"]:
                        raise ValueError(f"bucket {bucket_idx}: shard sizes do not add up")
                    world[k][offset:offset + n].copy_(full[:n])
                offset += n
            if offset != total:
                raise ValueError(f"buffer {gbuf_idx}: buckets cover {offset} of {total} elements")
            dtype_state[dtype_key] = world
        state[gbuf_idx] = dtype_state
    return state


@dataclass
class DyingContext:
    """What a rank needs to take part in a dying checkpoint (set by the runtime)."""

    args: Any
    model: Any
    optimizer: Any
    opt_param_scheduler: Any
    tp_rank: int
    pp_rank: int
    pp_size: int
    shard_id: int


def checkpoint_format(args) -> str:
    """The run's ``--ckpt-format`` (``torch`` when the framework has no such flag)."""
    return getattr(args, "ckpt_format", None) or "torch"


def _model_state(ctx: DyingContext, iteration: int, snapshot: IterationSnapshot,
                 ckpt_format: str = "torch") -> Dict[str, Any]:
    args = copy.copy(ctx.args)
    args.iteration = iteration
    gbs = getattr(args, "global_batch_size", None)
    if gbs:
        args.consumed_train_samples = iteration * gbs
    # num_floating_point_operations_so_far is a statistic of the training loop the runtime
    # cannot see: left out (Megatron-LM's loader reads 0).
    state = mlm.generate_state_dict(
        args, mlm.unwrap_model(ctx.model), ctx.optimizer, ctx.opt_param_scheduler, [snapshot.rng_state],
        iteration=iteration, rerun_state=mlm.rerun_state(ckpt_format, snapshot.rerun_state),
        ckpt_format=ckpt_format,
    )
    sched = state.get("opt_param_scheduler")
    if isinstance(sched, dict) and gbs and "num_steps" in sched:
        # The LR scheduler steps after the optimizer update; the update of ``iteration``
        # may have finished without it (fault in between), so state it explicitly.
        sched["num_steps"] = iteration * gbs
    return state


def dump(ctx: DyingContext, iteration: int, snapshot: Optional[IterationSnapshot],
         write_shard: bool, write_model: bool) -> str:
    """Phase 1 on one rank. Returns a one-line description of what was written.

    Raises:
        RuntimeError: this rank has no snapshot for ``iteration`` (its state moved on).
    """
    save = ctx.args.save
    if snapshot is None or snapshot.iteration != iteration:
        have = None if snapshot is None else snapshot.iteration
        raise RuntimeError(f"no consistent state for iteration {iteration} (snapshot at {have})")
    if checkpoint_format(ctx.args) == "torch_dist":
        return _dump_torch_dist(ctx, iteration, snapshot, write_shard, write_model)
    written = []
    if write_shard and _unwrap_distributed_optimizer(ctx.optimizer) is not None:
        path = shard_path(save, iteration, ctx.tp_rank, ctx.pp_rank, ctx.shard_id)
        shard = local_optimizer_shard(ctx.optimizer)
        shard["iteration"] = iteration
        _atomic_torch_save(shard, path)
        written.append(os.path.basename(path))
    if write_model:
        path = mlm.get_checkpoint_name(
            staging_root(save, iteration), iteration,
            pipeline_parallel=ctx.pp_size > 1, tensor_rank=ctx.tp_rank, pipeline_rank=ctx.pp_rank,
        )
        _atomic_torch_save(_model_state(ctx, iteration, snapshot), path)
        written.append(os.path.relpath(path, staging_root(save, iteration)))
    return ", ".join(written) or "nothing"


def parts_root(save_dir: str, iteration: int) -> str:
    """Where the savers of a ``torch_dist`` dying checkpoint write their parts."""
    return os.path.join(staging_root(save_dir, iteration), "parts")


def _dump_torch_dist(ctx: DyingContext, iteration: int, snapshot: IterationSnapshot,
                     write_shard: bool, write_model: bool) -> str:
    """Phase 1 for ``--ckpt-format torch_dist``: this saver's part(s), see :mod:`.recovery.torch_dist`.

    A shard saver writes the optimizer's sharded state of its (TP, PP, shard); a model
    saver everything else of its (TP, PP) position (model, RNG, rerun state), and the
    model saver of (TP 0, PP 0) the common state (``common.pt``), as global rank 0 does
    in a regular save.
    """
    from mindspeed_ha.recovery import torch_dist as td

    if not (write_shard or write_model):
        return "nothing"
    sharded, common = td.split_common(_model_state(ctx, iteration, snapshot, "torch_dist"))
    root = parts_root(ctx.args.save, iteration)
    written = []
    if write_shard:
        name = f"optim_tp{ctx.tp_rank:02d}_pp{ctx.pp_rank:03d}_s{ctx.shard_id:04d}"
        td.write_part({"optimizer": sharded.get("optimizer", {})}, os.path.join(root, name))
        written.append(name)
    if write_model:
        name = f"model_tp{ctx.tp_rank:02d}_pp{ctx.pp_rank:03d}"
        td.write_part({k: v for k, v in sharded.items() if k != "optimizer"}, os.path.join(root, name))
        if ctx.tp_rank == 0 and ctx.pp_rank == 0:
            td.write_common(common, os.path.join(root, name))
        written.append(name)
    return "torch_dist parts " + ", ".join(written)


def assemble(ctx: DyingContext, iteration: int) -> str:
    """Phase 2 on one rank per (TP, PP): shard files -> ``distrib_optim.pt`` (``torch``;
    ``torch_dist`` parts are merged by :func:`commit`)."""
    if checkpoint_format(ctx.args) == "torch_dist":
        return "torch_dist: parts are merged at commit"
    import torch
    opt = _unwrap_distributed_optimizer(ctx.optimizer)
    if opt is None:
        return "no distributed optimizer: nothing to assemble"
    save = ctx.args.save
    c = opt.data_parallel_group.size()
    shards = []
    for j in range(c):
        path = shard_path(save, iteration, ctx.tp_rank, ctx.pp_rank, j)
        shard = torch.load(path, map_location="cpu", weights_only=False)
        if shard.get("iteration") != iteration:
            raise RuntimeError(f"{path}: shard is for iteration {shard.get('iteration')}, expected {iteration}")
        shards.append(shard)
    state = assemble_dp_zero(shards)
    model_path = mlm.get_checkpoint_name(
        staging_root(save, iteration), iteration,
        pipeline_parallel=ctx.pp_size > 1, tensor_rank=ctx.tp_rank, pipeline_rank=ctx.pp_rank,
    )
    out = mlm.get_distributed_optimizer_checkpoint_name(model_path)
    _atomic_torch_save(state, out)
    return os.path.relpath(out, staging_root(save, iteration))


def commit(save_dir: str, iteration: int) -> str:
    """Phase 3 on one rank: validate, rename into ``save_dir``, update the tracker.

    Raises:
        CheckpointError, OSError: nothing was published: a staged directory already renamed
            to ``iter_XXXXXXX`` is moved back into the staging dir (for :func:`discard`)
            unless the tracker already names it; the tracker is untouched.
    """
    root = staging_root(save_dir, iteration)
    staged = mlm.get_checkpoint_name(root, iteration, return_base_dir=True)
    final = mlm.get_checkpoint_name(save_dir, iteration, return_base_dir=True)
    if os.path.isdir(final):
        # A periodic save of the same iteration already published it: keep that one.
        mlm.validate_checkpoint_dir(final, iteration)
        tracked = mlm.read_tracker_iteration(save_dir)
        if tracked is None or tracked < iteration:
            mlm.write_tracker(save_dir, iteration)
        shutil.rmtree(root, ignore_errors=True)
        return f"{final} (already saved by a periodic checkpoint)"
    try:
        parts = parts_root(save_dir, iteration)
        if os.path.isdir(parts):  # torch_dist: one DCP checkpoint from the savers' parts
            from mindspeed_ha.recovery import torch_dist as td

            td.merge_parts([os.path.join(parts, n) for n in sorted(os.listdir(parts))], staged)
            os.rmdir(parts)
        mlm.commit_checkpoint(staged, save_dir, iteration)
    except BaseException:
        renamed = os.path.isdir(final) and not os.path.exists(staged)
        if renamed and mlm.read_tracker_iteration(save_dir) != iteration:
            os.rename(final, staged)  # not published: a loader never sees a half-committed dir
        raise
    shutil.rmtree(root, ignore_errors=True)
    return final


def discard(save_dir: str, iteration: int) -> str:
    """Remove the staging dir of a failed dying checkpoint; never touches the tracker.

    Kept instead when ``MINDSPEED_HA_KEEP_FAILED_STAGING=1`` (to inspect what was written).
    Idempotent and safe to run on several ranks at once. Returns what was done.
    """
    root = staging_root(save_dir, iteration)
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
