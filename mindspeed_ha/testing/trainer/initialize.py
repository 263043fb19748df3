"""Megatron-LM-shaped start-up: arguments, process group, model-parallel groups, seeds."""

from __future__ import annotations

import importlib.util
import os
import random
from datetime import timedelta

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

from . import arguments as _arguments


def default_backend() -> str:
    """``nccl`` with CUDA, ``hccl`` with torch_npu, ``gloo`` otherwise."""
    if torch.cuda.is_available():
        return "nccl"
    if importlib.util.find_spec("torch_npu") is not None:
        return "hccl"
    return "gloo"


def _initialize_distributed(args) -> None:
    if torch.distributed.is_initialized():
        args.rank = torch.distributed.get_rank()
        args.world_size = torch.distributed.get_world_size()
    else:
        backend = args.distributed_backend or default_backend()
        args.distributed_backend = backend
        if backend == "nccl":
            torch.cuda.set_device(args.local_rank)
        torch.distributed.init_process_group(
            backend=backend, world_size=args.world_size, rank=args.rank,
            timeout=timedelta(minutes=args.distributed_timeout_minutes))
    if not parallel_state.model_parallel_is_initialized():
        # Module-attribute call so that patches on initialize_model_parallel apply.
        parallel_state.initialize_model_parallel(
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
            num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        )


def _set_random_seed(seed_: int, data_parallel_random_init: bool = False, te_rng_tracker: bool = False,
                     inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False):
    """Seed python, numpy, torch and megatron's RNG tracker (Megatron-LM's semantics).

    seed = seed_ + 100 * pipeline rank (+ 10 * data-parallel rank with
    ``--data-parallel-random-init``). The tracker is always seeded (on CPU its
    "CUDA" generator is the CPU generator; see the cpu_backend patch set).
    """
    if seed_ is None or seed_ <= 0:
        raise ValueError(f"Seed ({seed_}) should be a positive integer.")
    seed = seed_ + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed = seed + 10 * parallel_state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)


def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False,
                        allow_no_cuda=True, skip_mpu_initialization=False, argv=None):
    """Parse + validate arguments, init torch.distributed and megatron-core's groups, seed.

    Args:
        argv: argument list (default ``sys.argv[1:]``); ours, for tests.

    Returns:
        the validated args (also available from ``arguments.get_args()``).
    """
    args = _arguments.parse_args(extra_args_provider, ignore_unknown_args, args=argv)
    args = _arguments.validate_args(args, args_defaults)
    _arguments.set_args(args)
    if skip_mpu_initialization:
        return args
    _initialize_distributed(args)
    args.data_parallel_size = parallel_state.get_data_parallel_world_size()
    init_num_microbatches_calculator(
        args.rank, None, args.global_batch_size, args.micro_batch_size, args.data_parallel_size)
    _set_random_seed(args.seed, args.data_parallel_random_init, args.te_rng_tracker,
                     args.inference_rng_tracker)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return args
