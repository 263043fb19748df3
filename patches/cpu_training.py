"""CPU backend for Megatron-LM's own ``megatron/training`` (stock ``pretrain_gpt.py``).

Feature ``cpu_backend`` (see :mod:`.cpu_backend`: on only in processes with neither CUDA
nor an NPU, so every wrapper here passes through on accelerators). Touch points found in
Megatron-LM core_v0.12.1 (``../shared/docs/CPU_BACKEND_FACTS.md``, "Stock Megatron-LM"):

* ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda``: pass ``allow_no_cuda``;
  ``--distributed-backend nccl`` (Megatron's default) is refused before torch.distributed
  starts, with a message naming the flag (gloo is the CPU backend's collective library).
* ``_initialize_distributed`` / ``_set_random_seed`` skip ``initialize_model_parallel``
  and the model-parallel RNG seeding when ``torch.cuda.device_count() == 0``: inside
  those two functions only, the process reports one device; ``torch.cuda.set_device`` is
  a no-op.
* ``pretrain`` and the functions it calls build tensors with ``device='cuda'``, call
  ``.cuda()`` (model build, logging, evaluation, data broadcast, checkpoint tracker
  reduce, JIT warm-up): ``pretrain`` runs inside :class:`CpuDeviceMode`, which maps
  those requests to CPU for this thread only (the processor thread is untouched).
* ``megatron.legacy.fused_kernels.load`` runs nvcc and creates ``build/`` inside the
  user's tree: no-op (no fused CUDA kernels on CPU).
* ``compile_helpers`` runs ``make`` inside the user's tree: the dataset helpers are
  built once per source hash in ``$MINDSPEED_HA_CACHE`` (default
  ``~/.cache/mindspeed_ha``) and that directory is added to
  ``megatron.core.datasets.__path__`` so ``from megatron.core.datasets import
  helpers_cpp`` finds them. The user's Megatron-LM tree is never written to.
* A DataLoader iterator draws its ``base_seed`` from the default generator
  (torch/utils/data/dataloader.py, ``_BaseDataLoaderIter.__init__``). On CPU the
  default generator is also the "CUDA" generator that dropout consumes, so a resumed
  run (which builds its iterators after restoring the RNG) would drift from an
  uninterrupted one. Iterator creation is made RNG-neutral: the default generator's
  state is restored after the draw (the seed drawn is unchanged).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import sysconfig
import threading

from mindspeed_ha import env as ha_env

from .registry import Patch

FEATURE = "cpu_backend"
ENV_CACHE = ha_env.CACHE

log = logging.getLogger("mindspeed_ha.patches.cpu_training")

_one_device = threading.local()


def _initialize_megatron(wrapped, instance, args, kwargs):
    kwargs = dict(kwargs, allow_no_cuda=True)
    return wrapped(*args, **kwargs)


def _gloo_on_cpu(wrapped, instance, args, kwargs):
    from megatron.training.global_vars import get_args

    if getattr(get_args(), "distributed_backend", None) == "nccl":
        from mindspeed_ha.config import ConfigError

        raise ConfigError("--distributed-backend nccl on a machine with neither CUDA nor an NPU: "
                          "use --distributed-backend gloo (the CPU backend runs Megatron on gloo)")
    return wrapped(*args, **kwargs)


def _with_one_device(wrapped, instance, args, kwargs):
    depth = getattr(_one_device, "depth", 0)
    _one_device.depth = depth + 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        _one_device.depth = depth


def _device_count(wrapped, instance, args, kwargs):
    if getattr(_one_device, "depth", 0):
        return 1
    return wrapped(*args, **kwargs)


def _set_device(wrapped, instance, args, kwargs):
    return None


def _pretrain_on_cpu(wrapped, instance, args, kwargs):
    from .cpu_backend import cpu_device_mode

    with cpu_device_mode(False):
        return wrapped(*args, **kwargs)


def _no_fused_kernels(wrapped, instance, args, kwargs):
    return None


def cache_dir() -> str:
    """Directory for build artefacts (never inside the user's tree)."""
    return os.environ.get(ENV_CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "mindspeed_ha")


def _helpers_dir(datasets_dir: str) -> str:
    with open(os.path.join(datasets_dir, "helpers.cpp"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    tag = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return os.path.join(cache_dir(), "dataset_helpers", f"{digest}{tag.replace('.', '_')}")


def _extension_path(out_dir: str) -> str:
    return os.path.join(out_dir, "helpers_cpp" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def build_dataset_helpers(datasets_dir: str) -> str:
    """Compile ``helpers.cpp`` of ``datasets_dir`` into the cache (once per source hash).

    Same compiler flags as Megatron-LM's ``megatron/core/datasets/Makefile``. The build
    goes to a temporary name and is renamed into place, so concurrent builders never
    see a half-written library.

    Returns:
        The cache directory that holds ``helpers_cpp<EXT_SUFFIX>``.

    Raises:
        RuntimeError: the compiler failed (its output is in the message).
    """
    import pybind11

    out_dir = _helpers_dir(datasets_dir)
    target = _extension_path(out_dir)
    if os.path.exists(target):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{target}.tmp.{os.getpid()}"
    cmd = [os.environ.get("CXX", "g++"), "-O3", "-Wall", "-shared", "-std=c++11", "-fPIC",
           f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
           os.path.join(datasets_dir, "helpers.cpp"), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building Megatron's dataset helpers failed: {' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, target)
    return out_dir


def _add_helpers_path(datasets_dir: str) -> None:
    pkg = sys.modules.get("megatron.core.datasets")
    out_dir = _helpers_dir(datasets_dir)
    if pkg is not None and out_dir not in pkg.__path__:
        pkg.__path__.append(out_dir)


def _datasets_dir() -> str:
    import megatron.core.datasets as datasets

    return os.path.dirname(os.path.abspath(datasets.__file__))


def _compile_helpers(wrapped, instance, args, kwargs):
    datasets_dir = _datasets_dir()
    build_dataset_helpers(datasets_dir)
    _add_helpers_path(datasets_dir)
    return None


def _compile_dependencies(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)  # rank 0 built the helpers, then a barrier
    _add_helpers_path(_datasets_dir())
    return result


def _rng_neutral_iterator(wrapped, instance, args, kwargs):
    import torch

    loader = args[0] if args else kwargs.get("loader")
    if getattr(loader, "generator", None) is not None:
        return wrapped(*args, **kwargs)
    state = torch.get_rng_state()
    try:
        return wrapped(*args, **kwargs)
    finally:
        torch.set_rng_state(state)


_MT = "megatron.training"

PATCHES = [
    Patch("cpu.mlm_initialize", f"{_MT}.initialize", "initialize_megatron", _initialize_megatron,
          FEATURE, versions=None, doc="initialize_megatron(allow_no_cuda=True)"),
    Patch("cpu.mlm_backend_check", f"{_MT}.initialize", "_initialize_distributed", _gloo_on_cpu, FEATURE,
          versions=None, doc="--distributed-backend nccl without CUDA: a clear error naming the flag"),
    Patch("cpu.mlm_init_distributed", f"{_MT}.initialize", "_initialize_distributed",
          _with_one_device, FEATURE, versions=None,
          doc="one device reported while torch.distributed + model-parallel groups start"),
    Patch("cpu.mlm_set_random_seed", f"{_MT}.initialize", "_set_random_seed", _with_one_device,
          FEATURE, versions=None, doc="one device reported so the model-parallel RNG is seeded"),
    Patch("cpu.mlm_compile_dependencies", f"{_MT}.initialize", "_compile_dependencies",
          _compile_dependencies, FEATURE, versions=None,
          doc="every rank finds the dataset helpers built in the cache"),
    Patch("cpu.torch_device_count", "torch.cuda", "device_count", _device_count, FEATURE,
          versions=None, doc="torch.cuda.device_count() -> 1 inside the two init scopes above"),
    Patch("cpu.torch_set_device", "torch.cuda", "set_device", _set_device, FEATURE,
          versions=None, doc="torch.cuda.set_device() -> no-op (CPU-only process)"),
    Patch("cpu.mlm_pretrain", f"{_MT}.training", "pretrain", _pretrain_on_cpu, FEATURE,
          versions=None, doc="pretrain(): device='cuda' factories and .cuda() map to CPU"),
    Patch("cpu.mindspeed_llm_pretrain", "mindspeed_llm.training.training", "pretrain", _pretrain_on_cpu, FEATURE,
          versions=None, doc="MindSpeed-LLM's own pretrain(): device='cuda' factories and .cuda() map to CPU"),
    Patch("cpu.mlm_fused_kernels", "megatron.legacy.fused_kernels", "load", _no_fused_kernels,
          FEATURE, versions=None, doc="no nvcc build of fused kernels (and no build/ in the tree)"),
    Patch("cpu.dataset_helpers", "megatron.core.datasets.utils", "compile_helpers",
          _compile_helpers, FEATURE, doc="dataset helpers built in the cache, not the user's tree"),
    Patch("cpu.dataloader_rng", "torch.utils.data.dataloader", "_BaseDataLoaderIter.__init__",
          _rng_neutral_iterator, FEATURE, versions=None,
          doc="DataLoader iterator creation leaves the (dropout) generator untouched"),
]
