"""What one start-up collective is, as :mod:`mindspeed_ha.recovery.rejoin` records and checks it.

Pure helpers over the bound arguments of one ``torch.distributed`` communication call
(``patches/comm.py`` names the op): which tensors the caller reads afterwards
(:func:`outputs`), which group it runs on (:func:`group_id`: torch name without a rebuild's
``.ha<n>`` suffix, and ranks), a tensor's dtype/shape (:func:`meta`) and bytes
(:func:`bytes_of`), and a readable description with the caller's call site
(:func:`describe`, :func:`site`; for error messages, never compared).
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from typing import Any, Dict, List, Optional, Tuple

from mindspeed_ha.errors import RejoinError

#: the suffix groups.rebuild_process_groups gives a rebuilt group's name
_GENERATION = re.compile(r"(\.ha\d+)+$")

_sigs: Dict[Any, inspect.Signature] = {}


def bind(fn, args, kwargs) -> inspect.BoundArguments:
    """``fn``'s signature bound to ``args``/``kwargs`` (signatures cached per function).

    Raises:
        TypeError: the arguments do not fit the signature.
    """
    sig = _sigs.get(fn)
    if sig is None:
        sig = _sigs[fn] = inspect.signature(fn)
    return sig.bind(*args, **kwargs)


def outputs(name: str, a: dict) -> list:
    """The tensors the caller reads after op ``name`` (bound arguments ``a``).

    Raises:
        RejoinError: an op this module cannot record or replay.
    """
    if name in ("all_reduce", "broadcast", "reduce", "scatter"):
        return [a["tensor"]]
    if name in ("all_gather",):
        return list(a["tensor_list"])
    if name in ("all_gather_into_tensor", "_all_gather_base"):
        return [a["output_tensor"]]
    if name in ("reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all_single"):
        return [a["output"]]
    if name == "all_to_all":
        return list(a["output_tensor_list"])
    if name == "gather":
        return list(a.get("gather_list") or [])
    if name == "irecv":
        return [a["tensor"]]
    if name in ("barrier", "isend"):
        return []
    if name == "batch_isend_irecv":
        return [op.tensor for op in a["p2p_op_list"] if "recv" in getattr(op.op, "__name__", "")]
    raise RejoinError(f"rejoin: op {name} cannot be recorded or replayed")


def group_of(name: str, a: dict):
    """The group argument of op ``name`` (None: the default group)."""
    if name == "batch_isend_irecv":
        ops = a["p2p_op_list"]
        return ops[0].group if ops else None
    return a.get("group")


def group_id(group) -> Optional[Tuple[str, List[int]]]:
    """(torch name, ranks in group-rank order) of ``group`` (None: the default group);
    None when this rank is not a member."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    if group is None:
        group = world.default_pg
    if group is None or group is c10d.GroupMember.NON_GROUP_MEMBER or group not in world.pg_group_ranks:
        return None
    rank_of = world.pg_group_ranks[group]
    # a group rebuilt by a rejoin in the middle of the start-up (``<root>.ha<generation>``)
    # stands for the group the first incarnation recorded under its root name
    name = _GENERATION.sub("", str(world.pg_names.get(group)))
    return name, sorted(rank_of, key=rank_of.__getitem__)


def meta(t) -> list:
    """``[dtype name, shape]`` of tensor ``t`` (e.g. ``["float32", [4]]``)."""
    return [str(t.dtype).replace("torch.", ""), list(t.shape)]


def bytes_of(t) -> bytes:
    """The bytes of tensor ``t`` (copied to host memory, row-major)."""
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def describe(e: dict) -> str:
    """``#<index> <op> on group <g> ranks [..] outputs [..] at <site>`` of entry ``e``."""
    outs = [f"{o[0]}{tuple(o[1])}" for o in e.get("out", [])]
    return (f"#{e.get('index')} {e.get('op')} on group {e.get('group')} ranks {e.get('ranks')} outputs {outs} "
            f"at {e.get('site')}")


_OURS = (os.sep + "torch" + os.sep, os.sep + "wrapt" + os.sep, os.sep + "mindspeed_ha" + os.sep + "recovery",
         os.sep + "patches" + os.sep + "comm.py", os.sep + "patches" + os.sep + "registry.py")
_MINDSPEED_HA = (os.sep + "patches" + os.sep,)  # mindspeed-ha's wrappers: their caller is named too


def site() -> str:
    """``dir/file:line function`` of the first caller outside torch, wrapt and this layer,
    and, when that is a mindspeed-ha patch, ``<- `` the first caller outside the patches
    (for error messages; never compared)."""
    out = []
    f = sys._getframe(2)
    for _ in range(60):
        if f is None:
            break
        path = f.f_code.co_filename
        if not any(part in path for part in _OURS):
            out.append(f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)}:{f.f_lineno} "
                       f"{f.f_code.co_name}")
            if not any(part in path for part in _MINDSPEED_HA):
                break
        f = f.f_back
    return " <- ".join(out[:1] + out[-1:] if len(out) > 1 else out) or "?"
