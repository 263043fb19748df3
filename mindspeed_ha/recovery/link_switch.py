"""Link switch (``mindspeed-ha relink``): rebuild every process group with chosen ranks'
communication bound to another interface or address, while the job holds in a graceful
pause; and back.

Not the agent's ``relink`` to a new controller leader (``launch/survivors.py``): this one
moves the ranks' collective traffic (the reference's "link switch-back", MindIO TFT with
``torch_npu.npu._comm_switch_nic``, RoCE on Atlas A3 only).

How (every rank, on its training thread, :func:`switch_links`):

1. Pre-flight: each rank to move makes the binding it will use (gloo: a device,
   ``ProcessGroupGloo.create_device(hostname=A)`` or ``(interface=I)``); every rank agrees over
   the current world group (one all-reduce MIN of one int) that all moving ranks can. A rank
   that cannot (an address that is not local: "Cannot resolve ... to a (local) address")
   fails the relink on every rank before any group changed: code 2, nothing to switch back.
2. Rebuild (:func:`~mindspeed_ha.recovery.groups.rebuild_process_groups`, generation chosen
   by the controller, the start-up fallback group kept) with the binding in force on the
   moving ranks only (:func:`bound`): each gloo group gets its pooled device made for the
   binding (:mod:`mindspeed_ha.recovery.gloo_devices`); once committed, every later rebuild
   of this rank (an in-place recovery, a rejoin, a switch) keeps the binding; for NCCL / HCCL the
   scope sets ``NCCL_SOCKET_IFNAME`` / ``HCCL_SOCKET_IFNAME`` (and ``NCCL_IB_HCA`` when
   given). Untested on NCCL / HCCL (no device here): NCCL reads its socket interface when
   it initialises its network in the process, so a new communicator may keep the old one.
3. A rebuild that fails (a member never came within the budget) leaves the old groups in
   use (the swap comes after every group was made): the partial new groups of this
   generation are destroyed, and every rank rebuilds once more, generation + 1, without
   the new binding (the previous one in force): the relink "switches back by itself",
   reported with code 2 and ``switched_back``.

``back``: the moving ranks return to the binding they had at start (none: the default device).
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta
from typing import Any, Dict, Iterable, Iterator, List, Optional

from mindspeed_ha.recovery import gloo_devices

log = logging.getLogger("mindspeed_ha.recovery.groups")

ENV_OF_IFACE = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME")


def current() -> Optional[Dict[str, str]]:
    """The binding of this rank's groups: ``{"addr": A}`` / ``{"iface": I}``, None: the original."""
    return gloo_devices.committed()


#: the gloo device of a binding (RuntimeError, torch's, when it cannot bind)
make_device = gloo_devices.make_device


@contextlib.contextmanager
def bound(binding: Optional[Dict[str, str]]) -> Iterator[None]:
    """Inside: the process groups a rebuild creates on this rank use ``binding`` (None: the
    default): gloo groups get their pooled device for it
    (:mod:`mindspeed_ha.recovery.gloo_devices`), NCCL / HCCL read the interface variables."""
    saved = {k: os.environ.get(k) for k in ENV_OF_IFACE + ("NCCL_IB_HCA",)}
    try:
        with gloo_devices.trying(binding):
            if binding and binding.get("iface"):
                for k in ENV_OF_IFACE[1:]:
                    os.environ[k] = binding["iface"]
            if binding and binding.get("hca"):
                os.environ["NCCL_IB_HCA"] = binding["hca"]
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def tcp_endpoints() -> set:
    """(status, (local ip, port), (remote ip, port) or None) of this process's TCP sockets:
    established and listening (psutil)."""
    import psutil

    return {(c.status, (c.laddr.ip, c.laddr.port), (c.raddr.ip, c.raddr.port) if c.raddr else None)
            for c in psutil.Process().net_connections(kind="tcp")
            if c.status in (psutil.CONN_ESTABLISHED, psutil.CONN_LISTEN)}


def _addrs(endpoints, status: str) -> List[str]:
    return sorted({lo[0] for st, lo, _ in endpoints if st == status})


def _agree(ok: bool) -> bool:
    import torch
    import torch.distributed as dist

    from mindspeed_ha.accelerator import collective_device

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=collective_device(None))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _drop_partial(generation: int) -> List[str]:
    """Destroy this rank's groups of ``generation`` that a failed rebuild left registered."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world, gone = c10d._world, []
    for pg, name in list(world.pg_names.items()):
        if str(name).endswith(f".ha{generation}") and pg is not world.default_pg:
            try:
                dist.destroy_process_group(pg)
            except (RuntimeError, ValueError) as exc:
                log.warning("link switch: could not destroy the partial group %s: %s", name, exc)
            gone.append(str(name))
    return gone


def switch_links(rank: int, moving: Iterable[int], binding: Optional[Dict[str, str]], generation: int,
                 exclude: Iterable[Any] = (), timeout_s: float = 60.0, inject_failure: bool = False):
    """Rebuild every group with ``moving`` ranks bound to ``binding`` (None: back to the
    original); call on every rank with the same arguments. Returns (code, detail, result):
    0 ok; 2 failed (``switched_back`` says whether the groups were rebuilt as before).

    ``inject_failure``: a test double: this rank fails its rebuild (raises before making
    any group; the others' rendezvous time out after ``timeout_s``).
    """
    from mindspeed_ha.recovery import groups

    me_moves = rank in set(moving)
    mine = binding if me_moves else None
    before = current()
    ok, why = True, ""
    if me_moves and binding:
        try:
            make_device(binding)
        except RuntimeError as exc:
            ok, why = False, f"rank {rank} cannot bind {binding}: {exc}"
    if not _agree(ok):
        return 2, why or "another rank cannot bind its new address; no group changed", \
            {"bound": before, "switched_back": False, "rebuilt": False}
    timeout = timedelta(seconds=timeout_s)
    conns = tcp_endpoints()
    try:
        with bound(mine if me_moves else before):
            if inject_failure:
                raise RuntimeError("injected rebuild failure (test double)")
            report = groups.rebuild_process_groups(generation, exclude=list(exclude), timeout=timeout)
    except (RuntimeError, ValueError) as exc:
        dropped = _drop_partial(generation)
        log.error("link switch: rank %d: rebuild of generation %d failed (%s); %d partial groups destroyed; "
                  "switching back", rank, generation, exc, len(dropped))
        with bound(before):
            report = groups.rebuild_process_groups(generation + 1, exclude=list(exclude), timeout=timeout)
        return 2, f"rebuild failed on rank {rank}: {exc}; switched back", \
            {"bound": before, "switched_back": True, "rebuilt": True, "groups": report.groups_rebuilt,
             "rebuild_seconds": round(report.seconds, 6)}
    if me_moves:
        gloo_devices.commit(binding)
    now = tcp_endpoints()
    return 0, "", {"bound": current(), "switched_back": False, "rebuilt": True, "groups": report.groups_rebuilt,
                   "rebuild_seconds": round(report.seconds, 6),
                   # the evidence: where this rank's gloo devices listen now (the address peers reach
                   # it at), and the local addresses of its connections (new ones and all)
                   "listen_addrs": _addrs(now, "LISTEN"),
                   "new_local_addrs": _addrs(now - conns, "ESTABLISHED"),
                   "local_addrs": _addrs(now, "ESTABLISHED")}


__all__ = ["bound", "current", "make_device", "switch_links"]
