"""Megatron-LM ``--ckpt-format torch`` checkpoints, written atomically.

Layout and content are Megatron-LM core_v0.12.1's (loadable by Megatron-LM itself)::

    <save>/latest_checkpointed_iteration.txt          "<iteration>"
    <save>/iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt
    <save>/iter_XXXXXXX/mp_rank_TT[_PPP]/distrib_optim.pt   (--use-distributed-optimizer)

``model_optim_rng.pt`` keys: args, checkpoint_version (3.0), iteration, model, optimizer,
opt_param_scheduler, rerun_state_machine, rng_state (list of per-DP-rank dicts with
random_rng_state, np_rng_state, torch_rng_state, cuda_rng_state, rng_tracker_states),
num_floating_point_operations_so_far.

Atomicity: every rank writes into ``<save>/iter_XXXXXXX.tmp``; after a barrier, global
rank 0 runs :func:`commit_checkpoint` (validate every expected file, fsync, rename to
``iter_XXXXXXX``, atomically update the tracker). A reader therefore sees either the
previous checkpoint or the complete new one. :func:`collect_rng_state` and
:func:`commit_checkpoint` use no collectives (for the dying checkpoint).

Commit policy when ``iter_XXXXXXX`` already exists: :func:`commit_checkpoint` refuses
(``FileExistsError``) unless ``overwrite=True``; :func:`save_checkpoint` passes
``overwrite=True`` (re-saving an iteration replaces it, as Megatron-LM does), moving the
old directory aside first and deleting it only after the new one and the tracker are
durable.
"""

from __future__ import annotations

import glob
import logging
import os
import random
import shutil
import sys
import tempfile
from typing import List, Optional

import numpy as np
import torch
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel

from mindspeed_ha.accelerator import collective_device

from .arguments import get_args

log = logging.getLogger("mindspeed_ha.testing.trainer.checkpointing")

CHECKPOINT_VERSION = 3.0
MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
TMP_SUFFIX = ".tmp"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, validated or committed."""


def print_rank_0(msg: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(msg, flush=True)


def unwrap_model(model):
    """Strip DDP / Float16Module wrappers (``.module``) from one model or a list."""
    def one(m):
        while hasattr(m, "module"):
            m = m.module
        return m
    return [one(m) for m in model] if isinstance(model, list) else one(model)


def get_checkpoint_name(checkpoints_path, iteration, release=False, pipeline_parallel=None,
                        tensor_rank=None, pipeline_rank=None, expert_parallel=None, expert_rank=None,
                        return_base_dir=False, basename="model_optim_rng.pt"):
    """This rank's checkpoint file (Megatron-LM's naming)."""
    directory = "release" if release else "iter_{:07d}".format(iteration)
    if return_base_dir:
        return os.path.join(checkpoints_path, directory)
    if pipeline_parallel is None:
        pipeline_parallel = mpu.get_pipeline_model_parallel_world_size() > 1
    if tensor_rank is None:
        tensor_rank = mpu.get_tensor_model_parallel_rank()
    if pipeline_rank is None:
        pipeline_rank = mpu.get_pipeline_model_parallel_rank()
    if expert_parallel is None:
        expert_parallel = mpu.get_expert_model_parallel_world_size() > 1
    if expert_rank is None:
        expert_rank = mpu.get_expert_model_parallel_rank()
    if not pipeline_parallel:
        common = os.path.join(checkpoints_path, directory, f"mp_rank_{tensor_rank:02d}")
    else:
        common = os.path.join(checkpoints_path, directory, f"mp_rank_{tensor_rank:02d}_{pipeline_rank:03d}")
    if expert_parallel:
        common = common + f"_{expert_rank:03d}"
    return os.path.join(common, basename)


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name):
    return os.path.join(os.path.dirname(model_checkpoint_name), OPTIM_FILE)


def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, "latest_checkpointed_iteration.txt")


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


def collect_rng_state() -> dict:
    """This rank's RNG state in Megatron-LM's format. No collectives."""
    device_state = torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()
    try:
        import mindspeed_ha.patches.registry as reg
        if reg.is_enabled("cpu_backend"):
            device_state = torch.cuda.get_rng_state()  # the CPU generator (cpu_backend shim)
    except ImportError:
        pass
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": device_state,
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


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


def set_rng_state(rng_state: dict) -> None:
    """Restore one rank's RNG state (inverse of :func:`collect_rng_state`)."""
    random.setstate(rng_state["random_rng_state"])
    np.random.set_state(rng_state["np_rng_state"])
    torch.set_rng_state(rng_state["torch_rng_state"])
    torch.cuda.set_rng_state(rng_state["cuda_rng_state"])
    if not rng_state["rng_tracker_states"]:
        raise KeyError("rng_tracker_states")
    tensor_parallel.get_cuda_rng_tracker().set_states(rng_state["rng_tracker_states"])


def generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, use_dist_ckpt=False,
                        iteration=None, optim_sd_kwargs=None, rerun_state=None):
    """Megatron-LM's state dict for one rank (``model``: list of unwrapped model chunks)."""
    sd = {"args": args, "checkpoint_version": CHECKPOINT_VERSION}
    if iteration is not None:
        sd["iteration"] = iteration
    for i, chunk in enumerate(model):
        key = "model" if len(model) == 1 else f"model{i}"
        sd[key] = chunk.state_dict_for_save_checkpoint()
    if not args.no_save_optim:
        if optimizer is not None and not getattr(optimizer, "is_stub_optimizer", False):
            sd["optimizer"] = optimizer.state_dict()
        if opt_param_scheduler is not None:
            sd["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    sd["rerun_state_machine"] = rerun_state
    if not args.no_save_rng:
        sd["rng_state"] = rng_state
    return sd


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tracker(save_root: str, iteration: int) -> None:
    """Atomically set the tracker to ``iteration`` (temp file + fsync + os.replace)."""
    tracker = get_checkpoint_tracker_filename(save_root)
    fd, tmp = tempfile.mkstemp(prefix=".latest_checkpointed_iteration.", dir=save_root)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, tracker)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_dir(save_root)


def expected_files(ckpt_args) -> List[str]:
    """Relative paths every complete checkpoint of a run with ``ckpt_args`` holds."""
    tp, pp = ckpt_args.tensor_model_parallel_size, ckpt_args.pipeline_model_parallel_size
    dist_opt = ckpt_args.use_distributed_optimizer and not ckpt_args.no_save_optim
    out = []
    for t in range(tp):
        for p in range(pp):
            d = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            out.append(os.path.join(d, MODEL_FILE))
            if dist_opt:
                out.append(os.path.join(d, OPTIM_FILE))
    return out


def validate_checkpoint_dir(ckpt_dir: str, iteration: Optional[int] = None) -> List[str]:
    """Check a checkpoint directory is complete; returns its files (relative paths).

    Raises:
        CheckpointError: no model file, a missing expected file, an unloadable file, or
            a wrong ``iteration`` inside.
    """
    found = sorted(glob.glob(os.path.join(ckpt_dir, "mp_rank_*", MODEL_FILE)))
    if not found:
        raise CheckpointError(f"{ckpt_dir}: no mp_rank_*/{MODEL_FILE}")
    try:
        first = torch.load(found[0], map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"{found[0]}: not loadable: {exc}") from exc
    if "args" not in first:
        raise CheckpointError(f"{found[0]}: no 'args' key")
    files = expected_files(first["args"])
    for rel in files:
        path = os.path.join(ckpt_dir, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"{ckpt_dir}: missing {rel}")
        try:
            sd = first if path == found[0] else torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:
            raise CheckpointError(f"{path}: not loadable: {exc}") from exc
        if rel.endswith(MODEL_FILE) and iteration is not None and sd.get("iteration") != iteration:
            raise CheckpointError(f"{path}: iteration {sd.get('iteration')} != {iteration}")
    return files


def commit_checkpoint(tmp_dir: str, save_root: str, iteration: int, overwrite: bool = False) -> str:
    """Validate ``tmp_dir``, make it durable, publish it as ``iter_XXXXXXX``, update the tracker.

    No collectives. Steps: :func:`validate_checkpoint_dir`; fsync every file and dir;
    rename to ``<save_root>/iter_XXXXXXX``; fsync ``save_root``; :func:`write_tracker`.

    Args:
        overwrite: an existing ``iter_XXXXXXX`` is replaced (moved aside, deleted after
            the tracker is durable); otherwise it is an error.

    Returns:
        the published directory.

    Raises:
        CheckpointError: validation failed (nothing renamed, tracker untouched).
        FileExistsError: ``iter_XXXXXXX`` exists and not ``overwrite``.
    """
    validate_checkpoint_dir(tmp_dir, iteration)
    final = get_checkpoint_name(save_root, iteration, return_base_dir=True)
    if os.path.exists(final) and not overwrite:
        raise FileExistsError(f"{final} already exists; refusing to replace it")
    for root, dirs, files in os.walk(tmp_dir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(root)
    old = None
    if os.path.exists(final):
        old = f"{final}.replaced.{os.getpid()}"
        os.rename(final, old)
        log.warning("checkpoint %s exists: replacing it", final)
    os.rename(tmp_dir, final)
    _fsync_dir(save_root)
    write_tracker(save_root, iteration)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


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
        sd = generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration=iteration)
        sd["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
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
