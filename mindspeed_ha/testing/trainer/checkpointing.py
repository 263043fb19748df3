"""The built-in trainer's ``save_checkpoint`` / ``load_checkpoint`` (Megatron-LM's names).

A client of :mod:`mindspeed_ha.integrations.megatron_lm`, which owns the format (names,
state dict, RNG layout) and the atomic publication; this module adds only what the
trainer's own periodic save and its load need: the collectives (barriers, the tracker's
max over ranks, the RNG gather with ``--data-parallel-random-init``), the ``--save``
probe and Megatron-LM's load semantics (``--finetune``, ``--no-load-optim``,
``--no-load-rng``).

Atomicity: every rank writes into ``<save>/iter_XXXXXXX.tmp``; after a barrier, global
rank 0 runs ``commit_checkpoint`` (validate every expected file, fsync, rename to
``iter_XXXXXXX``, atomically update the tracker). A reader therefore sees either the
previous checkpoint or the complete new one. Re-saving an iteration replaces it
(``overwrite=True``, as Megatron-LM does): the old directory is moved aside first and
deleted only after the new one and the tracker are durable.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

import torch
from megatron.core import parallel_state as mpu

from mindspeed_ha.accelerator import collective_device
from mindspeed_ha.integrations.megatron_lm import (
    CheckpointError,
    collect_rng_state,
    commit_checkpoint,
    generate_state_dict,
    rerun_state,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    get_distributed_optimizer_checkpoint_name,
    set_rng_state,
    unwrap_model,
)

from .arguments import get_args

TMP_SUFFIX = ".tmp"


def print_rank_0(msg: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(msg, flush=True)


def checkpoint_exists(checkpoints_path):
    return checkpoints_path is not None and os.path.exists(get_checkpoint_tracker_filename(checkpoints_path))


def read_metadata(tracker_filename):
    """(iteration, release) from the tracker; the max over ranks when distributed."""
    with open(tracker_filename, "r") as f:
        meta = f.read().strip()
    iteration, release = 0, False
    try:
        iteration = int(meta)
    except ValueError:
        release = meta == "release"
        if not release:
            raise CheckpointError(f"invalid checkpoint tracker file {tracker_filename}: {meta!r}")
    if not (iteration > 0 or release):
        raise CheckpointError(f"error parsing metadata file {tracker_filename}")
    if torch.distributed.is_initialized():
        t = torch.tensor([iteration], dtype=torch.long, device=collective_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        max_iter = int(t[0].item())
        if max_iter != iteration:
            print(f"WARNING: on rank {torch.distributed.get_rank()} found iteration {iteration} in the "
                  f"metadata while max iteration across the ranks is {max_iter}, replacing it.", flush=True)
        iteration = max_iter
    return iteration, release


def get_rng_state(ckpt_format: str = "torch"):
    """RNG state list (one dict per DP rank with --data-parallel-random-init, else one)."""
    args = get_args()
    state = collect_rng_state()
    if (args.data_parallel_random_init and torch.distributed.is_initialized()
            and mpu.get_data_parallel_world_size() > 1):
        out = [None] * mpu.get_data_parallel_world_size()
        torch.distributed.all_gather_object(out, state, group=mpu.get_data_parallel_group())
        return out
    return [state]


def check_save_dir_writable(save: Optional[str]) -> None:
    """Raise a clear error naming --save if it cannot be created or written."""
    if save is None:
        return
    try:
        os.makedirs(save, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=save)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise CheckpointError(f"--save {save!r} is not a writable directory: {exc}") from exc


def _tmp_dir(save: str, iteration: int) -> str:
    return get_checkpoint_name(save, iteration, return_base_dir=True) + TMP_SUFFIX


def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,
                    pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,
                    train_data_iterator=None, preprocess_common_state_dict_fn=None):
    """Save a Megatron-LM ``torch``-format checkpoint of ``iteration`` (collective, atomic)."""
    args = get_args()
    save = args.save
    model = unwrap_model(model)
    print_rank_0(f"saving checkpoint at iteration {iteration:7d} to {save} in torch format")
    rank = torch.distributed.get_rank()
    tmp = _tmp_dir(save, iteration)
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # a previous attempt that never committed
    torch.distributed.barrier()
    rng_state = get_rng_state(args.ckpt_format)
    name = get_checkpoint_name(tmp, 0, pipeline_parallel=pipeline_parallel, tensor_rank=tensor_rank,
                               pipeline_rank=pipeline_rank, expert_parallel=expert_parallel,
                               expert_rank=expert_rank)
    name = os.path.join(tmp, os.path.relpath(name, os.path.join(tmp, "iter_0000000")))
    if args.use_distributed_optimizer and not args.no_save_optim and optimizer is not None:
        os.makedirs(os.path.dirname(name), exist_ok=True)
        optimizer.save_parameter_state(get_distributed_optimizer_checkpoint_name(name))
    if mpu.get_expert_data_parallel_rank() == 0:
        sd = generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration=iteration,
                                 rerun_state=rerun_state("torch"),
                                 num_floating_point_operations_so_far=num_floating_point_operations_so_far)
        os.makedirs(os.path.dirname(name), exist_ok=True)
        torch.save(sd, name)
    torch.distributed.barrier()
    err = [None]
    if rank == 0:
        try:
            commit_checkpoint(tmp, save, iteration, overwrite=True)
        except (CheckpointError, OSError) as exc:
            err[0] = f"{type(exc).__name__}: {exc}"
    torch.distributed.broadcast_object_list(err, src=0)
    if err[0] is not None:
        raise CheckpointError(f"checkpoint at iteration {iteration} not committed: {err[0]}")
    print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {save}")


def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg="load", strict=True,
                    checkpointing_context=None, skip_load_to_model_and_opt=False):
    """Load the latest ``torch``-format checkpoint under ``args.<load_arg>``.

    Returns:
        ``(iteration, num_floating_point_operations_so_far)``; ``(0, 0)`` when none exists.
    """
    args = get_args()
    load_dir = getattr(args, load_arg)
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        print_rank_0(f"WARNING: could not find the metadata file {tracker}; will not load any checkpoint")
        return 0, 0
    iteration, release = read_metadata(tracker)
    name = get_checkpoint_name(load_dir, iteration, release)
    sd = torch.load(name, map_location="cpu", weights_only=False)
    iteration = 0 if (args.finetune or release) else sd["iteration"]
    flops = sd.get("num_floating_point_operations_so_far", 0)
    if "args" in sd and not args.finetune:
        ck = sd["args"]
        args.consumed_train_samples = getattr(ck, "consumed_train_samples", 0)
        args.skipped_train_samples = getattr(ck, "skipped_train_samples", 0)
        args.consumed_valid_samples = getattr(ck, "consumed_valid_samples", 0)
    if not skip_load_to_model_and_opt:
        if len(model) == 1:
            model[0].load_state_dict(sd["model"], strict=strict)
        else:
            for i, m in enumerate(model):
                m.load_state_dict(sd[f"model{i}"], strict=strict)
    if not release and not args.finetune and not args.no_load_optim:
        if optimizer is not None and not skip_load_to_model_and_opt:
            optimizer.load_state_dict(sd["optimizer"])
            if args.use_distributed_optimizer:
                optimizer.load_parameter_state(get_distributed_optimizer_checkpoint_name(name))
        if opt_param_scheduler is not None:
            opt_param_scheduler.load_state_dict(sd["opt_param_scheduler"])
    elif args.bf16 and optimizer is not None:
        optimizer.reload_model_params()
    if not release and not args.finetune and not args.no_load_rng:
        if "rng_state" not in sd:
            raise CheckpointError(f"{name}: no rng_state; use --no-load-rng or --finetune")
        states = sd["rng_state"]
        set_rng_state(states[mpu.get_data_parallel_rank()] if args.data_parallel_random_init else states[0])
    torch.distributed.barrier()
    print_rank_0(f"  successfully loaded checkpoint from {load_dir} "
                 f"[ t {mpu.get_tensor_model_parallel_rank() + 1}/{mpu.get_tensor_model_parallel_world_size()}, "
                 f"p {mpu.get_pipeline_model_parallel_rank() + 1}/{mpu.get_pipeline_model_parallel_world_size()} ] "
                 f"at iteration {iteration}")
    return iteration, flops
