"""Peer-less process groups for a restarted worker's start-up (the ``ha_deferred`` backend).

While a rejoining process replays its start-up (:mod:`mindspeed_ha.recovery.rejoin`), the
survivors create no group again, so a real group would wait forever for its peers. Every
group the process creates before ``startup_done`` uses the backend :data:`BACKEND`
instead, registered with ``torch.distributed.Backend.register_backend``: a Python
``ProcessGroup`` that connects to nobody and refuses every op with
:class:`~mindspeed_ha.errors.RejoinError` (a collective that escaped the replay raises
rather than hangs). The backend and timeout the caller asked for are kept per group name in
:data:`INTENDED_BACKENDS`, so ``groups.rebuild_process_groups`` later creates the real
group (same name root, same ranks, that backend).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Dict, Optional, Tuple

from mindspeed_ha.errors import RejoinError

#: the torch.distributed backend of the groups a rejoining process creates before startup_done
BACKEND = "ha_deferred"

#: group name -> (backend, timeout) asked for when the group was created deferred (a rejoining
#: process's start-up): the rebuild creates that backend, not the deferred one
INTENDED_BACKENDS: Dict[str, Tuple[str, Optional[timedelta]]] = {}

#: the ProcessGroup ops a deferred group refuses
REFUSED_OPS = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
               "allgather_into_tensor_coalesced", "_allgather_base", "broadcast", "reduce",
               "reduce_scatter", "reduce_scatter_tensor_coalesced", "_reduce_scatter_base",
               "alltoall", "alltoall_base", "gather", "scatter", "barrier", "send", "recv",
               "recv_anysource")

_registered = []


def register_backend() -> None:
    """Register the :data:`BACKEND` torch.distributed backend (idempotent)."""
    if _registered:
        return
    import torch.distributed as dist

    cls = _deferred_class()

    def create(prefix_store, rank, size, timeout):
        return cls(rank, size)

    dist.Backend.register_backend(BACKEND, create, devices=["cpu", "cuda"])
    _registered.append(cls)


def _deferred_class():
    import torch.distributed as dist

    class DeferredGroup(dist.ProcessGroup):
        """A group made without its peers while a rejoin replays its start-up: connects to
        nobody, refuses every op (a collective that escaped the replay raises rather than
        hangs); ``rebuild_process_groups`` replaces it by the real group."""

        def __init__(self, rank, size):
            super().__init__(rank, size)

        def getBackendName(self):
            return BACKEND

        def __repr__(self):
            return f"DeferredGroup(rank={self.rank()}, size={self.size()})"

    def refuse(name):
        def op(self, *args, **kwargs):
            raise RejoinError(f"rejoin: {name} on a deferred process group (created while the start-up "
                              f"was replayed): rebuild_process_groups must replace it first")
        op.__name__ = name
        return op

    for name in REFUSED_OPS:
        setattr(DeferredGroup, name, refuse(name))
    return DeferredGroup


def intended_backend(group_name: str) -> Optional[Tuple[str, Optional[timedelta]]]:
    """(backend, timeout) asked for when group ``group_name`` was created deferred, or None
    (a group created as asked)."""
    return INTENDED_BACKENDS.get(group_name)
