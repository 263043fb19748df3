"""``--ckpt-format torch``: ``model_optim_rng.pt`` per (TP, PP) and the DP-zero ``distrib_optim.pt``.

Dump: every chosen *shard saver* writes its distributed-optimizer shard (main params,
``exp_avg``, ``exp_avg_sq``; fp32) in place into the stage's
``iter_XXXXXXX/mp_rank_TT[_PPP]/distrib_optim.pt``: megatron-core's DP-zero format (the
layout ``DistributedOptimizer.get_parameter_state_dp_zero`` produces and
``load_parameter_state`` reads; megatron/core/optimizer/distrib_optimizer.py,
core_v0.12.1), DP-size independent (buckets unpadded), a ``torch.save`` archive whose
layout every saver of the stage computes alike (:mod:`mindspeed_ha.checkpoint.dp_zero`),
so each byte is written once, by the saver that holds it, in parallel with the others.
Every chosen *model saver* writes ``model_optim_rng.pt`` there.

Assemble: one rank per (TP, PP) checks that the shard savers' ranges tile
``distrib_optim.pt`` exactly and sets its CRC-32 fields (a few bytes). Nothing to merge:
the staged ``iter_XXXXXXX`` is the final one.
"""

from __future__ import annotations

import glob
import os
from typing import List, Optional

from mindspeed_ha.checkpoint.formats.base import CheckpointFormat, SaverRole


def atomic_torch_save(obj, path: str) -> None:
    """``torch.save(obj)`` to ``path`` through a new temporary file (``O_EXCL |
    O_NOFOLLOW``, unpredictable name: :mod:`mindspeed_ha.checkpoint.files`), fsynced
    (each storage written once, straight from memory: :func:`mindspeed_ha.checkpoint.torch_file.save`)."""
    from mindspeed_ha.checkpoint import files, torch_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = files.temp_name(path)
    try:
        torch_file.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


class TorchFormat(CheckpointFormat):
    """Megatron-LM's ``torch`` format (start-up: no expert parallelism, :meth:`CheckpointFormat.check`)."""

    name = "torch"

    def dump(self, ctx, iteration: int, snapshot, role: SaverRole) -> str:
        from mindspeed_ha.checkpoint.shards import unwrap_distributed_optimizer
        from mindspeed_ha.checkpoint.steps import Steps

        from mindspeed_ha.checkpoint import files

        steps = Steps()
        opt = unwrap_distributed_optimizer(ctx.optimizer)
        written = []
        # the shard's fsync runs while the model file is written (the disk's wait and the
        # copy into the page cache overlap); both files are durable when the block ends
        with files.fsync_in_background() as shard_fsync:
            if role.shard and opt is not None:
                written.append(_dump_dp_zero_shard(ctx, opt, iteration, role.shard_digest, steps, shard_fsync))
            if role.model:
                written.append(_dump_model(ctx, opt, iteration, snapshot, role, steps))
            with steps("shard_fsync_wait"):
                shard_fsync.wait()
        return f"{', '.join(written)} [{steps}]" if written else "nothing"

    def assemble(self, ctx, iteration: int) -> str:
        """``distrib_optim.pt`` checked complete (every byte of every tensor written by
        exactly one shard saver) and its CRC-32 fields set
        (:func:`mindspeed_ha.checkpoint.dp_zero.finalize`).

        Raises:
            DPZeroError: a shard saver's writes are missing or do not tile the file.
        """
        from mindspeed_ha.checkpoint import dp_zero
        from mindspeed_ha.checkpoint.shards import num_shards, unwrap_distributed_optimizer
        from mindspeed_ha.checkpoint.state import model_path, staging_root
        from mindspeed_ha.checkpoint.steps import Steps, gc_paused
        from mindspeed_ha.integrations import megatron_lm as mlm

        opt = unwrap_distributed_optimizer(ctx.optimizer)
        if opt is None:
            return "no distributed optimizer: nothing to assemble"
        steps = Steps()
        path = mlm.get_distributed_optimizer_checkpoint_name(model_path(ctx, iteration))
        root = staging_root(ctx.args.save, iteration)
        with gc_paused():
            with steps("plan"):
                plan = dp_zero.FilePlan(dp_zero.layout_of(opt))
            with steps("finalize"):
                dp_zero.finalize(path, plan, num_shards(opt), root, ctx.tp_rank, ctx.pp_rank, iteration)
        return f"{os.path.relpath(path, root)} complete [{steps}]"

    def validate(self, ckpt_dir: str, iteration: Optional[int] = None) -> List[str]:
        """:func:`mindspeed_ha.integrations.megatron_lm.validate_checkpoint_dir`."""
        from mindspeed_ha.integrations import megatron_lm as mlm

        return mlm.validate_checkpoint_dir(ckpt_dir, iteration)

    def recognizes(self, ckpt_dir: str) -> bool:
        """An ``mp_rank_*`` directory is there (Megatron-LM's per-rank files)."""
        return bool(glob.glob(os.path.join(ckpt_dir, "mp_rank_*")))


def _dump_model(ctx, opt, iteration: int, snapshot, role: SaverRole, steps) -> str:
    """``model_optim_rng.pt``: state built, its parameters (and a non-distributed optimizer's
    state) digested in memory against the trusted digests, then written."""
    from mindspeed_ha.checkpoint import integrity
    from mindspeed_ha.checkpoint.state import model_path, model_state, staging_root

    path = model_path(ctx, iteration)
    rel = os.path.relpath(path, staging_root(ctx.args.save, iteration))
    with steps("model_state"):
        state = model_state(ctx, iteration, snapshot)
    with steps("model_check"):
        if role.model_digest:
            integrity.expect(f"model parameters of {rel}",
                             integrity.model_state_digest(state, integrity.param_names(ctx), False),
                             role.model_digest)
        if role.shard_digest and opt is None and "optimizer" in state:
            d = integrity.Digest(check_finite=False)
            d.value("optimizer", state["optimizer"])
            integrity.expect(f"optimizer state of {rel}", d.result(), role.shard_digest)
    with steps("model_write"):
        atomic_torch_save(state, path)
    return rel


def _dump_dp_zero_shard(ctx, opt, iteration: int, shard_digest: str, steps, fsync) -> str:
    """This rank's shard, written in place into the stage's ``distrib_optim.pt``
    (:mod:`mindspeed_ha.checkpoint.dp_zero`) straight from the optimizer's own (frozen)
    state tensors, no gather copy when they are CPU fp32; each chunk digested just before
    it is written, from the same memory; the digest must be the trusted one. ``fsync(fd)`` makes it durable
    (:class:`mindspeed_ha.checkpoint.files.BackgroundFsync`: joined by the caller)."""
    from mindspeed_ha.checkpoint import dp_zero, integrity
    from mindspeed_ha.checkpoint.shards import num_shards, shard_buckets
    from mindspeed_ha.checkpoint.state import model_path, staging_root
    from mindspeed_ha.integrations import megatron_lm as mlm

    count = num_shards(opt)
    root = staging_root(ctx.args.save, iteration)
    path = mlm.get_distributed_optimizer_checkpoint_name(model_path(ctx, iteration))
    rel = os.path.relpath(path, root)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with steps("plan"):
        plan = dp_zero.FilePlan(dp_zero.layout_of(opt))
    digest = integrity.StreamingShardDigest(count) if shard_digest else None
    nbytes = dp_zero.write_shard(
        path, plan, ctx.shard_id, count, shard_buckets(opt, count, copy=False), root, ctx.tp_rank, ctx.pp_rank,
        iteration, digest, timer=lambda step: steps(f"shard_{step}"), fsync=fsync)
    if digest is not None:
        integrity.expect(f"shard {ctx.shard_id} written to {rel}", digest.result(), shard_digest)
    return f"{rel} shard {ctx.shard_id}/{count} ({nbytes} B)"
