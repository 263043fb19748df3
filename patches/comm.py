"""Feature ``ha``: interruptible collectives (``mindspeed_ha.recovery.comm``).

Every ``torch.distributed`` communication function megatron-core 0.12 / Megatron-LM use
is wrapped in ``torch.distributed.distributed_c10d``, the module that defines them and
whose globals torch's own compositions call (``send`` = ``isend`` + wait, the object
collectives, ``batch_isend_irecv`` -> ``P2POp.op``). The same wrapped object is then
put wherever a copy of the original function is bound by name: ``torch.distributed``
(``from .distributed_c10d import *``) and megatron modules that copy one at import
(``from torch.distributed import _coalescing_manager``, ``dist_all_gather_func = ...``).
One object everywhere matters: ``batch_isend_irecv`` tells a send from a receive by
``op.op is isend`` (distributed_c10d.py).

Those copies are ``replace`` patches that swap the original function for our wrapper
around that very function (anything else is left as it is): the wrapper is gated by
``ha``, so without HA every call passes straight through. With HA on and no abort, the
ops run the same backend calls on the same tensors (a sync op on gloo is launched async
and waited), so results are identical bit for bit (tests/test_comm.py).
"""

from __future__ import annotations

import logging
import sys

from .registry import Patch, apply_pending

log = logging.getLogger("mindspeed_ha.patches")

C10D = "torch.distributed.distributed_c10d"

#: functions with a ``group`` parameter; all but isend/irecv take ``async_op``
OPS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce",
    "barrier", "isend", "irecv", "all_to_all", "all_to_all_single", "gather", "scatter",
)

#: module -> attributes bound by name to one of the functions above at import
COPIES = {
    "torch.distributed": OPS + ("batch_isend_irecv", "_coalescing_manager"),
    "megatron.core.distributed.param_and_grad_buffer":
        ("_coalescing_manager", "dist_all_gather_func", "dist_reduce_scatter_func"),
    "megatron.core.tensor_parallel.mappings": ("dist_all_gather_func", "dist_reduce_scatter_func"),
    "megatron.core.tensor_parallel.layers": ("dist_all_gather_func", "dist_reduce_scatter_func"),
    "megatron.core.tensor_parallel.utils": ("dist_all_gather_func",),
    "megatron.core.utils": ("dist_all_gather_func",),
    "megatron.core.timers": ("dist_all_gather_func",),
}


def _wrapper(name):
    def call(wrapped, instance, args, kwargs):
        fn = _WRAPPERS.get(name)
        if fn is None:
            from mindspeed_ha.recovery import comm

            fn = _WRAPPERS[name] = (comm.collective(name) if name in OPS else
                                    getattr(comm, name.lstrip("_")))
        recorder = RECORDER
        if recorder is not None:
            return recorder(name, fn, wrapped, instance, args, kwargs)
        return fn(wrapped, instance, args, kwargs)

    return call


_WRAPPERS: dict = {}

#: ``recorder(name, fn, wrapped, instance, args, kwargs)`` while a rejoin records or replays
#: the start-up's collectives (set by ``mindspeed_ha.recovery.rejoin``), else None
RECORDER = None


def _ours(attr: str):
    """The layer of ours that distributed_c10d.<attr> is (applying c10d's patches first
    when torch was imported before mindspeed_ha), or None."""
    c10d = sys.modules.get(C10D)
    if c10d is None:
        return None
    apply_pending(c10d)  # idempotent: applies the c10d patches not applied yet
    layer = getattr(c10d, attr, None)
    patch = getattr(layer, "_self_patch", None)
    return layer if patch is not None and patch.name == f"ha.comm.{attr}" else None


def _copy_of(module: str, attr: str):
    """``replace`` function for ``module.attr``: our c10d layer if ``module.attr`` is the
    very function that layer wraps (or the layer), else the value unchanged."""

    def replace(original):
        for name in (attr,) if module == "torch.distributed" else _C10D_NAMES:
            layer = _ours(name)
            if layer is not None and (original is layer or original is layer.__wrapped__):
                return layer
        log.debug("%s.%s is not torch's function: left as it is", module, attr)
        return original

    return replace


_C10D_NAMES = ("all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor",
               "_reduce_scatter_base", "_coalescing_manager")

PATCHES = [
    Patch(name=f"ha.comm.{op}", module=C10D, attribute=op, wrapper=_wrapper(op), feature="ha",
          versions=None, doc=f"torch.distributed.{op} interruptible on gloo by mindspeed-ha recovery")
    for op in OPS + ("batch_isend_irecv", "_coalescing_manager")
] + [
    Patch(name=f"ha.comm.copy.{module}.{attr}", module=module, attribute=attr,
          wrapper=_copy_of(module, attr), feature="ha", replace=True,
          versions=None if module.startswith("torch") else ("0.12.0", "0.13.0"),
          doc=f"{module}.{attr} is the interruptible distributed_c10d function it copies")
    for module, attrs in COPIES.items() for attr in attrs
]
