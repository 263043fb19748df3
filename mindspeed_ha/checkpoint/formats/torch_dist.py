"""``--ckpt-format torch_dist``: one PyTorch Distributed Checkpoint merged from the savers' parts.

Dump: each saver writes a *part* on its own (:mod:`mindspeed_ha.checkpoint.torch_dist_parts`)
under ``<staging>/parts/``: a shard saver the optimizer's sharded state of its (TP, PP,
shard), a model saver everything else of its (TP, PP) position (model, RNG, rerun state),
and the model saver of (TP 0, PP 0) the common state (``common.pt``), as global rank 0
does in a regular save. Nothing to assemble; the committer merges the parts' metadata
into ``iter_XXXXXXX`` before validating it.

Start-up restrictions (:meth:`TorchDistFormat.check`): the distributed optimizer must be
saved ``fully_sharded_model_space`` (Megatron's default ``--ckpt-fully-parallel-save``;
the other layout, ``dp_zero_gather_scatter``, is gathered with collectives, which
survivors of a fault cannot run), and no virtual pipeline stages.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

from mindspeed_ha.checkpoint import torch_dist_parts as td
from mindspeed_ha.checkpoint.formats.base import CheckpointFormat, SaverRole
from mindspeed_ha.errors import ConfigError


def parts_root(save_dir: str, iteration: int) -> str:
    """Where the savers of a ``torch_dist`` dying checkpoint write their parts."""
    from mindspeed_ha.checkpoint.state import staging_root

    return os.path.join(staging_root(save_dir, iteration), "parts")


class TorchDistFormat(CheckpointFormat):
    """megatron-core's ``torch_dist`` backend (``dist_checkpointing``), written without collectives."""

    name = "torch_dist"

    def check(self, args: Any) -> None:
        """Raises:
            ConfigError: ``--no-ckpt-fully-parallel-save``, virtual pipeline stages, or
                expert parallelism (:meth:`CheckpointFormat.check`).
        """
        super().check(args)
        if not getattr(args, "ckpt_fully_parallel_save", True):
            raise ConfigError("--ckpt-format torch_dist with --no-ckpt-fully-parallel-save and "
                              "--enable-high-availability: the dying checkpoint writes the distributed "
                              "optimizer as fully_sharded_model_space (Megatron's default); drop "
                              "--no-ckpt-fully-parallel-save or use --ckpt-format torch")
        if getattr(args, "virtual_pipeline_model_parallel_size", None) or \
                getattr(args, "num_layers_per_virtual_pipeline_stage", None):
            raise ConfigError("--ckpt-format torch_dist with virtual pipeline stages and "
                              "--enable-high-availability is not supported; use --ckpt-format torch")

    def dump(self, ctx, iteration: int, snapshot, role: SaverRole) -> str:
        from mindspeed_ha.checkpoint import integrity
        from mindspeed_ha.checkpoint.steps import Steps

        steps = Steps()
        with steps("check"):
            if role.shard and role.shard_digest:
                integrity.expect("optimizer shard in memory", integrity.live_shard_digest(ctx, check_finite=False),
                                 role.shard_digest)
            if role.model and role.model_digest:
                integrity.expect("model parameters in memory",
                                 integrity.live_model_digest(ctx, check_finite=False), role.model_digest)
        with steps("write"):
            out = _write_parts(ctx, iteration, snapshot, role)
        return f"{out} [{steps}]"

    def assemble(self, ctx, iteration: int) -> str:
        return "torch_dist: parts are merged at commit"

    def merge(self, save_dir: str, iteration: int, staged: str, steps) -> None:
        """The parts under :func:`parts_root`, merged into one DCP checkpoint at ``staged``
        (:func:`mindspeed_ha.checkpoint.torch_dist_parts.merge_parts`).

        Raises:
            TorchDistCheckpointError: the parts do not form a complete checkpoint.
        """
        parts = parts_root(save_dir, iteration)
        if not os.path.isdir(parts):
            return  # no saver wrote a part: validation says what is missing
        with steps("merge"):
            td.merge_parts([os.path.join(parts, n) for n in sorted(os.listdir(parts))], staged)
            os.rmdir(parts)

    def validate(self, ckpt_dir: str, iteration: Optional[int] = None) -> List[str]:
        """:func:`mindspeed_ha.checkpoint.torch_dist_parts.validate_checkpoint_dir`."""
        return td.validate_checkpoint_dir(ckpt_dir, iteration)

    def recognizes(self, ckpt_dir: str) -> bool:
        """``metadata.json`` is there (megatron-core's own test for a dist checkpoint:
        ``dist_checkpointing.check_is_distributed_checkpoint``)."""
        return os.path.exists(os.path.join(ckpt_dir, td.CONFIG_FILE))


def _write_parts(ctx, iteration: int, snapshot, role: SaverRole) -> str:
    """This saver's part(s): ``optim_tpTT_ppPPP_sSSSS`` (shard saver) and ``model_tpTT_ppPPP``
    (model saver; with ``common.pt`` at (TP 0, PP 0))."""
    from mindspeed_ha.checkpoint.state import model_state

    if not (role.shard or role.model):
        return "nothing"
    sharded, common = td.split_common(model_state(ctx, iteration, snapshot, "torch_dist"))
    root = parts_root(ctx.args.save, iteration)
    written = []
    if role.shard:
        name = f"optim_tp{ctx.tp_rank:02d}_pp{ctx.pp_rank:03d}_s{ctx.shard_id:04d}"
        td.write_part({"optimizer": sharded.get("optimizer", {})}, os.path.join(root, name))
        written.append(name)
    if role.model:
        name = f"model_tp{ctx.tp_rank:02d}_pp{ctx.pp_rank:03d}"
        td.write_part({k: v for k, v in sharded.items() if k != "optimizer"}, os.path.join(root, name))
        if ctx.tp_rank == 0 and ctx.pp_rank == 0:
            td.write_common(common, os.path.join(root, name))
        written.append(name)
    return "torch_dist parts " + ", ".join(written)
