"""Find and swap every Python reference to some objects: the whole-heap holder walk.

A group rebuild first swaps what :mod:`mindspeed_ha.recovery.reachable` reaches from the
known roots (fast); this walk runs only when an old group is still held afterwards (its
weak reference alive), and at test time to prove that nothing is left (``stale_holders``).

Why: :func:`mindspeed_ha.recovery.groups.rebuild_process_groups` replaces every process
group of a rank while the model, the optimizer and Megatron's ``parallel_state`` stay
alive, so every reference to an old group must point at its new one afterwards. Nobody
registers their groups; this module finds them generically.

How the references are swapped (:func:`swap`): the holders are the objects
that reference the old objects (what ``gc.get_referrers`` returns), plus the tuples and dicts the gc does not
track (CPython untracks a tuple or dict whose items are all untracked, and a pybind
ProcessGroup is untracked: a ``(group, "x")`` tuple, ``functools.partial(f, group=g)
.keywords``), found by one pass over the referents of every tracked object
(:func:`untracked_containers`). Each holder is changed in place: an instance's attribute
(its ``__dict__`` or ``__slots__``), a dict's values and keys (order kept), a list's items,
a set's members, a closure cell; a tuple is rebuilt and swapped in *its* holders the same
way (three levels deep). Any list of the old objects is a holder too: a caller's own list is
swapped like the rest. Left alone: the ``skip`` containers the caller names (torch's
registries, the record of retired groups), and running functions' local variables (CPython
3.11's gc does not report a frame's locals, measured; code that keeps a group in a local
across the rebuild keeps the old one -- call the getter again). A holder found but not
changeable is returned as unswapped. :func:`describe_holders` names what still holds the
old objects (the leak check). Cost: the passes are O(objects in the process): 0.2-0.3 s
for the 0.4 M objects of a small megatron-core process on one idle core here, made
:data:`CHUNK` objects per gc call (:func:`referrers`) so that the GIL changes hands between
two (a whole-heap ``gc.get_referrers`` kept the rank's heartbeat thread waiting for all of
it). A finished frame of the rebuild (kept by a failed attempt's exception) is a holder;
only the running frames of the walk and the rebuild are left out.

Holders in megatron-core 0.12 (.venv megatron/core, 0.12.3; line numbers there), all
found and swapped by the generic pass (tests/test_groups_rebuild.py proves none is left):

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
DDP's reducer).
"""

from __future__ import annotations

import gc
import operator
import sys
import types
from itertools import compress
from typing import Any, Callable, Dict, List, Set, Tuple

_TUPLE_DEPTH = 3
_UNTRACKABLE = frozenset((dict, tuple))  # the containers CPython may leave untracked by the gc
_NAMED = (dict, list, tuple, set, frozenset)  # holders named after their owner
#: modules whose running frames are never holders (the walk's own and the rebuild's)
_WALKERS = frozenset((__name__, "mindspeed_ha.recovery.groups"))
#: objects per gc call of a walk. A gc call is one C loop that holds the GIL throughout;
#: between two, the interpreter hands the GIL to a thread that asked for it (within
#: ``sys.getswitchinterval()``), so the rank's I/O thread keeps sending heartbeats during a
#: walk. One call over the whole heap (``gc.get_referrers``, ``gc.get_referents(*gc.get_objects())``)
#: held it 0.1-0.3 CPU-s on the tiny job, seconds of wall time in a process starved of CPU.
CHUNK = 4096


def _running() -> Set[int]:
    """ids of the frames on this thread's stack."""
    out, f = set(), sys._getframe()
    while f is not None:
        out.add(id(f))
        f = f.f_back
    return out


def _own_frame(obj, running: Set[int]) -> bool:
    """A running frame of the walk or the rebuild (a finished one, e.g. kept by an
    exception's traceback, is a holder like any other)."""
    return (isinstance(obj, types.FrameType) and id(obj) in running
            and obj.f_globals.get("__name__") in _WALKERS)


def _chunks(objs: List[Any]):
    for start in range(0, len(objs), CHUNK):
        yield objs[start:start + CHUNK]


def referrers(targets: List[Any], among: Any = None) -> List[Any]:
    """What ``gc.get_referrers(*targets)`` returns (the tracked objects that reference one of
    ``targets``; ``among``: those of this list only), found :data:`CHUNK` objects per gc call
    so that other threads run meanwhile. Objects made during the call are not seen."""
    ids = set(map(id, targets))
    found: List[Any] = []
    for chunk in _chunks(gc.get_objects() if among is None else among):
        if not ids.isdisjoint(map(id, gc.get_referents(*chunk))):  # most chunks hold none
            found += [o for o in chunk if not ids.isdisjoint(map(id, gc.get_referents(o)))]
    return found


def _untracked(objs: List[Any]) -> List[Any]:
    """The tuples and dicts among ``objs`` that the gc does not track (C-level filters)."""
    typed = list(compress(objs, map(_UNTRACKABLE.__contains__, map(type, objs))))
    return list(compress(typed, map(operator.not_, map(gc.is_tracked, typed))))


def untracked_containers() -> List[Any]:
    """Every untracked tuple/dict reachable from a tracked object through untracked ones.

    ``gc.get_referrers`` only sees objects the collector tracks, and CPython untracks a
    tuple or dict whose items are all untracked (atoms, and pybind objects such as a
    ProcessGroup): ``(group, "x")`` or ``functools.partial(f, group=g).keywords`` are
    invisible to it. One pass over the collector's objects finds them (about 0.1-0.3 s
    for the 0.4 M objects of a small megatron-core process here).
    """
    out: List[Any] = []
    seen: Set[int] = set()
    level = [c for chunk in _chunks(gc.get_objects()) for c in _untracked(gc.get_referents(*chunk))]
    while level:
        fresh = {id(c): c for c in level if id(c) not in seen}
        seen.update(fresh)
        out += fresh.values()
        level = [c for chunk in _chunks(list(fresh.values())) for c in _untracked(gc.get_referents(*chunk))]
    return out


def _holders(targets: List[Any], skip: Set[int], untracked: List[Any]) -> List[Any]:
    """Every object that references one of ``targets``: the gc's referrers, plus the
    ``untracked`` containers holding one (less ``skip`` and the walkers' frames)."""
    found = {id(h): h for h in referrers(targets)}
    found.update((id(c), c) for c in referrers(targets, among=untracked))
    skip = skip | {id(targets), id(untracked)}
    running = _running()
    return [h for i, h in found.items() if i not in skip and not _own_frame(h, running)]


def describe_holders(targets: List[Any], skip: Set[int], untracked: List[Any]) -> List[str]:
    """Every reference to one of ``targets`` outside the ``skip`` containers, described
    (e.g. ``megatron.core.parallel_state._DATA_PARALLEL_GROUP``), sorted."""
    holders = _holders(targets, skip, untracked)
    where = _where(holders, skip)
    return sorted(_name(h, key, where) for h in holders for key in _keys_holding(h, set(map(id, targets))))


def swap(mapping: Dict[int, Tuple[Any, Any]], skip: Set[int], untracked: List[Any],
         depth: int = 0) -> Tuple[List[str], List[str]]:
    """Swap every reference to ``old`` for ``new`` (``mapping``: id(old) -> (old, new)),
    outside the ``skip`` containers (ids). Returns (swapped, unswapped), each a list of
    the references described."""
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
        if isinstance(h, tuple) and depth < _TUPLE_DEPTH:
            tuples[id(h)] = (h, tuple(sub(x) for x in h))
            continue  # reported by the recursion through the tuple's holders
        if isinstance(h, (tuple, frozenset, types.FrameType)) or (keys == [None] and not _container(h)):
            unswapped += names
            continue
        _swap_in(h, keys, mapping, sub)
        swapped += names
    if tuples:
        s, u = swap(tuples, skip | {id(holders), id(tuples)}, untracked, depth + 1)
        swapped += [n if n.endswith(" (tuple rebuilt)") else f"{n} (tuple rebuilt)" for n in s]
        unswapped += [n if n.endswith(" (tuple)") else f"{n} (tuple)" for n in u]
        if not s and not u:
            unswapped += [f"tuple {_name(h, None, {})} with no holder seen" for h, _ in tuples.values()]
    return swapped, unswapped


def _container(h) -> bool:
    """A dict, list, set or cell: :func:`_swap_in` changes it whatever its keys (an
    instance whose only key is None holds the object where no attribute shows it)."""
    return isinstance(h, (dict, list, set, types.CellType))


def _swap_in(h, keys: List[Any], mapping: Dict[int, Tuple[Any, Any]], sub: Callable[[Any], Any]) -> None:
    """Change holder ``h`` in place at ``keys``: every old object becomes ``sub(old)``."""
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
    else:  # an instance: its inline __dict__ values (CPython >= 3.11) or __slots__
        attrs = _attrs(h)
        for k in keys:
            if k in attrs:
                attrs[k] = sub(attrs[k])
            else:
                setattr(h, k, sub(getattr(h, k)))


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
        for owner in referrers(todo):
            if (id(owner) in mine or id(owner) in ignore
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
