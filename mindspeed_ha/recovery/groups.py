"""Rebuild every process group of a running job in place, and re-point every holder.

Why: on gloo an operation that one rank launched and a peer never joined leaves the
group's tag counters out of step, so the group can never be used again; fresh groups work
at once (shared/docs/CPU_BACKEND_FACTS.md, "In-process recovery on gloo", measured on
torch 2.13). An in-place recovery (worker restart, hot switch, network recovery) therefore
replaces *every* group this rank holds and swaps every reference to an old group for its
new one, while the processes, the model and the optimizer stay alive.

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
* The old groups stay registered in torch (never destroyed): ``destroy_process_group``
  of a poisoned gloo group returned at once in a measurement here, but a gloo worker
  thread may still be blocked in the abandoned op, NCCL's destroy can be collective, and
  dropping the last reference runs the backend's destructor at an unknown point. They are
  also kept in this module (:func:`successor` follows them to their replacement).

How the references are swapped: the holders are the objects ``gc.get_referrers`` returns
for the old groups, plus the tuples and dicts the gc does not track (CPython untracks a
tuple or dict whose items are all untracked, and a pybind ProcessGroup is untracked: a
``(group, "x")`` tuple, ``functools.partial(f, group=g).keywords``), found by one pass over
the referents of every tracked object. Each holder is changed in place: an instance's
attribute (its ``__dict__`` or ``__slots__``), a dict's values and keys (order kept), a
list's items, a set's members, a closure cell; a tuple is rebuilt and swapped in *its*
holders the same way (three levels deep). Any list of groups is a holder too: a caller's
own list of the old groups is swapped like the rest (:func:`retired_groups` gives them).
Left alone: torch.distributed's own registries (``_world`` and its dicts), this module's
record of retired groups, and running functions' local variables (CPython 3.11's gc does
not report a frame's locals, measured; code that keeps a group in a local across the
rebuild keeps the old one -- call the getter again). A holder found but not changeable is
listed in ``RebuildReport.unswapped``. :func:`stale_holders` is the check that nothing but
torch's registries still points at an old group. Cost: the passes are O(objects in the
process): 0.2-0.3 s for the 0.4 M objects of a small megatron-core process on one idle
core here (``seconds - create_seconds`` in the report).

Holders in megatron-core 0.12 (.venv megatron/core, 0.12.3; line numbers there), all
found and swapped by the generic pass (the test proves none is left):

* ``parallel_state`` module globals (l.16-116): ``_TENSOR_MODEL_PARALLEL_GROUP``,
  ``_PIPELINE_MODEL_PARALLEL_GROUP``, ``_MODEL_PARALLEL_GROUP``, ``_EMBEDDING_GROUP``,
  ``_POSITION_EMBEDDING_GROUP``, ``_DATA_PARALLEL_GROUP`` and ``_GLOO``,
  ``_TENSOR_AND_DATA_PARALLEL_GROUP``, the expert groups (``_EXPERT_MODEL_PARALLEL_GROUP``,
  ``_EXPERT_TENSOR_PARALLEL_GROUP``, ``_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP``,
  ``_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP``, ``_EXPERT_DATA_PARALLEL_GROUP`` and
  ``_GLOO``), ``_CONTEXT_PARALLEL_GROUP``, the list ``_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS``,
  ``_DATA_PARALLEL_GROUP_WITH_CP`` and ``_GLOO``, ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP``
  and ``_GLOO``, ``_INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP``,
  ``_TENSOR_AND_CONTEXT_PARALLEL_GROUP``, ``_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP``.
* ``distributed/param_and_grad_buffer.py``: ``_ParamAndGradBucketGroup``
  ``.intra_distributed_optimizer_instance_group`` (l.118) or ``.data_parallel_group``
  (l.124), ``.inter_distributed_optimizer_instance_group`` (l.140, set by
  ``distributed_data_parallel.py`` l.215); ``_ParamAndGradBuffer.data_parallel_group``
  (l.487). ``DistributedDataParallel`` itself holds no group (it reaches them through
  ``buffers``/``bucket_groups`` and ``parallel_state``).
* ``optimizer/distrib_optimizer.py``: ``DistributedOptimizer.data_parallel_group`` and
  ``.data_parallel_group_gloo`` (l.500-501); ``optimizer/__init__.py`` l.421/425 sets
  ``grad_stats_parallel_group`` on every optimizer (``MegatronOptimizer`` reads it,
  ``optimizer.py`` l.169); ``ChainedOptimizer`` holds only its sub-optimizers.
* ``timers.py``: ``Timer._barrier_group`` (l.116/125; None, i.e. WORLD, unless
  ``set_barrier_group`` was called); Megatron-LM's ``megatron.training.global_vars
  ._GLOBAL_TIMERS`` is such a ``Timers`` (core_v0.12.1 ``global_vars.py`` l.242).
  Megatron-LM's training loop holds no group of its own (its legacy ``transformer.py``
  l.225 does: ``tp_ep_group``).
* Elsewhere in megatron-core (not used by GPT training here, same generic pass):
  ``token_dispatcher.py`` l.785, ``torch_fully_sharded_data_parallel.py`` l.76-78,
  ``custom_fsdp`` (``param_and_grad_buffer.py`` l.418/881-882,
  ``fully_sharded_data_parallel.py`` l.133-136), ``dist_checkpointing/strategies``
  (``fully_parallel.py`` l.80/177, ``two_stage.py`` l.102-103/160).
* mindspeed-ha: ``mindspeed_ha.patches.replica._INSTANCE_GROUP`` (module global).

Not reachable by any Python walk: groups held only in C++ (e.g. a pending ``Work``, torch
DDP's reducer). Untested on NCCL/HCCL (no device here): NCCL may split new communicators
from the default group's when a device is bound.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import operator
import re
import sys
import time
import types
from datetime import timedelta
from itertools import compress
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

_SUFFIX = re.compile(r"\.ha\d+$")
_TUPLE_DEPTH = 3
_UNTRACKABLE = frozenset((dict, tuple))  # the containers CPython may leave untracked by the gc
_NAMED = (dict, list, tuple, set, frozenset)  # holders named after their owner

#: (old, new, generation) of every group a rebuild replaced on this rank, oldest first.
#: Keeps the old groups alive (their destructor is never run mid-training) and lets
#: :func:`successor` map a stale reference to the live group.
_RETIRED: List[Tuple[Any, Any, int]] = []

#: group name -> (backend, timeout) asked for when the group was created deferred (a rejoining
#: process's start-up, ``recovery/rejoin.py``): the rebuild creates that backend, not the deferred one
INTENDED_BACKENDS: Dict[str, Tuple[str, Optional[timedelta]]] = {}


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
    """

    generation: int
    groups_rebuilt: int
    seconds: float
    create_seconds: float
    groups: List[str]
    swapped: List[str]
    unswapped: List[str]


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
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        raise RuntimeError("rebuild_process_groups: torch.distributed is not initialized")
    t0 = time.perf_counter()
    world = c10d._world
    default = world.default_pg
    me = default.rank()
    skip = {id(g) for g in exclude} | {id(old) for old, _, _ in _RETIRED}
    plan = []
    for old in list(world.pg_map):
        if id(old) in skip:
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
    store = _root_store(world, default)
    mapping: Dict[int, Tuple[Any, Any]] = {}  # id(old) -> (old, new): skipped by the swap
    described = []
    for name, old, ranks in plan:
        try:
            new = _create_like(old, name, ranks, me, store, timeout)
        except Exception as exc:
            raise RuntimeError(f"rebuild_process_groups: rank {me} could not create {name} "
                               f"(ranks {ranks}) for {world.pg_names[old]}") from exc
        mapping[id(old)] = (old, new)
        described.append(f"{world.pg_names[old]} -> {name} ranks {ranks} ({getattr(old, 'group_desc', '')})")
    create_s = time.perf_counter() - t0
    del plan  # its tuples hold old groups: not a holder to swap
    for old, new in mapping.values():
        if old is default:
            _make_default(new)
        _RETIRED.append((old, new, generation))
    swapped, unswapped = _swap(mapping, _internal_ids(), _untracked_containers(), 0)
    return RebuildReport(generation=generation, groups_rebuilt=len(described),
                         seconds=time.perf_counter() - t0, create_seconds=create_s,
                         groups=described, swapped=sorted(swapped), unswapped=sorted(unswapped))


def retired_groups() -> List[Any]:
    """Every group a rebuild replaced on this rank, oldest first (a new list: not swapped later).

    Note that a list of groups that a caller keeps *is* a holder: the next rebuild swaps
    its items for the new groups.
    """
    return [old for old, _, _ in _RETIRED]


def successor(group: Any) -> Any:
    """The live group that replaced ``group`` (through every rebuild since), or ``group``."""
    newer = {id(old): new for old, new, _ in _RETIRED}
    while id(group) in newer:
        group = newer[id(group)]
    return group


def stale_holders(old_groups: Iterable[Any]) -> List[str]:
    """Every object that still references one of ``old_groups``, described.

    Not counted: torch.distributed's own registries, this module's record of retired
    groups, the ``old_groups`` container itself and this function's frame. Runs a full
    garbage collection first (unreachable cycles are not holders).
    """
    olds = list(old_groups)
    gc.collect()
    untracked = _untracked_containers()
    skip = _internal_ids() | {id(olds), id(old_groups), id(untracked)}
    holders = _holders(olds, skip, untracked)
    where = _where(holders, skip)
    return sorted(_name(h, key, where) for h in holders for key in _keys_holding(h, set(map(id, olds))))


# ---- group creation ----------------------------------------------------------------------

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
    older = {id(new): old for old, new, _ in _RETIRED}
    root = default
    while id(root) in older:
        root = older[id(root)]
    return world.pg_map[root][1]


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
    intended = INTENDED_BACKENDS.get(str(world.pg_names[old]))  # a deferred group (recovery/rejoin.py)
    backend_name = intended[0] if intended else world.pg_map[old][0]
    keep = (intended and intended[1]) or _timeout_of(old, backend_name)
    helper = c10d._new_process_group_helper
    params = inspect.signature(helper).parameters  # torch < 2.4: pg_options, no group_desc
    kw: Dict[str, Any] = {"timeout": timeout or keep}
    kw["backend_options" if "backend_options" in params else "pg_options"] = _options_like(old)
    if "group_desc" in params:
        kw["group_desc"] = getattr(old, "group_desc", None)
    new, _ = helper(len(ranks), ranks.index(me), ranks, backend_name, store, name, **kw)
    world.pg_group_ranks[new] = {g: i for i, g in enumerate(ranks)}
    if timeout is not None and timeout != keep and hasattr(new, "set_timeout"):
        new.set_timeout(keep)  # the rendezvous bound is not the collectives' timeout
    return new


# ---- swapping references -----------------------------------------------------------------

def _internal_ids() -> Set[int]:
    """ids of torch.distributed's registries and of this module's records (never swapped)."""
    from torch.distributed import distributed_c10d as c10d

    w = c10d._world
    ids = {id(w.pg_map), id(w.pg_names), id(w.pg_group_ranks), id(w.pg_backend_config),
           id(w.pg_to_tag), id(w.tags_to_pg), id(w.pg_coalesce_state), id(vars(w)), id(_RETIRED)}
    ids |= {id(lst) for lst in w.tags_to_pg.values()}
    ids |= {id(rec) for rec in _RETIRED}
    return ids


def _is_args(obj, seq: List[Any]) -> bool:
    """``obj`` is the argument tuple of ``gc.get_referrers(*seq)`` (which sees it)."""
    return type(obj) is tuple and len(obj) == len(seq) and all(a is b for a, b in zip(obj, seq))


def _own_frame(obj) -> bool:
    return isinstance(obj, types.FrameType) and obj.f_globals is globals()


def _untracked(objs: List[Any]) -> List[Any]:
    """The tuples and dicts among ``objs`` that the gc does not track (C-level filters)."""
    typed = list(compress(objs, map(_UNTRACKABLE.__contains__, map(type, objs))))
    return list(compress(typed, map(operator.not_, map(gc.is_tracked, typed))))


def _untracked_containers() -> List[Any]:
    """Every untracked tuple/dict reachable from a tracked object through untracked ones.

    ``gc.get_referrers`` only sees objects the collector tracks, and CPython untracks a
    tuple or dict whose items are all untracked (atoms, and pybind objects such as a
    ProcessGroup): ``(group, "x")`` or ``functools.partial(f, group=g).keywords`` are
    invisible to it. One pass over the collector's objects finds them (about 0.1-0.3 s
    for the 0.4 M objects of a small megatron-core process here).
    """
    out: List[Any] = []
    seen: Set[int] = set()
    level = _untracked(gc.get_referents(*gc.get_objects()))
    while level:
        fresh = {id(c): c for c in level if id(c) not in seen}
        seen.update(fresh)
        out += fresh.values()
        level = _untracked(gc.get_referents(*fresh.values()))
    return out


def _holders(targets: List[Any], skip: Set[int], untracked: List[Any]) -> List[Any]:
    """Every object that references one of ``targets``: the gc's referrers, plus the
    ``untracked`` containers holding one (less ``skip`` and this module's frames)."""
    ids = set(map(id, targets))
    found = {id(h): h for h in gc.get_referrers(*targets) if not _is_args(h, targets)}
    for start in range(0, len(untracked), 1024):  # batched: most chunks hold none
        chunk = untracked[start:start + 1024]
        if not ids.isdisjoint(map(id, gc.get_referents(*chunk))):
            found.update((id(c), c) for c in chunk if not ids.isdisjoint(map(id, gc.get_referents(c))))
    skip = skip | {id(targets), id(untracked)}
    return [h for i, h in found.items() if i not in skip and not _own_frame(h)]


def _swap(mapping: Dict[int, Tuple[Any, Any]], skip: Set[int], untracked: List[Any],
          depth: int) -> Tuple[List[str], List[str]]:
    """Swap every reference to ``old`` for ``new`` (``mapping``: id(old) -> (old, new))."""
    olds = [old for old, _ in mapping.values()]
    skip = skip | {id(olds), id(mapping), id(untracked)} | {id(pair) for pair in mapping.values()}
    holders = _holders(olds, skip, untracked)
    where = _where(holders, skip)
    swapped: List[str] = []
    unswapped: List[str] = []
    tuples: Dict[int, Tuple[Any, Any]] = {}

    def sub(x):
        return mapping[id(x)][1] if id(x) in mapping else x

    for h in holders:
        keys = _keys_holding(h, mapping)
        if not keys:
            continue
        names = [_name(h, k, where) for k in keys]
        if isinstance(h, dict):
            if any(k is not None and id(k) in mapping for k in h):
                items = list(h.items())
                h.clear()
                h.update((sub(k), sub(v)) for k, v in items)
                del items
            else:
                for k in keys:
                    h[k] = sub(h[k])
        elif isinstance(h, list):
            for i in keys:
                h[i] = sub(h[i])
        elif isinstance(h, set):
            for old in [x for x in h if id(x) in mapping]:
                h.discard(old)
                h.add(sub(old))
        elif isinstance(h, types.CellType):
            h.cell_contents = sub(h.cell_contents)
        elif isinstance(h, tuple) and depth < _TUPLE_DEPTH:
            tuples[id(h)] = (h, tuple(sub(x) for x in h))
            continue  # reported by the recursion through the tuple's holders
        elif isinstance(h, (tuple, frozenset, types.FrameType)) or keys == [None]:
            unswapped += names
            continue
        else:  # an instance: its inline __dict__ values (CPython >= 3.11) or __slots__
            attrs = _attrs(h)
            for k in keys:
                if k in attrs:
                    attrs[k] = sub(attrs[k])
                else:
                    setattr(h, k, sub(getattr(h, k)))
        swapped += names
    if tuples:
        s, u = _swap(tuples, skip | {id(holders), id(tuples)}, untracked, depth + 1)
        swapped += [n if n.endswith(" (tuple rebuilt)") else f"{n} (tuple rebuilt)" for n in s]
        unswapped += [n if n.endswith(" (tuple)") else f"{n} (tuple)" for n in u]
        if not s and not u:
            unswapped += [f"tuple {_name(h, None, {})} with no holder seen" for h, _ in tuples.values()]
    return swapped, unswapped


def _slot_holder(obj) -> bool:
    return any("__slots__" in vars(cls) for cls in type(obj).__mro__[:-1])


def _slot_names(obj) -> List[str]:
    names = []
    for cls in type(obj).__mro__[:-1]:
        slots = vars(cls).get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return names


def _keys_holding(h, ids) -> List[Any]:
    """Where ``h`` holds one of ``ids``: dict keys/values, list indexes, slot names..."""
    if isinstance(h, dict):
        return [k for k, v in list(h.items()) if id(v) in ids or id(k) in ids]
    if isinstance(h, (list, tuple)):
        return [i for i, x in enumerate(h) if id(x) in ids]
    if isinstance(h, (set, frozenset)):
        return [None] if any(id(x) in ids for x in h) else []
    if isinstance(h, types.CellType):
        try:
            return [None] if id(h.cell_contents) in ids else []
        except ValueError:  # empty cell
            return []
    if isinstance(h, types.FrameType):
        return [k for k, v in h.f_locals.items() if id(v) in ids] or [None]
    held = [k for k, v in _attrs(h).items() if id(v) in ids]
    if _slot_holder(h):
        held += [k for k in _slot_names(h) if id(getattr(h, k, None)) in ids]
    return held or [None]


def _attrs(obj) -> Dict[str, Any]:
    """The instance's own ``__dict__`` (writable), or {} (none, or a class's mappingproxy)."""
    try:
        d = object.__getattribute__(obj, "__dict__")
    except Exception:  # no __dict__, or a C type raising something else
        return {}
    return d if type(d) is dict else {}


def _where(holders: List[Any], ignore: Set[int]) -> Dict[int, str]:
    """id(container) -> a readable path: 'pkg.module', 'Class' (an instance's __dict__),
    'pkg.module.NAME', 'Class.attr', 'owner[key]' (two levels of owners, batched gc passes)."""
    where = {id(m.__dict__): name for name, m in list(sys.modules.items()) if m is not None}
    parent: Dict[int, Tuple[Any, Any]] = {}  # id(child) -> (owner dict/list, key)
    todo = [h for h in holders if id(h) not in where and isinstance(h, _NAMED)]
    for _ in range(2):
        if not todo:
            break
        targets = {id(h) for h in todo}
        mine = {id(holders), id(todo), id(parent)} | set(map(id, parent.values()))
        nxt = []
        for owner in gc.get_referrers(*todo):
            if (id(owner) in mine or id(owner) in ignore or _is_args(owner, todo)
                    or isinstance(owner, (types.FrameType, types.MappingProxyType))):
                continue
            if isinstance(owner, (dict, list)):
                items = list(owner.items()) if isinstance(owner, dict) else list(enumerate(owner))
                held = [(k, v) for k, v in items if id(v) in targets]
                del items
                for k, v in held:
                    parent.setdefault(id(v), (owner, k))
                if held and id(owner) not in where:
                    nxt.append(owner)
                continue
            attrs = _attrs(owner)
            label = type(owner).__qualname__
            if id(attrs) in targets:
                where.setdefault(id(attrs), label)
            named = [where.setdefault(id(v), f"{label}.{k}")
                     for k, v in list(attrs.items()) if id(v) in targets]
            if not named and id(attrs) not in targets:  # e.g. functools.partial.keywords
                for v in gc.get_referents(owner):
                    if id(v) in targets:
                        where.setdefault(id(v), label)
        todo = nxt
    for _ in range(3):  # children of owners named above
        for child, (owner, key) in parent.items():
            if child not in where and id(owner) in where:
                where[child] = _name(owner, key, where)
    for child, (owner, key) in parent.items():
        where.setdefault(child, _name(owner, key, {}))
    return where


def _name(h, key, where: Dict[int, str]) -> str:
    base = where.get(id(h))
    if isinstance(h, dict):
        base = base or "dict"
        if isinstance(key, str) and base != "dict":
            return f"{base}.{key}"
        shown = f"<group {key.group_name}>" if hasattr(key, "group_name") else repr(key)
        return f"{base}[{shown}]"
    if isinstance(h, (list, tuple)):
        return f"{base or type(h).__name__}[{key}]"
    if isinstance(h, types.FrameType):
        code = h.f_code
        return f"local {key!r} of {code.co_qualname} ({code.co_filename}:{h.f_lineno})"
    if isinstance(h, types.CellType):
        return "closure cell"
    if isinstance(h, (set, frozenset)):
        return f"{base or type(h).__name__} (member)"
    if key is not None:
        return f"{type(h).__qualname__}.{key}"
    return f"{base or type(h).__qualname__} at {id(h):#x}"
