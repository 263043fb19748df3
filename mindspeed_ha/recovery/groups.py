"""Rebuild every process group of a running job in place, and re-point every holder.

Why: on gloo an operation that one rank launched and a peer never joined leaves the
group's tag counters out of step, so the group can never be used again; fresh groups work
at once (shared/docs/CPU_BACKEND_FACTS.md, "In-process recovery on gloo", measured on
torch 2.13). An in-place recovery of a UCE or network fault (``HARuntime.recover``, plan
modes rollback, forward and reload) and a restarted worker's rejoin (ARF,
``HARuntime.rejoin_after_setup``: every rank, survivors included) therefore replace
*every* group this rank holds and swap every reference to an old group for its new one,
while the processes, the model and the optimizer stay alive.

How the new groups are made (:func:`rebuild_process_groups`):

* Which groups: every group of torch's registry (``distributed_c10d._world.pg_map``: the
  groups this rank is a member of, the default one included), less the ``exclude`` ones
  (e.g. the runtime's controller-lost fallback group, used concurrently by the processor
  thread) and less the groups a previous generation already retired.
* Same ranks (in the old group's rank order, from ``_world.pg_group_ranks``), same
  backend name (``_world.pg_map[old][0]``, so the same ``cpu:gloo,cuda:...`` config), same
  description (``group_desc``), same timeout (the old backend's ``options._timeout``;
  NCCL's ``is_high_priority_stream`` is copied too).
* Rendezvous: each new group is named ``<root>.ha<generation>`` where ``<root>`` is the
  old group's torch name (``_world.pg_names``) without an earlier ``.ha<n>`` suffix, and
  rendezvouses under that name in the first generation's default group's store (the
  store new_group uses, ``_world.pg_map[default][1]`` of the original default group:
  torchrun's TCPStore under torch's prefixes; see :func:`_root_store`). Only the
  members take part (local synchronisation). Why not ``dist.new_group``: with
  ``use_local_synchronization=True`` torch 2.13 names a group by the hash of its ranks
  (``_process_group_name``), so two groups with the same ranks (DP and DP-with-CP when
  CP=1, the gloo twins, WORLD and the fallback group) get the same name and the second
  raises "The specified group name has already been created" -- and a second rebuild
  would reuse the first's store keys; with global synchronisation every rank of the world
  would have to create every group of the world, which a rank cannot list (torch only
  registers the groups it is a member of) without an all-to-all exchange. The old name,
  by contrast, is the same on every member (the old group's own rendezvous used it as
  its store prefix) and distinct per rank for groups with equal ranks; with the
  generation it gives fresh store keys and distinct new groups. The groups are created
  through torch's own ``_new_process_group_helper`` (what ``new_group`` calls), then
  ``_world.pg_group_ranks`` is filled as ``_new_group_with_tag`` does.
* Order: every rank creates its groups sorted by new name, one total order for the whole
  job, so no rank waits on a group whose members wait on each other (the earliest
  incomplete group in that order has all its members at it).
* The new WORLD becomes the default with torch's ``_update_default_pg`` (also sets the
  C++ global rank), so ``group=None`` collectives and ``torch.distributed.barrier()``
  use it.
* The old groups are destroyed once every holder points at its successor
  (:func:`_retire`: ``destroy_process_group``, then the last reference dropped, on one
  thread per group: gloo's worker and event-loop threads end and its sockets close). A
  peer's abandoned op on an old group ends when its members close their copies in the
  same recovery (measured: ``Connection reset`` in the abandoned op, no wait). Only weak
  references and names are kept (:func:`retired_groups`, :func:`retired_names`,
  :func:`successor`).

How the references are swapped: by a walk from the known roots
(:mod:`mindspeed_ha.recovery.reachable`: the globals of megatron-core, Megatron-LM,
MindSpeed, this package and the training script, and the objects hanging off them: DDP
buckets, the optimizer through the runtime, Megatron's timers; 0.02-0.06 s on the tiny
job). Then the leak check: an old group still alive after its destruction is held
somewhere the walk did not reach, and only then the whole-heap walk of
:mod:`mindspeed_ha.recovery.holders` (the referrers plus the untracked tuples and dicts,
in chunks that let the rank's heartbeats through; 0.6-1.8 s; after a young collection,
never a full one: :func:`_swap_the_rest`) swaps the rest and names it in
``RebuildReport.unlisted`` and a warning.
A holder found but not changeable is listed in ``RebuildReport.unswapped``.
:func:`stale_holders` is the test-time check that nothing but torch's registries still
points at an old group. Cost on the tiny 4-rank job: 0.10-0.2 s per rebuild (creating 21
groups ~0.05-0.1 s, swapping ~0.02-0.06 s, destroying ~0.02-0.04 s; ``RebuildReport``).

Untested on NCCL/HCCL (no device here): NCCL may split new communicators from the default
group's when a device is bound.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import logging
import re
import time
from datetime import timedelta
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from mindspeed_ha.recovery import gloo_devices, holders, reachable
from mindspeed_ha.recovery.deferred import INTENDED_BACKENDS, intended_backend

log = logging.getLogger("mindspeed_ha.recovery.groups")

__all__ = ["INTENDED_BACKENDS", "RebuildReport", "rebuild_process_groups", "retired_groups",
           "retired_names", "stale_holders", "successor", "use_rendezvous_store"]

_SUFFIX = re.compile(r"\.ha\d+$")

#: one record per group a rebuild replaced on this rank, oldest first: (weak reference to the
#: old group, its torch name, the new group's name, generation). Holds no old group: a record
#: whose weak reference is still alive after the rebuild names a leak (:func:`retired_groups`).
_RETIRED: List[Tuple[Any, str, str, int]] = []
#: the store every generation rendezvouses in: the first default group's (see :func:`_root_store`)
_ROOT: Dict[str, Any] = {"store": None}


@dataclasses.dataclass
class RebuildReport:
    """What :func:`rebuild_process_groups` did on this rank.

    Attributes:
        generation: the generation the new groups carry in their names.
        groups_rebuilt: number of groups replaced (WORLD included).
        seconds: wall time of the whole call (s); ``create_seconds`` of it making groups.
        groups: ``"<old name> -> <new name> ranks [..] (<desc>)"`` per group.
        swapped: every reference changed, e.g. ``megatron.core.parallel_state._DATA_PARALLEL_GROUP``.
        unswapped: references to old groups that could not be changed (frames, tuples
            without writable holders, C-level objects).
        swap_seconds: of ``seconds``, re-pointing the holders; ``destroy_seconds``:
            destroying the old groups (their threads, sockets and buffers released).
        unlisted: holders the walk from the known roots (:mod:`mindspeed_ha.recovery
            .reachable`) did not reach, found and swapped by the whole-heap walk (the slow
            path, taken only when an old group was still held; logged).
    """

    generation: int
    groups_rebuilt: int
    seconds: float
    create_seconds: float
    groups: List[str]
    swapped: List[str]
    unswapped: List[str]
    swap_seconds: float = 0.0
    destroy_seconds: float = 0.0
    unlisted: List[str] = dataclasses.field(default_factory=list)


def rebuild_process_groups(generation: int, exclude: Iterable[Any] = (),
                           timeout: Optional[timedelta] = None) -> RebuildReport:
    """Replace every process group of this rank by a fresh one and swap every reference.

    Call on every rank of the job at the same point (all ranks alive, the default store
    alive), from the training thread, once every collective still in flight has been
    abandoned (never to be waited on again; a poisoned group's op may stay blocked in its
    gloo worker thread: harmless). Other threads may keep using the ``exclude`` groups.

    Args:
        generation: a number not used by an earlier rebuild of this job (it names the new
            groups and their store keys); the same on every rank.
        exclude: groups to leave alone (not rebuilt, references not swapped); the same
            groups on every rank (a group rebuilt on some members only never forms).
        timeout: bound on each new group's rendezvous (a member that does not come
            raises after it: measured 2.0 s for 2 s); None: the old group's timeout
            (Megatron's default is 10 minutes: pass one). The new groups' collectives keep
            the old groups' timeout either way.

    Returns:
        A :class:`RebuildReport`.

    Raises:
        RuntimeError: torch.distributed is not initialised, or a group could not be
            created (a member did not join within the timeout); the groups created so far
            stay registered, so a retry needs a new generation.
        ValueError: ``generation`` was already used on this rank.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("rebuild_process_groups: torch.distributed is not initialized")
    t0 = time.perf_counter()
    mapping, described = _new_generation(generation, exclude, timeout)
    t1 = time.perf_counter()
    swapped = reachable.swap_reachable(mapping)
    t2 = time.perf_counter()
    olds = _retire(mapping, generation)  # weak references: the old groups are destroyed
    t3 = time.perf_counter()
    unlisted, unswapped = _swap_the_rest(olds)
    return RebuildReport(generation=generation, groups_rebuilt=len(described),
                         seconds=time.perf_counter() - t0, create_seconds=t1 - t0,
                         groups=described, swapped=sorted(swapped + unlisted), unswapped=sorted(unswapped),
                         swap_seconds=t2 - t1 + (time.perf_counter() - t3), destroy_seconds=t3 - t2,
                         unlisted=sorted(unlisted))


def _new_generation(generation: int, exclude: Iterable[Any], timeout: Optional[timedelta]):
    """Create the new groups (the new WORLD made the default): ``(mapping, descriptions)``,
    ``mapping``: id(old) -> (old, new)."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    default = world.default_pg
    me = default.rank()
    if _ROOT["store"] is None and _OVERRIDE["endpoint"] is None:
        _ROOT["store"] = world.pg_map[default][1]  # the first generation's, kept for every later one
    mapping: Dict[int, Tuple[Any, Any]] = {}
    # the plan is a temporary: its tuples hold old groups and must not outlive the creation
    described = _create_generation(world, _plan(world, generation, exclude, me), me, timeout, mapping)
    for old, new in mapping.values():
        if old is default:
            _make_default(new)
    return mapping, described


def _retire(mapping: Dict[int, Tuple[Any, Any]], generation: int) -> List[Tuple[Any, Any]]:
    """Destroy every old group of ``mapping`` and empty it; returns ``[(weakref(old), new)]``
    (no old group held).

    Each old group is unregistered from torch (``torch.distributed.destroy_process_group``),
    then its last reference is dropped, which runs the backend's destructor: gloo's worker
    threads and its device's event-loop thread joined, its sockets closed. Each destructor
    waits up to one turn of gloo's event loop (about 10 ms for 21 groups measured here:
    0.40 s one after the other, 0.02 s in parallel), so the references are dropped on one
    short-lived thread per group; torch releases the GIL in a ProcessGroup's destructor. A
    destructor stays blocked while a peer's abandoned op on that group is open; it ends
    when the peer closes its copy in the same recovery. Waited for up to
    :data:`DESTROY_WAIT_S`, then left to finish on its (daemon) thread, logged.
    """
    import weakref

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    pairs = sorted(mapping.values(), key=lambda pair: str(world.pg_names[pair[1]]))
    mapping.clear()
    refs, box = [], []
    for old, new in pairs:
        old_name = str(world.pg_names[old])
        _RETIRED.append((weakref.ref(old), old_name, str(world.pg_names[new]), generation))
        try:
            dist.destroy_process_group(old)
        except Exception as exc:  # a backend without shutdown (e.g. a deferred group): unregister
            log.info("rebuild: %s could not be shut down (%s); dropped from torch's registries", old_name, exc)
            _unregister(world, old)
        refs.append((weakref.ref(old), new))
        box.append(old)
    del pairs, old, new
    _drop_in_parallel(box)
    return refs


#: how long a rebuild waits for the old groups' destructors (s); see :func:`_retire`
DESTROY_WAIT_S = 30.0


def _drop_in_parallel(box: List[Any]) -> None:
    """Drop every reference in ``box`` (the caller holds no other), one thread each."""
    import threading

    def drop(i: int) -> None:
        box[i] = None

    threads = [threading.Thread(target=drop, args=(i,), name=f"mindspeed-ha-destroy-{i}", daemon=True)
               for i in range(len(box))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + DESTROY_WAIT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    late = [t.name for t in threads if t.is_alive()]
    if late:
        log.warning("rebuild: %d old group(s) still closing after %.0f s (a peer's abandoned op is open); "
                    "left to finish in the background", len(late), DESTROY_WAIT_S)


def _unregister(world, pg) -> None:
    for registry in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                     world.pg_to_tag, world.pg_coalesce_state):
        registry.pop(pg, None)
    for members in world.tags_to_pg.values():
        while pg in members:
            members.remove(pg)


def _swap_the_rest(olds: List[Tuple[Any, Any]]) -> Tuple[List[str], List[str]]:
    """The leak check of a rebuild: an old group still alive is held by something the walk
    from the roots did not reach (or by a young reference cycle not yet collected). Then,
    once: a young-generation collection (``gc.collect(1)``), and the whole-heap walk
    (:mod:`mindspeed_ha.recovery.holders`, in chunks that let the rank's I/O thread run)
    swaps what is left, logged as a warning naming the holders and the seconds. Returns
    (swapped, unswapped).

    Never a full collection here: it is one C call that holds the GIL for the whole heap
    (0.5-6.0 s of wall time for 0.2-0.6 CPU-s, measured on the failover job's survivors
    beside two CPU hogs at load 20-58; heartbeats 5.4-6.1 s apart meanwhile). A holder inside an older unreachable
    cycle is swapped like any other (harmless), and the cycle is collected later.
    """
    if all(ref() is None for ref, _ in olds):
        return [], []
    t0 = time.perf_counter()
    gc.collect(1)
    alive = {id(old): (old, new) for old, new in ((ref(), new) for ref, new in olds) if old is not None}
    if not alive:
        return [], []
    swapped, unswapped = holders.swap(alive, _internal_ids(), holders.untracked_containers())
    log.warning("rebuild: %d replaced group(s) were held outside the known roots; swapped by the whole-heap "
                "walk (slow, %.2f s): %s%s", len(alive), time.perf_counter() - t0, sorted(swapped)[:8],
                f"; NOT swapped: {sorted(unswapped)[:8]}" if unswapped else "")
    alive.clear()
    return swapped, unswapped


def _plan(world, generation: int, exclude: Iterable[Any], me: int) -> List[Tuple[str, Any, List[int]]]:
    """``[(new name, old group, ranks)]`` of every group to rebuild, sorted by new name.

    Raises:
        ValueError: ``generation`` was already used on this rank.
    """
    skip = {id(g) for g in exclude}
    retired = {old_name for _, old_name, _, _ in _RETIRED}
    plan = []
    for old in list(world.pg_map):
        if id(old) in skip or str(world.pg_names[old]) in retired:
            continue
        name = f"{_SUFFIX.sub('', str(world.pg_names[old]))}.ha{generation}"
        rank_of = world.pg_group_ranks[old]
        plan.append((name, old, sorted(rank_of, key=rank_of.__getitem__)))
    plan.sort(key=lambda item: item[0])
    taken = set(map(str, world.pg_names.values()))
    reused = [name for name, _, _ in plan if name in taken]
    if reused:
        raise ValueError(f"rebuild_process_groups: generation {generation} already used on rank "
                         f"{me} (groups {reused[:3]} exist)")
    return plan


def _create_generation(world, plan: List[Tuple[str, Any, List[int]]], me: int, timeout: Optional[timedelta],
                       mapping: Dict[int, Tuple[Any, Any]]) -> List[str]:
    """Create the groups of ``plan`` in its order, filling ``mapping`` (id(old) -> (old, new));
    returns one description per group.

    Raises:
        RuntimeError: a group could not be created.
    """
    store = _root_store(world, world.default_pg)
    described = []
    for name, old, ranks in plan:
        try:
            new = _create_like(old, name, ranks, me, store, timeout)
        except Exception as exc:
            raise RuntimeError(f"rebuild_process_groups: rank {me} could not create {name} "
                               f"(ranks {ranks}) for {world.pg_names[old]}") from exc
        mapping[id(old)] = (old, new)
        described.append(f"{world.pg_names[old]} -> {name} ranks {ranks} ({getattr(old, 'group_desc', '')})")
    return described


def retired_groups() -> List[Any]:
    """Every group a rebuild replaced on this rank that is still alive (held by somebody:
    a leak, or a caller's own reference), oldest first. Empty after a clean rebuild: the
    records hold weak references only."""
    return [old for old in (ref() for ref, _, _, _ in _RETIRED) if old is not None]


def retired_names() -> List[Tuple[str, str, int]]:
    """``(old name, new name, generation)`` of every group a rebuild replaced, oldest first."""
    return [(old, new, gen) for _, old, new, gen in _RETIRED]


def successor(group: Any) -> Any:
    """The live group that replaced ``group`` (a group or its torch name, ``group_name``)
    through every rebuild since, or ``group`` itself."""
    from torch.distributed import distributed_c10d as c10d

    newer = {old: new for _, old, new, _ in _RETIRED}
    name = group if isinstance(group, str) else getattr(group, "group_name", None)
    if name not in newer:
        return group
    while name in newer:
        name = newer[name]
    live = {str(n): pg for pg, n in c10d._world.pg_names.items()}
    return live.get(name, group)


def stale_holders(old_groups: Iterable[Any]) -> List[str]:
    """Every object that still references one of ``old_groups``, described (the leak check).

    Not counted: torch.distributed's own registries, the ``old_groups`` container itself and
    this function's frame. Runs a full garbage collection first (unreachable cycles are not
    holders).
    """
    olds = list(old_groups)
    gc.collect()
    untracked = holders.untracked_containers()
    skip = _internal_ids() | {id(olds), id(old_groups), id(untracked)}
    return holders.describe_holders(olds, skip, untracked)


def _internal_ids() -> Set[int]:
    """ids of torch.distributed's registries and of this module's records (never swapped)."""
    from torch.distributed import distributed_c10d as c10d

    w = c10d._world
    ids = {id(w.pg_map), id(w.pg_names), id(w.pg_group_ranks), id(w.pg_backend_config),
           id(w.pg_to_tag), id(w.tags_to_pg), id(w.pg_coalesce_state), id(vars(w)), id(_RETIRED)}
    ids |= {id(lst) for lst in w.tags_to_pg.values()}
    return ids


# ---- where and how the new groups are made ------------------------------------------------

#: "host:port" of the TCPStore the rebuilds rendezvous in instead of the first generation's
#: store (set by :func:`use_rendezvous_store`), and the client made for it
_OVERRIDE: Dict[str, Any] = {"endpoint": None, "store": None}


def use_rendezvous_store(endpoint: Optional[str]) -> None:
    """Rendezvous the next rebuilds in the TCPStore at ``endpoint`` ("host:port"; None:
    the first generation's store again).

    After a controller failover the first generation's store (torchrun's, in node 0's
    agent) may be gone with node 0; the new leader's launcher hosts a store and names it
    in the recovery plan (RETRY ``store``), the same on every rank. The client connects
    at the next rebuild (on its thread).
    """
    if endpoint != _OVERRIDE["endpoint"]:
        _OVERRIDE.update(endpoint=endpoint, store=None)


def _override_store():
    endpoint = _OVERRIDE["endpoint"]
    if endpoint is None:
        return None
    if _OVERRIDE["store"] is None:
        import torch.distributed as dist

        host, port = endpoint.rsplit(":", 1)
        _OVERRIDE["store"] = dist.PrefixStore("mindspeed_ha/", dist.TCPStore(
            host.strip("[]"), int(port), is_master=False, timeout=timedelta(seconds=60)))
    return _OVERRIDE["store"]


def _root_store(world, default):
    """The store every generation rendezvouses in: the one of the first default group
    (its torch name without ``.ha<n>``), followed back through the retired generations;
    after a controller failover, the new leader's (:func:`use_rendezvous_store`).

    torch records a group's store as ``PrefixStore("<name>/", store)``: taking the current
    default's after a rebuild would nest every generation one prefix deeper
    (``0/0.ha1/0.ha2/...``), while a process restarted since (ARF) has the first
    generation's default and rendezvouses under ``0/0.ha2/``: they would never meet
    (found by a fresh-eyes test: a second recovery that rejoins a new process hung).
    """
    override = _override_store()
    if override is not None:
        return override
    return _ROOT["store"] if _ROOT["store"] is not None else world.pg_map[default][1]


def rendezvous_store():
    """The store the next rebuild rendezvouses in (:func:`_root_store`), for other groups
    every generation's members make (the hot switch's :class:`~.pair_link.PairLink`)."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    return _root_store(world, world.default_pg)


def _make_default(pg) -> None:
    """torch's own ``_update_default_pg`` (also sets the C++ global rank); else the field."""
    from torch.distributed import distributed_c10d as c10d

    update = getattr(c10d, "_update_default_pg", None)
    if update is not None:
        update(pg)
    else:  # torch without it (< 2.1): the default group is this one field
        c10d.GroupMember.WORLD = pg


def _timeout_of(pg, backend_name: str) -> timedelta:
    import torch
    from torch.distributed import distributed_c10d as c10d

    for device in pg._device_types:
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return c10d._get_default_timeout(backend_name)


def _options_like(pg) -> Any:
    """NCCL options carrying the old group's stream priority; None for other backends."""
    import torch

    try:
        from torch.distributed import ProcessGroupNCCL
        old = pg._get_backend(torch.device("cuda")).options
    except (ImportError, AttributeError, RuntimeError):
        return None
    if not isinstance(old, ProcessGroupNCCL.Options):
        return None
    opts = ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = old.is_high_priority_stream
    return opts


def _create_like(old, name: str, ranks: List[int], me: int, store, timeout: Optional[timedelta]):
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    intended = intended_backend(str(world.pg_names[old]))  # a deferred group (recovery/deferred.py)
    backend_name = intended[0] if intended else world.pg_map[old][0]
    keep = (intended and intended[1]) or _timeout_of(old, backend_name)
    helper = c10d._new_process_group_helper
    params = inspect.signature(helper).parameters  # torch < 2.4: pg_options, no group_desc
    kw: Dict[str, Any] = {"timeout": timeout or keep}
    kw["backend_options" if "backend_options" in params else "pg_options"] = _options_like(old)
    if "group_desc" in params:
        kw["group_desc"] = getattr(old, "group_desc", None)
    with gloo_devices.constructing(_SUFFIX.sub("", name), str(backend_name)):  # one device per root, kept
        new, _ = helper(len(ranks), ranks.index(me), ranks, backend_name, store, name, **kw)
    world.pg_group_ranks[new] = {g: i for i, g in enumerate(ranks)}
    if timeout is not None and timeout != keep and hasattr(new, "set_timeout"):
        new.set_timeout(keep)  # the rendezvous bound is not the collectives' timeout
    return new
