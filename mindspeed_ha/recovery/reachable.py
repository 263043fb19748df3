"""Swap the references to replaced process groups that are reachable from the known roots.

Why: a group rebuild (:func:`mindspeed_ha.recovery.groups.rebuild_process_groups`) must
re-point every holder of an old group at its new one. Walking the whole heap to find them
(:mod:`mindspeed_ha.recovery.holders`: ``gc.get_referrers`` plus a pass over the referents
of every tracked object) costs 0.6-1.8 s on the 0.4 M objects of the tiny 4-rank
megatron-core job (measured here, beside other load): more than the rest of a recovery.
The holders are in few places (listed in :mod:`mindspeed_ha.recovery.holders`): module
globals of megatron-core, Megatron-LM, MindSpeed and this package, and the objects hanging
off them (the DDP model chunks and the optimizer, reachable from the runtime, Megatron's
timers). This module walks only that graph: one pass over the objects reachable from

* the globals of every loaded module whose name starts with one of :data:`PREFIXES`
  (``megatron``, ``mindspeed`` (``mindspeed_ha``, ``mindspeed_llm`` included), ``patches``,
  and ``__main__``, the training script), and of the modules :func:`add_prefix` names;
* through dicts (keys and values), lists, tuples, sets, ``functools.partial`` objects,
  closure cells of functions, and the attributes (``__dict__``, ``__slots__``) of instances
  of classes defined in those modules or of ``torch.nn.Module`` (the model tree);
* never into tensors, classes, modules, or instances of other libraries' classes.

Each reference found is changed in place (a tuple is rebuilt and replaced in its holder, a
partial's arguments through ``__setstate__``). What this walk cannot reach (a group held
by another library's object or only by a running frame) is found afterwards by the
rebuild's leak check (a weak reference to each old group that is still alive), which then
runs the whole-heap walk for that rebuild and logs where the group was held.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Dict, List, Tuple

__all__ = ["PREFIXES", "add_prefix", "swap_reachable"]

#: module name prefixes whose globals are roots, and whose classes' instances are walked
PREFIXES: List[str] = ["megatron", "mindspeed", "patches", "__main__"]

_ATOMS = frozenset((str, bytes, int, float, bool, complex, type(None), range, slice,
                    types.ModuleType, types.BuiltinFunctionType, types.MethodType,
                    types.MethodWrapperType, types.WrapperDescriptorType, property,
                    staticmethod, classmethod))


def add_prefix(prefix: str) -> None:
    """Walk the globals and the instances of the modules named ``prefix...`` too (a user
    package that keeps process groups, e.g. a custom model holding its TP group).

    Raises:
        ValueError: ``prefix`` is empty.
    """
    if not prefix:
        raise ValueError("add_prefix: the module name prefix must not be empty")
    if prefix not in PREFIXES:
        PREFIXES.append(prefix)


class _Walk:
    """One swap pass; ``swapped`` names every reference changed (``module.NAME[key].attr``)."""

    def __init__(self, mapping: Dict[int, Tuple[Any, Any]], prefixes: Tuple[str, ...]):
        import torch

        self.mapping = mapping
        self.prefixes = prefixes
        self.tensor = torch.Tensor
        self.nn_module = torch.nn.Module
        self.seen: set = set()
        self.tuples: Dict[int, Any] = {}  # id(old tuple) -> its rebuilt copy (or itself)
        self.path: List[str] = []
        self.swapped: List[str] = []

    # a value: its replacement, or None when it stays
    def value(self, x: Any, key: str) -> Any:
        t = type(x)
        if t in _ATOMS:
            return None
        i = id(x)
        pair = self.mapping.get(i)
        if pair is not None:
            self.swapped.append("".join(self.path) + key)
            return pair[1]
        if t is tuple:
            return self._tuple(x, key)
        if i in self.seen:
            return None
        self.seen.add(i)
        self.path.append(key)
        try:
            if isinstance(x, dict):
                self._dict(x)
            elif t is list:
                self._list(x)
            elif t is set:
                self._set(x)
            elif t is functools.partial:
                self._partial(x)
            elif t is types.FunctionType:
                self._closure(x)
            elif isinstance(x, (type, self.tensor)):
                pass
            elif isinstance(x, self.nn_module) or str(getattr(t, "__module__", "")).startswith(self.prefixes):
                self._instance(x)
        finally:
            self.path.pop()
        return None

    def _tuple(self, x: tuple, key: str) -> Any:
        i = id(x)
        if i not in self.tuples:
            self.tuples[i] = x  # a cycle through this tuple sees it unchanged
            self.path.append(key)
            new = [self.value(v, f"[{n}]") for n, v in enumerate(x)]
            self.path.pop()
            if any(v is not None for v in new):
                self.tuples[i] = tuple(x[n] if v is None else v for n, v in enumerate(new))
                self.swapped.append("".join(self.path) + key + " (tuple rebuilt)")
        out = self.tuples[i]
        return None if out is x else out

    def _dict(self, d: dict) -> None:
        items = list(d.items())
        changed = False
        new_items = []
        for k, v in items:
            nk = self.value(k, f"[<key {type(k).__name__}>]") if type(k) not in _ATOMS else None
            nv = self.value(v, f".{k}" if type(k) is str else f"[{k!r}]" if type(k) in _ATOMS else "[..]")
            changed |= nk is not None
            new_items.append((k if nk is None else nk, v if nv is None else nv, nv is not None))
        if changed:  # a key replaced: rebuild in order
            d.clear()
            d.update((k, v) for k, v, _ in new_items)
        else:
            for k, v, hit in new_items:
                if hit:
                    d[k] = v

    def _list(self, lst: list) -> None:
        for n, v in enumerate(list(lst)):
            nv = self.value(v, f"[{n}]")
            if nv is not None:
                lst[n] = nv

    def _set(self, s: set) -> None:
        for v in list(s):
            nv = self.value(v, " (member)")
            if nv is not None:
                s.discard(v)
                s.add(nv)

    def _partial(self, p: functools.partial) -> None:
        args = self.value(p.args, ".args")
        if p.keywords:
            self._dict(p.keywords)
        if args is not None:
            p.__setstate__((p.func, args, p.keywords, p.__dict__ or None))

    def _closure(self, fn: types.FunctionType) -> None:
        for cell in fn.__closure__ or ():
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            nv = self.value(v, f" closure cell of {fn.__qualname__}")
            if nv is not None:
                cell.cell_contents = nv

    def _instance(self, obj: Any) -> None:
        label = f"<{type(obj).__qualname__}>"
        self.path.append(label)
        try:
            d = getattr(obj, "__dict__", None)
            if type(d) is dict:
                for k, v in list(d.items()):
                    nv = self.value(v, f".{k}")
                    if nv is not None:
                        d[k] = nv
            for name in _slot_names(type(obj)):
                try:
                    v = object.__getattribute__(obj, name)
                except AttributeError:
                    continue
                nv = self.value(v, f".{name}")
                if nv is not None:
                    object.__setattr__(obj, name, nv)
        finally:
            self.path.pop()


@functools.lru_cache(maxsize=None)
def _slot_names(cls: type) -> Tuple[str, ...]:
    names: List[str] = []
    for c in cls.__mro__[:-1]:
        slots = vars(c).get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if s not in ("__dict__", "__weakref__")]
    return tuple(names)


def swap_reachable(mapping: Dict[int, Tuple[Any, Any]]) -> List[str]:
    """Swap every reference to an old object reachable from the roots (module docstring)
    for its new one; ``mapping``: id(old) -> (old, new). Returns the references changed,
    e.g. ``megatron.core.parallel_state._DATA_PARALLEL_GROUP``, sorted."""
    prefixes = tuple(PREFIXES)
    walk = _Walk(mapping, prefixes)
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefixes):
            continue
        d = getattr(module, "__dict__", None)
        if type(d) is not dict or id(d) in walk.seen:
            continue
        walk.seen.add(id(d))
        walk.path.append(name)
        try:
            walk._dict(d)
        finally:
            walk.path.pop()
    return sorted(walk.swapped)
