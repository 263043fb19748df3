"""The gloo devices of rebuilt process groups: one per group, kept for every generation.

A gloo device (``gloo::transport::tcp::Device``) is a listening socket, an epoll loop with
its wake pipe (4 descriptors) and one ``gloo_tcp_loop`` thread. torch gives every
``ProcessGroupGloo`` its own (``ProcessGroupGloo(store, rank, size, timeout)`` makes
``create_default_device()``, or one per interface of ``GLOO_SOCKET_IFNAME``), released
when the last object holding it goes: the group's context, its pairs, a ``Work`` or
unbound buffer of an op. Destroying an old generation's group therefore frees its device
only if nothing in C++ still holds a piece of its context; measured in the soak run (100
faults, ``tests/test_soak.py``): now and then one was kept (0 to 5 per process over 30-40
recoveries, more often in the repair source of a restarted rank, whose PP group lost its
peer), each 4 fds and a thread, with no Python object holding it (docs/RESULTS.md, "Soak").

So a rebuilt group does not get a device of its own: :func:`constructing` hands the group
being made the device of its *root* (the group's torch name without the ``.ha<n>``
generation suffix: ``dp.ha3`` and ``dp.ha4`` share one), made at the first rebuild and
kept by this module for the life of the process. The same number of devices and loop
threads as torch's layout (one per group; the I/O of different groups stays on different
threads), but a later generation never makes a new one, so whatever C++ keeps of an old
generation keeps only memory: the descriptors and threads of a process are the same after
the 100th recovery as after the first.

A device is made for the binding in force (:func:`binding`): the one ``mindspeed-ha
relink`` committed on this rank (:func:`commit`), or a trial one inside :func:`trying`;
None is torch's default (``GLOO_SOCKET_IFNAME`` if set, else the host name's address). A
root whose binding changed gets a new device; the old one goes with its last group.

How the device reaches the group: torch's ``_new_process_group_helper`` builds
``ProcessGroupGloo(store, rank, size, timeout=...)`` from the module's global name and
ignores options for gloo (torch 2.13, ``distributed_c10d.py``); inside
:func:`constructing` that name is a subclass whose constructor passes
``ProcessGroupGloo._Options`` with the chosen devices (torch's own defaults otherwise:
2 worker threads, the given timeout).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

__all__ = ["binding", "commit", "committed", "constructing", "make_device", "pooled", "trying"]

#: root name -> (binding key, devices): the devices every generation of that group uses
_POOL: Dict[str, Tuple[Tuple, List[Any]]] = {}
#: the binding committed on this rank (None: torch's default) and the one a relink tries now
_BINDING: Dict[str, Optional[Dict[str, str]]] = {"committed": None, "trial": None}
_TRYING: Dict[str, bool] = {"on": False}
#: the devices the group being constructed gets, and the subclass made once per torch class
_SCOPE: Dict[str, Any] = {"devices": None, "cls": None}


def make_device(bind: Dict[str, str]):
    """The gloo device of ``bind`` (``{"addr": A}`` or ``{"iface": I}``).

    Raises:
        RuntimeError: torch's, when the address or interface is not this host's.
    """
    from torch.distributed import ProcessGroupGloo

    if bind.get("addr"):
        return ProcessGroupGloo.create_device(hostname=bind["addr"])
    return ProcessGroupGloo.create_device(interface=bind["iface"])


def _default_devices() -> List[Any]:
    """What torch's constructor would give a group: one device per interface of
    ``GLOO_SOCKET_IFNAME`` (comma-separated), else the default device."""
    from torch.distributed import ProcessGroupGloo

    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    if names:
        return [ProcessGroupGloo.create_device(interface=n) for n in names]
    return [ProcessGroupGloo.create_default_device()]


def binding() -> Optional[Dict[str, str]]:
    """The binding new groups of this rank get now: the trial one inside :func:`trying`, else
    the committed one (None: torch's default)."""
    return _BINDING["trial"] if _TRYING["on"] else _BINDING["committed"]


def committed() -> Optional[Dict[str, str]]:
    """The binding ``mindspeed-ha relink`` committed on this rank (None: the default)."""
    return _BINDING["committed"]


def commit(bind: Optional[Dict[str, str]]) -> None:
    """Make ``bind`` the binding of every later generation on this rank (None: the default)."""
    _BINDING["committed"] = dict(bind) if bind else None


@contextlib.contextmanager
def trying(bind: Optional[Dict[str, str]]) -> Iterator[None]:
    """Inside: new groups get ``bind`` (None: the default), whatever is committed."""
    saved = (_TRYING["on"], _BINDING["trial"])
    _TRYING["on"], _BINDING["trial"] = True, (dict(bind) if bind else None)
    try:
        yield
    finally:
        _TRYING["on"], _BINDING["trial"] = saved


def pooled(root: str) -> List[Any]:
    """The devices of group ``root`` for the binding in force, made on first use.

    Raises:
        RuntimeError: torch's, when the binding cannot be made on this host.
    """
    bind = binding()
    key = tuple(sorted(bind.items())) if bind else ()
    held = _POOL.get(root)
    if held is None or held[0] != key:
        _POOL[root] = (key, [make_device(bind)] if bind else _default_devices())
    return _POOL[root][1]


def _subclass(base):
    """The subclass of torch's ProcessGroupGloo put in its place (made once per base)."""
    if _SCOPE["cls"] is None or _SCOPE["cls"].__bases__[0] is not base:
        from datetime import timedelta

        class PooledGloo(base):  # what _new_process_group_helper constructs, with the scope's devices
            def __init__(self, store, rank, size, timeout=timedelta(minutes=30)):
                opts = base._Options()
                opts._timeout = timeout
                opts._devices = _SCOPE["devices"]
                super().__init__(store, rank, size, opts)

        _SCOPE["cls"] = PooledGloo
    return _SCOPE["cls"]


@contextlib.contextmanager
def constructing(root: str, backend: str) -> Iterator[None]:
    """Inside: a gloo group torch constructs gets the pooled devices of ``root``.

    Nothing changes for a backend without gloo (``backend``: torch's backend string of the
    group, e.g. ``gloo``, ``cpu:gloo,cuda:nccl``, ``nccl``).
    """
    if "gloo" not in backend.lower() and backend.lower() != "undefined":
        yield
        return
    from torch.distributed import distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if _SCOPE["cls"] is not None and base is _SCOPE["cls"]:  # nested: already in place
        base = base.__bases__[0]
    _SCOPE["devices"] = pooled(root)
    c10d.ProcessGroupGloo = _subclass(base)
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = base
        _SCOPE["devices"] = None
