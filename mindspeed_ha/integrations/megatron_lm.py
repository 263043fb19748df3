"""Megatron-LM core_v0.12.1 checkpoints (``--ckpt-format torch`` and ``torch_dist``): the facts mindspeed-ha relies on.

The runtime, the dying checkpoint and the built-in trainer learn Megatron-LM's formats
here and nowhere else. Each fact and where Megatron-LM core_v0.12.1 defines it:

* Names (``megatron/training/checkpointing.py``: ``get_checkpoint_name``,
  ``get_distributed_optimizer_checkpoint_name``, ``get_checkpoint_tracker_filename``)::

      <save>/latest_checkpointed_iteration.txt       "<iteration>" (or "release")
      <save>/iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
      <save>/iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/distrib_optim.pt   (--use-distributed-optimizer)

  ``TT`` tensor rank (2 digits), ``_PPP`` pipeline rank only when PP > 1, ``_EEE`` expert
  rank only when EP > 1 (3 digits each); ``iter_`` + 7 digits.
* ``model_optim_rng.pt`` (same file: ``generate_state_dict``, plus
  ``num_floating_point_operations_so_far`` added by ``save_checkpoint``): ``args``,
  ``checkpoint_version`` 3.0, ``iteration``, ``model`` (``model0``, ``model1``... with
  virtual pipeline chunks; ``state_dict_for_save_checkpoint()`` of each chunk),
  ``optimizer`` (``optimizer.state_dict()``) and ``opt_param_scheduler`` unless
  ``--no-save-optim``, ``rerun_state_machine``, ``rng_state`` unless ``--no-save-rng``,
  ``num_floating_point_operations_so_far``. It is written by the ranks of expert-data-
  parallel rank 0, one file per model-parallel position.
* ``rng_state`` (same file: ``get_rng_state`` and ``load_checkpoint``): a list with one
  dict per DP rank under ``--data-parallel-random-init``, else one dict, with keys
  ``random_rng_state``, ``np_rng_state``, ``torch_rng_state``, ``cuda_rng_state``,
  ``rng_tracker_states`` (megatron.core.tensor_parallel's tracker; must be non-empty).
* ``distrib_optim.pt``: the DP-zero parameter state of
  ``megatron/core/optimizer/distrib_optimizer.py`` (``get_parameter_state_dp_zero`` /
  ``load_parameter_state``); the dying checkpoint assembles it
  (:mod:`mindspeed_ha.checkpoint.formats.torch`), this module only names it.
* Args (``megatron/training/global_vars.py`` ``get_args``; set by
  ``megatron/training/initialize.py`` ``initialize_megatron`` after ``validate_args``,
  which with ``--yaml-cfg`` is another object than the one ``parse_args`` returned).
* Model wrappers (``megatron/training/utils.py`` ``unwrap_model``): DDP, FSDP and
  ``Float16Module`` hold the model in ``.module``.

Ours, not Megatron-LM's: publication is atomic (:func:`commit_checkpoint`: validate a
staged directory, fsync, rename it to ``iter_XXXXXXX``, then replace the tracker through
a temporary file), where Megatron-LM writes in place and then the tracker. Nothing here
uses a collective: the dying checkpoint calls it while peers are dead.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import random
import shutil
import sys
from typing import Any, Callable, List, Optional

import numpy as np
import torch

from mindspeed_ha.errors import CheckpointError

log = logging.getLogger("mindspeed_ha.integrations.megatron_lm")

CHECKPOINT_VERSION = 3.0
MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
TRACKER_FILE = "latest_checkpointed_iteration.txt"


# ---- args and model -----------------------------------------------------------------
def current_args() -> Optional[Any]:
    """Megatron-LM's global args, or None when ``megatron.training`` is not in use or not set up.

    Never imports ``megatron.training`` (it is not on PyPI and importing it has side
    effects): only looks at it when the training script already did.
    """
    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is None:
        return None
    try:
        return global_vars.get_args()
    except AssertionError:  # "args is not initialized."
        return None


def unwrap_model(model):
    """Strip DDP / FSDP / Float16Module wrappers (``.module``) from one model or a list of chunks."""
    def one(m):
        while hasattr(m, "module"):
            m = m.module
        return m
    return [one(m) for m in model] if isinstance(model, list) else one(model)


# ---- names --------------------------------------------------------------------------
def get_checkpoint_name(checkpoints_path, iteration, release=False, pipeline_parallel=None,
                        tensor_rank=None, pipeline_rank=None, expert_parallel=None, expert_rank=None,
                        return_base_dir=False, basename=MODEL_FILE):
    """A rank's checkpoint file, or with ``return_base_dir`` the ``iter_XXXXXXX`` directory.

    Arguments left None are read from megatron-core's parallel state (this rank's).
    """
    directory = "release" if release else f"iter_{iteration:07d}"
    if return_base_dir:
        return os.path.join(checkpoints_path, directory)
    if None in (pipeline_parallel, tensor_rank, pipeline_rank, expert_parallel, expert_rank):
        from megatron.core import parallel_state as mpu

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
    return os.path.join(checkpoints_path, directory,
                        _rank_dir(tensor_rank, pipeline_parallel, pipeline_rank, expert_parallel, expert_rank),
                        basename)


def _rank_dir(tensor_rank: int, pipeline_parallel: bool, pipeline_rank: int,
              expert_parallel: bool = False, expert_rank: int = 0) -> str:
    """``mp_rank_TT[_PPP][_EEE]``."""
    name = f"mp_rank_{tensor_rank:02d}"
    if pipeline_parallel:
        name += f"_{pipeline_rank:03d}"
    if expert_parallel:
        name += f"_{expert_rank:03d}"
    return name


def get_distributed_optimizer_checkpoint_name(model_checkpoint_name: str) -> str:
    """``distrib_optim.pt`` beside the rank's ``model_optim_rng.pt``."""
    return os.path.join(os.path.dirname(model_checkpoint_name), OPTIM_FILE)


def get_checkpoint_tracker_filename(checkpoints_path: str) -> str:
    return os.path.join(checkpoints_path, TRACKER_FILE)


def read_tracker_iteration(checkpoints_path: str) -> Optional[int]:
    """The iteration the tracker names, read locally (no collective); None if there is no
    tracker, it says ``release`` or cannot be parsed."""
    try:
        with open(get_checkpoint_tracker_filename(checkpoints_path)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


# ---- content ------------------------------------------------------------------------
def collect_rng_state() -> dict:
    """This rank's RNG state, one element of Megatron-LM's ``rng_state`` list. No collectives."""
    from megatron.core import tensor_parallel

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


def set_rng_state(rng_state: dict) -> None:
    """Restore one rank's RNG state (the inverse of :func:`collect_rng_state`).

    Raises:
        KeyError: a key is missing or ``rng_tracker_states`` is empty (Megatron-LM then
            asks for ``--no-load-rng`` or ``--finetune``).
    """
    from megatron.core import tensor_parallel

    random.setstate(rng_state["random_rng_state"])
    np.random.set_state(rng_state["np_rng_state"])
    torch.set_rng_state(rng_state["torch_rng_state"])
    torch.cuda.set_rng_state(rng_state["cuda_rng_state"])
    if not rng_state["rng_tracker_states"]:
        raise KeyError("rng_tracker_states")
    tensor_parallel.get_cuda_rng_tracker().set_states(rng_state["rng_tracker_states"])


def needs_rng_gather(args) -> bool:
    """Whether Megatron-LM's ``rng_state`` holds one entry per data-parallel rank: with
    ``--data-parallel-random-init`` and more than one DP rank (``get_rng_state``, which
    then all-gathers every DP rank's state over the DP group). Reads the layout only."""
    import torch.distributed as dist

    if not getattr(args, "data_parallel_random_init", False) or not dist.is_initialized():
        return False
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_world_size() > 1


def gather_rng_states(rng_state: dict, args) -> List[dict]:
    """Megatron-LM's ``rng_state`` list for this rank's own state ``rng_state``: every DP
    rank's state in DP-rank order under :func:`needs_rng_gather`, else ``[rng_state]``
    (``get_rng_state``, same group and order).

    A collective over the data-parallel group when :func:`needs_rng_gather` (every DP rank
    must call it at the same point); no communication otherwise.

    Raises:
        RuntimeError: (the backend) a DP peer is gone.
    """
    if not needs_rng_gather(args):
        return [rng_state]
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    out = [None] * mpu.get_data_parallel_world_size()
    dist.all_gather_object(out, rng_state, group=mpu.get_data_parallel_group())
    return out


def scheduler_state(opt_param_scheduler) -> Optional[dict]:
    """A copy of ``opt_param_scheduler.state_dict()`` (the ``opt_param_scheduler`` entry), or None."""
    if opt_param_scheduler is None:
        return None
    import copy

    return copy.deepcopy(opt_param_scheduler.state_dict())


def scheduler_after_step(opt_param_scheduler, args) -> dict:
    """A copy of the scheduler's state after the step ``train_step`` takes once the
    optimizer update succeeded, for a dying checkpoint of an iteration whose update
    finished but whose ``train_step`` did not return (a fault in the collectives after
    ``optimizer.step``). Touches nothing live.

    Megatron-LM core_v0.12.1 ``megatron/training/training.py`` ``train_step``:
    ``opt_param_scheduler.step(increment=get_num_microbatches() * micro_batch_size *
    data_parallel_size)``, and ``OptimizerParamScheduler.step`` only adds ``increment``
    to ``num_steps`` (the learning rate it sets is recomputed from ``num_steps`` on load).
    """
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    state = scheduler_state(opt_param_scheduler)
    state["num_steps"] += get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
    return state


@contextlib.contextmanager
def param_groups_after_step(opt_param_scheduler, state: dict):
    """While inside, the optimizer's param groups hold the learning rate and weight decay
    that the scheduler step :func:`scheduler_after_step` stands for would have set (a
    save of the iteration writes them); put back on exit.

    megatron-core 0.12.1 ``optimizer_param_scheduler.py`` ``OptimizerParamScheduler.step``:
    ``num_steps += increment``, then for every param group ``lr = get_lr(group) *
    lr_mult`` and ``weight_decay = get_wd() * wd_mult``. Only for a rank whose training
    thread is stopped (a dying checkpoint): the groups are the live ones.

    Args:
        opt_param_scheduler: the live ``OptimizerParamScheduler``.
        state: its state after the step (``num_steps`` is read).
    """
    groups = list(opt_param_scheduler.optimizer.param_groups)
    saved = [(g.get("lr"), g.get("weight_decay")) for g in groups]
    num_steps = opt_param_scheduler.num_steps
    try:
        opt_param_scheduler.num_steps = state["num_steps"]
        wd = opt_param_scheduler.get_wd()
        for g in groups:
            g["lr"] = opt_param_scheduler.get_lr(g) * g.get("lr_mult", 1.0)
            g["weight_decay"] = wd * g.get("wd_mult", 1.0)
        opt_param_scheduler.num_steps = num_steps
        yield
    finally:
        opt_param_scheduler.num_steps = num_steps
        for g, (lr, wd) in zip(groups, saved):
            g["lr"], g["weight_decay"] = lr, wd


def count_iteration(args, flops_before: Optional[float]):
    """What Megatron-LM's ``train`` does to its counters right after ``train_step``
    returns, done on a copy with Megatron-LM's own functions, for a dying checkpoint of an
    iteration the training loop did not count (the fault came first). Touches nothing live.

    Megatron-LM core_v0.12.1 ``megatron/training/training.py`` ``train``: adds
    ``data_parallel_world_size * micro_batch_size * get_num_microbatches()`` to
    ``consumed_train_samples``, ``get_current_global_batch_size() -
    get_current_running_global_batch_size()`` to ``skipped_train_samples`` and
    ``num_floating_point_operations(args, batch_size)`` to its FLOP count.

    Args:
        args: the run's args before the count (a shallow copy is returned).
        flops_before: the FLOP count after the previous iteration (None: not tracked).

    Returns:
        ``(args, flops or None)``.
    """
    import copy

    from megatron.core import parallel_state as mpu
    from megatron.core.num_microbatches_calculator import (
        get_current_global_batch_size, get_current_running_global_batch_size, get_num_microbatches)

    args = copy.copy(args)
    batch_size = mpu.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
    args.consumed_train_samples += batch_size
    if hasattr(args, "skipped_train_samples"):
        args.skipped_train_samples += get_current_global_batch_size() - get_current_running_global_batch_size()
    training = sys.modules.get("megatron.training.training")
    flops = flops_before
    if flops_before is not None and training is not None:
        count = training.num_floating_point_operations
        count = getattr(count, "__wrapped__", count)  # not through patches/megatron_state.py's counter
        flops = flops_before + count(args, batch_size)
    return args, flops


def sharded_rng_state(rng_state: list):
    """The ``rng_state`` list as ``--ckpt-format torch_dist`` stores it: one ``ShardedObject``
    per (PP, TP) position, DP rank 0 the main replica (``get_rng_state`` with
    ``ckpt_format == "torch_dist"``). Reads the parallel layout; no collectives."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", rng_state,
                         (mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size()),
                         (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()),
                         replica_id=mpu.get_data_parallel_rank(with_context_parallel=True))


def capture_rerun_state() -> dict:
    """A copy of the rerun state machine's checkpoint entry now (``torch`` layout), for
    :func:`rerun_state` later: ``save_checkpoint`` takes it between iterations, so the
    runtime captures it when an iteration ends."""
    import copy

    from megatron.core.rerun_state_machine import get_rerun_state_machine

    return copy.deepcopy(get_rerun_state_machine().state_dict(data_iterator=None, ckpt_format="torch"))


def rerun_state(ckpt_format: str, captured: Optional[dict] = None):
    """The rerun state machine's entry of a checkpoint (``rerun_state_machine.state_dict``
    with no data iterator, as ``save_checkpoint`` writes it outside a rerun request).

    Args:
        captured: a :func:`capture_rerun_state` result to use instead of the live state.
            For ``torch_dist`` its ``sharded`` part becomes a ``ShardedObject`` per (PP, TP)
            position, DP rank 0 the main replica (``RerunStateMachine.state_dict``).
    """
    if captured is None:
        captured = capture_rerun_state()
    if ckpt_format != "torch_dist":
        return captured
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    pos = (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank())
    size = (mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size())
    return dict(captured, sharded=ShardedObject("rerun_state_machine_state", captured["sharded"], size, pos,
                                                replica_id=mpu.get_data_parallel_rank(with_context_parallel=True)))


def generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, iteration=None,
                        rerun_state=None, num_floating_point_operations_so_far=None,
                        ckpt_format: str = "torch", scheduler_state: Optional[dict] = None) -> dict:
    """One rank's checkpoint content: ``model_optim_rng.pt`` (``torch``), or the sharded
    state dict ``dist_checkpointing.save`` takes (``torch_dist``).

    Args:
        args: the run's argument namespace (``no_save_optim`` and ``no_save_rng`` are honoured).
        model: list of unwrapped model chunks (see :func:`unwrap_model`).
        rng_state: the ``rng_state`` list (one :func:`collect_rng_state` dict per DP rank
            with ``--data-parallel-random-init``, else one); wrapped by
            :func:`sharded_rng_state` for ``torch_dist``.
        iteration: stored when given.
        rerun_state: the rerun state machine's state (None when not tracked).
        num_floating_point_operations_so_far: stored when given (a loader reads 0 when absent).
        scheduler_state: the ``opt_param_scheduler`` entry to store instead of
            ``opt_param_scheduler.state_dict()`` (a copy taken earlier, see :func:`scheduler_state`).
        ckpt_format: ``torch`` or ``torch_dist``. For ``torch_dist`` the model is
            ``sharded_state_dict()`` of each chunk and the distributed optimizer is
            ``fully_sharded_model_space`` (what ``save_checkpoint`` does with Megatron-LM's
            default ``--ckpt-fully-parallel-save``); neither uses a collective.
    """
    dist = ckpt_format == "torch_dist"
    sd = {"args": args, "checkpoint_version": CHECKPOINT_VERSION}
    if iteration is not None:
        sd["iteration"] = iteration
    for i, chunk in enumerate(model):
        key = "model" if len(model) == 1 else f"model{i}"
        sd[key] = chunk.sharded_state_dict() if dist else chunk.state_dict_for_save_checkpoint()
    if not args.no_save_optim:
        if optimizer is not None and not getattr(optimizer, "is_stub_optimizer", False):
            if dist:
                kwargs = {"sharding_type": "fully_sharded_model_space"} if args.use_distributed_optimizer else {}
                sd["optimizer"] = optimizer.sharded_state_dict(sd, **kwargs)
            else:
                sd["optimizer"] = optimizer.state_dict()
        if scheduler_state is not None:
            sd["opt_param_scheduler"] = scheduler_state
        elif opt_param_scheduler is not None:
            sd["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    sd["rerun_state_machine"] = rerun_state
    if not args.no_save_rng:
        sd["rng_state"] = sharded_rng_state(rng_state) if dist else rng_state
    if num_floating_point_operations_so_far is not None:
        sd["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
    return sd


# ---- validation and atomic publication ------------------------------------------------
def _fsync_dir(path: str) -> None:
    from mindspeed_ha.checkpoint import files

    files.fsync_dir(path)


def write_tracker(save_root: str, iteration: int) -> None:
    """Atomically set the tracker to ``iteration`` (temp file + fsync + os.replace + fsync dir).

    The file gets the mode Megatron-LM's ``open(tracker, "w")`` gives it (``0o666`` less
    the umask); the temporary file is created ``O_EXCL | O_NOFOLLOW`` at an unpredictable
    name (:mod:`mindspeed_ha.checkpoint.files`).
    """
    from mindspeed_ha.checkpoint import files

    files.write_atomically(get_checkpoint_tracker_filename(save_root), str(iteration).encode())
    _fsync_dir(save_root)


def expected_files(ckpt_args) -> List[str]:
    """Relative paths every complete ``--ckpt-format torch`` checkpoint of a run with
    ``ckpt_args`` holds: one ``mp_rank_TT[_PPP][_EEE]`` per tensor, pipeline and expert
    rank (``get_checkpoint_name``), each with ``distrib_optim.pt`` under
    ``--use-distributed-optimizer`` unless ``--no-save-optim``.

    ``ckpt_args`` may be a real namespace or the :class:`~mindspeed_ha.checkpoint.safe_load.Inert`
    one a checkpoint's ``args`` is read as.

    Raises:
        CheckpointError: a parallel size is missing or not a positive integer.
    """
    from mindspeed_ha.checkpoint.safe_load import field

    sizes = []
    for name, default in (("tensor_model_parallel_size", None), ("pipeline_model_parallel_size", None),
                          ("expert_model_parallel_size", 1)):
        v = field(ckpt_args, name, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CheckpointError(f"args.{name} = {v!r}: not a parallel size")
        sizes.append(v)
    tp, pp, ep = sizes
    dist_opt = bool(field(ckpt_args, "use_distributed_optimizer", False)) and \
        not field(ckpt_args, "no_save_optim", False)
    out = []
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                rank_dir = _rank_dir(t, pp > 1, p, ep > 1, e)
                out.append(os.path.join(rank_dir, MODEL_FILE))
                if dist_opt:
                    out.append(os.path.join(rank_dir, OPTIM_FILE))
    return out


def validate_checkpoint_dir(ckpt_dir: str, iteration: Optional[int] = None) -> List[str]:
    """Check that a ``--ckpt-format torch`` ``iter_XXXXXXX`` directory is complete; returns
    its files (relative paths). (Every format's check, ``torch_dist`` included:
    :mod:`mindspeed_ha.checkpoint.formats`.)

    Reads only what it needs, and runs no code from the files
    (:func:`mindspeed_ha.checkpoint.safe_load.read_torch_file`): each file's zip
    directory, its pickle through an unpickler that imports and calls nothing outside
    an allow-list (``args`` is read as an inert object), and each storage record's local
    header (present, of its size, inside the file). No tensor byte is read.

    Raises:
        CheckpointError: no model file, a missing expected file, an unreadable file, no
            ``args``, or a wrong ``iteration`` inside.
        OSError: a file could not be opened or read (EACCES, EIO...).
    """
    from mindspeed_ha.checkpoint.safe_load import read_torch_file

    found = sorted(glob.glob(os.path.join(ckpt_dir, "mp_rank_*", MODEL_FILE)))
    if not found:
        raise CheckpointError(f"{ckpt_dir}: no mp_rank_*/{MODEL_FILE}")
    first = read_torch_file(found[0])
    if not isinstance(first, dict) or "args" not in first:
        raise CheckpointError(f"{found[0]}: no 'args' key")
    files = expected_files(first["args"])
    for rel in files:
        path = os.path.join(ckpt_dir, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"{ckpt_dir}: missing {rel}")
        sd = first if path == found[0] else read_torch_file(path)
        if rel.endswith(MODEL_FILE) and iteration is not None and \
                (not isinstance(sd, dict) or sd.get("iteration") != iteration):
            got = sd.get("iteration") if isinstance(sd, dict) else None
            raise CheckpointError(f"{path}: iteration {got} != {iteration}")
    return files


def commit_checkpoint(tmp_dir: str, save_root: str, iteration: int, overwrite: bool = False,
                      validate: Optional[Callable[[str, int], Any]] = None) -> str:
    """Validate ``tmp_dir``, make it durable, publish it as ``iter_XXXXXXX``, update the tracker.

    No collectives. Steps: ``validate``; fsync every file and dir; rename to
    ``<save_root>/iter_XXXXXXX``; fsync ``save_root``; :func:`write_tracker`.

    Args:
        tmp_dir: the staged ``iter_XXXXXXX`` content, on the same filesystem as ``save_root``.
        overwrite: an existing ``iter_XXXXXXX`` is replaced (moved aside, deleted after
            the tracker is durable); otherwise it is an error.
        validate: ``validate(tmp_dir, iteration)`` raises CheckpointError when the
            directory is incomplete (the checkpoint format's check; default
            :func:`validate_checkpoint_dir`, ``--ckpt-format torch``).

    Returns:
        the published directory.

    Raises:
        CheckpointError: validation failed (nothing renamed, tracker untouched).
        FileExistsError: ``iter_XXXXXXX`` exists and not ``overwrite``.
        OSError: fsync, rename or the tracker write failed.
    """
    (validate or validate_checkpoint_dir)(tmp_dir, iteration)
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


__all__ = [
    "CHECKPOINT_VERSION", "MODEL_FILE", "OPTIM_FILE", "TRACKER_FILE", "CheckpointError",
    "current_args", "unwrap_model",
    "get_checkpoint_name", "get_distributed_optimizer_checkpoint_name", "get_checkpoint_tracker_filename",
    "read_tracker_iteration", "collect_rng_state", "set_rng_state", "generate_state_dict",
    "needs_rng_gather", "gather_rng_states", "scheduler_state", "scheduler_after_step", "count_iteration",
    "sharded_rng_state", "capture_rerun_state", "rerun_state",
    "write_tracker", "expected_files", "validate_checkpoint_dir", "commit_checkpoint",
]
