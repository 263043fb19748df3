"""CPU backend: megatron-core 0.12.1 (GPTModel, DDP, DistributedOptimizer, TP/PP/DP) on gloo.

Feature ``cpu_backend``. :func:`autoenable` switches it on only in a process that has
neither a CUDA device nor an NPU (``torch_npu.npu.is_available()``; env ``MINDSPEED_HA_CPU_BACKEND=0|1``
overrides), so every patch below is a pass-through wherever an accelerator exists.

Two kinds of patch (see the project's ``shared/docs/CPU_BACKEND_FACTS.md`` for the touch points):

* **Scoped device mapping** (preferred): a megatron function that builds a tensor with
  ``device='cuda'``, calls ``Tensor.cuda()`` or checks ``Tensor.type()`` against
  ``'torch.cuda.*Tensor'`` runs inside :class:`CpuDeviceMode`, a ``TorchFunctionMode``
  active only for the duration of that call. It rewrites ``device='cuda[:n]'`` to CPU,
  makes ``Tensor.cuda()`` the identity and (optimizer scopes only) reports
  ``Tensor.type()`` with the ``torch.cuda.`` prefix so megatron picks its normal path.
* **torch.cuda shims** (only where megatron calls ``torch.cuda.X()`` directly and no
  megatron function can be wrapped more narrowly): ``current_device`` -> 0 inside a
  :class:`CpuDeviceMode` scope (an index, as torch answers; the scope maps an index as
  ``device`` to CPU), the CPU device outside one,
  ``synchronize`` -> no-op, ``get_rng_state`` / ``set_rng_state`` / ``manual_seed`` ->
  the CPU default generator. They are registry patches on ``torch.cuda`` gated by this
  feature, so they act **only in CPU-only processes**; with CUDA/NPU present they pass
  every call to torch unchanged. On a CPU process the "CUDA" generator *is* the CPU
  generator, which is what dropout and init on CPU tensors consume.

The RNG tracker: megatron's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` go
through ``torch.cuda._lazy_call``, which never runs on a CPU build; they are wrapped to
read/write the CPU generator, so ``get_cuda_rng_tracker().fork()`` really swaps state
(TP-rank-specific init and dropout are right and checkpointable).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading

from mindspeed_ha import env as ha_env

from .registry import Patch, enable

FEATURE = "cpu_backend"
ENV_OVERRIDE = ha_env.CPU_BACKEND

_CUDA_TYPE_NAMES = {}


def _cpu_device_mode_cls():
    import torch
    from torch.overrides import TorchFunctionMode

    if not _CUDA_TYPE_NAMES:
        for dt, name in ((torch.float32, "FloatTensor"), (torch.float16, "HalfTensor"),
                         (torch.bfloat16, "BFloat16Tensor"), (torch.float64, "DoubleTensor"),
                         (torch.int32, "IntTensor"), (torch.int64, "LongTensor"),
                         (torch.uint8, "ByteTensor"), (torch.bool, "BoolTensor")):
            _CUDA_TYPE_NAMES[dt] = f"torch.cuda.{name}"

    cpu = torch.device("cpu")
    tensor_cuda, tensor_type, tensor_to = torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.to

    def _is_accelerator(dev) -> bool:
        """``'cuda[:n]'``, a CUDA ``torch.device`` or a device index (what
        ``torch.cuda.current_device()`` returns)."""
        if isinstance(dev, bool):
            return False
        if isinstance(dev, int):
            return True
        if isinstance(dev, (str, torch.device)):  # never str() of a tensor: x.to(other) formats it
            return str(dev).startswith("cuda")
        return False

    class CpuDeviceMode(TorchFunctionMode):
        """Map CUDA device requests to CPU for the calls made inside one megatron function.

        Args:
            map_type: also answer ``Tensor.type()`` (no arguments) with the CUDA type
                name, for megatron's optimizer code paths chosen by that string.
        """

        def __init__(self, map_type: bool = False):
            super().__init__()
            self.map_type = map_type

        def __enter__(self):
            _in_scope.depth = getattr(_in_scope, "depth", 0) + 1
            return super().__enter__()

        def __exit__(self, *exc):
            _in_scope.depth -= 1
            return super().__exit__(*exc)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if kwargs:
                if _is_accelerator(kwargs.get("device")):
                    kwargs = dict(kwargs, device=cpu)
            else:
                kwargs = {}
            if func is tensor_cuda:
                return args[0]
            if func is tensor_to and len(args) > 1 and _is_accelerator(args[1]):
                args = (args[0], cpu) + tuple(args[2:])
            if self.map_type and func is tensor_type and len(args) == 1 and not kwargs:
                return _CUDA_TYPE_NAMES.get(args[0].dtype) or func(*args)
            return func(*args, **kwargs)

    return CpuDeviceMode


_mode_cls = None


def cpu_device_mode(map_type: bool = False):
    """A new ``CpuDeviceMode`` (a ``TorchFunctionMode``; enter it with ``with``): inside it,
    ``device='cuda'`` (or a device index) maps to CPU and ``Tensor.cuda()`` is the identity; with ``map_type``
    ``Tensor.type()`` also answers ``torch.cuda.*Tensor``. Imports torch on first use."""
    global _mode_cls
    if _mode_cls is None:
        _mode_cls = _cpu_device_mode_cls()
    return _mode_cls(map_type)


def _on_cpu(wrapped, instance, args, kwargs):
    with cpu_device_mode(False):
        return wrapped(*args, **kwargs)


def _on_cpu_typed(wrapped, instance, args, kwargs):
    with cpu_device_mode(True):
        return wrapped(*args, **kwargs)


# --- torch.cuda shims (gated: CPU-only processes) -----------------------------------


#: how many CpuDeviceMode scopes this thread is in
_in_scope = threading.local()


def _current_device(wrapped, instance, args, kwargs):
    """Inside a :class:`CpuDeviceMode` scope: 0, an index as torch documents (MindSpeed indexes
    its generators with it; the scope maps ``device=0`` to CPU). Outside one (model builds
    of tests and tools that run no Megatron ``pretrain``): the CPU device, which every
    ``device=`` argument accepts."""
    import torch

    return 0 if getattr(_in_scope, "depth", 0) else torch.device("cpu")


def _synchronize(wrapped, instance, args, kwargs):
    return None


def _get_rng_state(wrapped, instance, args, kwargs):
    import torch

    return torch.get_rng_state()


def _set_rng_state(wrapped, instance, args, kwargs):
    import torch

    new_state = args[0] if args else kwargs["new_state"]
    torch.set_rng_state(new_state)


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU: work is synchronous, waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        return None

    def synchronize(self):
        return None


def _stream(wrapped, instance, args, kwargs):
    return _CpuStream(*args, **kwargs)


def _manual_seed(wrapped, instance, args, kwargs):
    import torch

    seed = args[0] if args else kwargs["seed"]
    torch.default_generator.manual_seed(int(seed))


class _DropForkWarning(logging.Filter):
    """On CPU the tracker's state *is* the CPU generator: fork's "CPU RNG state changed"
    warning fires on every dropout and says nothing; drop only that message."""

    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_MC = "megatron.core"
_DOC_DEV = "run on CPU: device='cuda' factories and .cuda() map to CPU"
_DOC_TYPE = "run on CPU; Tensor.type() answers torch.cuda.* so megatron keeps its path"

PATCHES = [
    # torch.cuda shims, CPU-only processes.
    Patch("cpu.torch_current_device", "torch.cuda", "current_device", _current_device, FEATURE,
          versions=None, doc="torch.cuda.current_device() -> 0 in a CPU scope (an int, as torch's), else the cpu device"),
    Patch("cpu.torch_synchronize", "torch.cuda", "synchronize", _synchronize, FEATURE,
          versions=None, doc="torch.cuda.synchronize() -> no-op (CPU-only process)"),
    Patch("cpu.torch_get_rng_state", "torch.cuda", "get_rng_state", _get_rng_state, FEATURE,
          versions=None, doc="torch.cuda.get_rng_state() -> CPU generator state"),
    Patch("cpu.torch_set_rng_state", "torch.cuda", "set_rng_state", _set_rng_state, FEATURE,
          versions=None, doc="torch.cuda.set_rng_state() -> CPU generator"),
    Patch("cpu.torch_stream", "torch.cuda", "Stream", _stream, FEATURE, versions=None,
          doc="torch.cuda.Stream() -> synchronous stand-in (DDP with optimizer instances)"),
    Patch("cpu.torch_manual_seed", "torch.cuda", "manual_seed", _manual_seed, FEATURE,
          versions=None, doc="torch.cuda.manual_seed() -> seeds the CPU generator"),
    # RNG tracker.
    Patch("cpu.rng_get", f"{_MC}.tensor_parallel.random", "_get_cuda_rng_state",
          _get_rng_state, FEATURE, doc="RNG tracker reads the CPU generator (no _lazy_call)"),
    Patch("cpu.rng_set", f"{_MC}.tensor_parallel.random", "_set_cuda_rng_state",
          _set_rng_state, FEATURE, doc="RNG tracker writes the CPU generator (no _lazy_call)"),
    # device='cuda' factories / .cuda().
    Patch("cpu.causal_mask", f"{_MC}.transformer.utils", "get_default_causal_mask", _on_cpu,
          FEATURE, doc=_DOC_DEV),
    Patch("cpu.sched_no_pp", f"{_MC}.pipeline_parallel.schedules",
          "forward_backward_no_pipelining", _on_cpu, FEATURE, doc=_DOC_DEV),
    Patch("cpu.sched_pp", f"{_MC}.pipeline_parallel.schedules",
          "forward_backward_pipelining_without_interleaving", _on_cpu, FEATURE, doc=_DOC_DEV),
    Patch("cpu.sched_vpp", f"{_MC}.pipeline_parallel.schedules",
          "forward_backward_pipelining_with_interleaving", _on_cpu, FEATURE, doc=_DOC_DEV),
    Patch("cpu.tied_embedding", f"{_MC}.models.common.language_module.language_module",
          "LanguageModule.setup_embeddings_and_output_layer", _on_cpu, FEATURE, doc=_DOC_DEV),
    Patch("cpu.l2_norm", f"{_MC}.utils", "local_multi_tensor_l2_norm", _on_cpu, FEATURE,
          doc=_DOC_DEV),
    # Optimizer paths chosen by Tensor.type() strings, plus device='cuda' buffers.
    Patch("cpu.grad_norm", f"{_MC}.optimizer.clip_grads", "get_grad_norm_fp32", _on_cpu_typed,
          FEATURE, doc=_DOC_TYPE),
    Patch("cpu.clip_grads", f"{_MC}.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
          _on_cpu_typed, FEATURE, doc=_DOC_TYPE),
    Patch("cpu.count_zeros", f"{_MC}.optimizer.clip_grads", "count_zeros_fp32", _on_cpu_typed,
          FEATURE, doc=_DOC_TYPE),
    Patch("cpu.mixed_opt_init", f"{_MC}.optimizer.optimizer", "MixedPrecisionOptimizer.__init__",
          _on_cpu_typed, FEATURE, doc=_DOC_TYPE),
    Patch("cpu.f16_opt_init", f"{_MC}.optimizer.optimizer",
          "Float16OptimizerWithFloat16Params.__init__", _on_cpu_typed, FEATURE, doc=_DOC_TYPE),
    Patch("cpu.fp32_opt_init", f"{_MC}.optimizer.optimizer", "FP32Optimizer.__init__",
          _on_cpu_typed, FEATURE, doc=_DOC_TYPE),
    Patch("cpu.dist_opt_init", f"{_MC}.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
          _on_cpu_typed, FEATURE, doc=_DOC_TYPE),
    # --fp16: the grad scalers build their scale and constants with device='cuda'
    # (megatron-core 0.12.1 optimizer/grad_scaler.py), and load_state_dict moves the scale
    # with .cuda(torch.cuda.current_device()).
    Patch("cpu.grad_scaler_init", f"{_MC}.optimizer.grad_scaler", "MegatronGradScaler.__init__", _on_cpu,
          FEATURE, doc=_DOC_DEV),
    Patch("cpu.dynamic_grad_scaler_init", f"{_MC}.optimizer.grad_scaler", "DynamicGradScaler.__init__", _on_cpu,
          FEATURE, doc=_DOC_DEV),
    Patch("cpu.dynamic_grad_scaler_load", f"{_MC}.optimizer.grad_scaler", "DynamicGradScaler.load_state_dict",
          _on_cpu, FEATURE, doc=_DOC_DEV),
]


def wanted() -> bool:
    """True when this process should run megatron on CPU (no CUDA device, no NPU).

    An importable ``torch_npu`` alone is not an NPU: it is asked
    (``torch_npu.npu.is_available()``), so a CPU stand-in of it (tests) or an install on a
    machine without the device leaves the CPU backend on. ``MINDSPEED_HA_CPU_BACKEND=1``
    forces it on, ``=0`` off.
    """
    env = os.environ.get(ENV_OVERRIDE, "").strip()
    if env in ("0", "1"):
        return env == "1"
    if importlib.util.find_spec("torch_npu") is not None and _npu_available():
        return False
    import torch

    return not torch.cuda.is_available()


def _npu_available() -> bool:
    """Whether ``torch_npu`` imports and reports a device (an import that fails: no NPU)."""
    try:
        import torch_npu

        return bool(torch_npu.npu.is_available())
    except Exception as exc:  # a broken install is not a device; the user's own import will say why
        logging.getLogger(__name__).warning("torch_npu is installed but does not import (%s): no NPU", exc)
        return False


def autoenable() -> bool:
    """Enable feature ``cpu_backend`` when :func:`wanted`; returns whether it is on."""
    if not wanted():
        return False
    enable(FEATURE)
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_DropForkWarning())
    return True
