"""Patch registry: every monkey-patch mindspeed-ha applies, declared as data.

A :class:`Patch` names its target (``module`` + dotted ``attribute``), the wrapper
(a ``wrapt``-style function ``wrapper(wrapped, instance, args, kwargs)``), the
feature flag that enables it and the megatron-core versions it supports.

:func:`install` registers one ``wrapt`` post-import hook per target module, so a
patch lands whenever its module is imported, before or after ``mindspeed_ha``;
installing twice is a no-op (wrapt does not de-duplicate hooks, we do).

Wrappers are *gated*: a patch whose feature is not enabled passes every call
straight to the original, so importing ``mindspeed_ha`` with every HA flag off
changes no behaviour. Features are switched on by :func:`enable` once Megatron's
arguments are parsed (``ha``, ``replica``, ...) or at install time
(``cpu_backend`` when no CUDA/NPU device exists, ``core`` always).

Wrappers compose with other patchers: a layer of ours wraps whatever function the target
holds when it is applied (another framework's replacement included) and never replaces
it. MindSpeed's patch manager (``mindspeed/patch_utils.py``) re-sets a target each time
its ``apply_patches()`` runs, to a replacement or to its wrappers around the function it
saw first, which drops a layer of ours put on in between; the registry wraps
``MindSpeedPatchesManager.apply_patches``/``remove_patches`` and puts such layers back on
top (:func:`_around_mindspeed`). A patch's wrapper runs at most once per call even when a
foreign wrapper sits between two layers of it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import os
import sys
import threading
import types
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

import wrapt

from mindspeed_ha import env as ha_env

log = logging.getLogger("mindspeed_ha.patches")

#: Features known to the registry. ``core`` is always on.
FEATURES = ("core", "cpu_backend", "ha", "replica", "hbm_repair", "worker_reboot", "testing")


@dataclasses.dataclass(frozen=True)
class Patch:
    """One monkey-patch, as data.

    Attributes:
        name: unique short name, e.g. ``"replica.grad_sync"``.
        module: module that owns the target, e.g. ``"megatron.core.parallel_state"``.
        attribute: dotted attribute path inside ``module``, e.g.
            ``"DistributedOptimizer.step_with_ready_grads"``.
        wrapper: ``wrapper(wrapped, instance, args, kwargs) -> result``.
        feature: one of :data:`FEATURES`; the patch is a pass-through until enabled.
        versions: inclusive-exclusive ``(min, max)`` megatron-core versions
            (``"0.12.0"``, ``"0.13.0"``); ``None`` for targets outside megatron-core.
        doc: one line saying what the patch changes, printed by ``mindspeed-ha patches``.
        replace: the target is not a function to wrap but a value to replace:
            ``wrapper(original) -> replacement`` runs once when the module is imported.
            Not gated (a value cannot pass calls through), so only for library
            compatibility shims that behave like the original for every existing use.
    """

    name: str
    module: str
    attribute: str
    wrapper: Callable
    feature: str
    versions: Optional[Tuple[str, str]] = ("0.12.0", "0.13.0")
    doc: str = ""
    replace: bool = False

    def __post_init__(self):
        if self.feature not in FEATURES:
            raise ValueError(f"patch {self.name}: feature {self.feature!r} not in {FEATURES}")


_lock = threading.RLock()
_patches: Dict[str, Patch] = {}
_applied: Dict[str, str] = {}  # name -> "applied" | "skipped: reason"
_hooked_modules: Set[str] = set()
_enabled: Set[str] = {"core"}


def register(patch: Patch) -> Patch:
    """Add ``patch`` to the registry (and apply it now if its module is already hooked).

    Raises:
        ValueError: a different patch with the same name is already registered.
    """
    with _lock:
        old = _patches.get(patch.name)
        if old is not None and old != patch:
            raise ValueError(f"patch name {patch.name!r} registered twice")
        _patches[patch.name] = patch
        if patch.module in _hooked_modules:
            # install() already ran: hook this module again (hook runs at once if imported).
            wrapt.register_post_import_hook(apply_pending, patch.module)
    return patch


def enable(*features: str) -> None:
    """Switch features on. Unknown names raise ``ValueError``."""
    for f in features:
        if f not in FEATURES:
            raise ValueError(f"unknown feature {f!r}; known: {FEATURES}")
    with _lock:
        _enabled.update(features)
    log.debug("features enabled: %s", sorted(_enabled))


def disable(*features: str) -> None:
    """Switch features off (tests; ``core`` stays on)."""
    with _lock:
        _enabled.difference_update(set(features) - {"core"})


def is_enabled(feature: str) -> bool:
    return feature in _enabled


def enabled_features() -> List[str]:
    return sorted(_enabled)


_version_said: Set[str] = set()


def _megatron_core_version() -> Optional[str]:
    """The version of the megatron-core that runs: the imported ``megatron.core``'s
    ``__version__`` (a Megatron-LM tree on ``PYTHONPATH`` has no package metadata, or other
    metadata than the installed package's), else the installed package's metadata.
    Where they differ, or only the tree tells, one log line says which is used."""
    try:
        installed = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    core = sys.modules.get("megatron.core")
    imported = getattr(core, "__version__", None) if core is not None else None
    if imported is not None and imported != installed:
        where = os.path.dirname(getattr(core, "__file__", "") or "?")
        note = f"megatron-core {imported} from {where} (installed package: {installed or 'none'})"
        if note not in _version_said:
            _version_said.add(note)
            log.warning("version-gated patches checked against %s", note)
        return imported
    return installed


def _version_tuple(v: str) -> Tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _supported(patch: Patch) -> Optional[str]:
    """None if ``patch`` supports the installed megatron-core, else the reason."""
    if patch.versions is None:
        return None
    have = _megatron_core_version()
    if have is None:
        return "megatron-core not installed"
    lo, hi = patch.versions
    if not (_version_tuple(lo) <= _version_tuple(have) < _version_tuple(hi)):
        return f"megatron-core {have} outside [{lo}, {hi})"
    return None


_local = threading.local()
_wrapping: Set[str] = set()  # patches applied as layers (not ``replace``)


def _call(patch: Patch, wrapped, instance, args, kwargs):
    """Run ``patch.wrapper`` if its feature is on and it is not already running on this
    thread (a foreign wrapper between two layers of the same patch: the inner one passes)."""
    running = _local.__dict__.setdefault("running", set())
    if patch.feature not in _enabled or patch.name in running:
        return wrapped(*args, **kwargs)
    running.add(patch.name)
    try:
        return patch.wrapper(wrapped, instance, args, kwargs)
    finally:
        running.discard(patch.name)


def _by_name(module: str, qualname: str):
    """The object ``module.qualname``, imported (how pickle finds a function by reference)."""
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _BoundGate(wrapt.BoundFunctionWrapper):
    """A layer of ours bound to an instance or class: pickled as a bound method is, the
    attribute looked up again on its owner (in another process: that process's own)."""

    def __reduce_ex__(self, protocol):
        owner = self._self_instance if self._self_instance is not None else self._self_owner
        return getattr, (owner, self.__name__)


class _Gate(wrapt.FunctionWrapper):
    """One layer of ours around a target; ``_self_patch`` tells our layers from others'.

    Pickled by reference like the function it wraps (wrapt's proxies refuse to be pickled):
    a ``spawn`` child given a patched target (``multiprocessing`` pickles a manager's
    ``type(self)._run_server``) looks it up by name. Without this, with this package
    imported, ``multiprocessing.get_context("spawn").Manager()`` raised NotImplementedError
    ("object proxy must define __reduce__()").
    """

    __bound_function_wrapper__ = _BoundGate

    def __reduce_ex__(self, protocol):
        return _by_name, (self.__module__, self.__qualname__)

    def __init__(self, wrapped, patch: Patch):
        super().__init__(wrapped, functools.partial(_call, patch))
        self._self_patch = patch


def _gated(patch: Patch):
    _wrapping.add(patch.name)
    return lambda wrapped: _Gate(wrapped, patch)


def _stored(parent, attr: str):
    """``parent.attr`` as stored: a class's staticmethod/classmethod stays a descriptor."""
    value = getattr(parent, attr)
    return vars(parent).get(attr, value) if isinstance(parent, type) else value


def _wrap(parent, attr: str, raw, patch: Patch):
    """Set ``parent.attr`` to a layer of ``patch`` around ``raw``; return the layer."""
    if isinstance(raw, (staticmethod, classmethod)):
        layer = type(raw)(_gated(patch)(raw.__func__))
    else:
        layer = _gated(patch)(raw)
    setattr(parent, attr, layer)
    return layer


def _resolve_parent(module, attribute: str):
    parent = module
    parts = attribute.split(".")
    for p in parts[:-1]:
        parent = getattr(parent, p)
    return parent, parts[-1]


#: comma-separated patch names never to apply (diagnosis, and tests proving a patch is needed)
ENV_DISABLE = ha_env.DISABLE_PATCHES


def _disabled_by_env() -> Set[str]:
    return {n.strip() for n in os.environ.get(ENV_DISABLE, "").split(",") if n.strip()}


def check_disabled() -> None:
    """Every name in ``MINDSPEED_HA_DISABLE_PATCHES`` is a registered patch (the launcher
    checks before its workers start, each rank when it parses its arguments).

    Raises:
        mindspeed_ha.errors.ConfigError: naming the variable, the unknown names (with the
            closest registered ones) and where the accepted names are listed.
    """
    import difflib

    from mindspeed_ha.errors import ConfigError

    with _lock:
        known = sorted(_patches)
    unknown = sorted(_disabled_by_env() - set(known))
    if not unknown:
        return
    close = sorted({m for n in unknown for m in difflib.get_close_matches(n, known, n=1)})
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ConfigError(f"{ENV_DISABLE}: unknown patch name(s) {', '.join(unknown)}{hint}; accepted: a comma-separated "
                      f"list of the {len(known)} names `mindspeed-ha patches` prints")


def _apply(module, patch: Patch) -> None:
    if patch.name in _applied:
        return
    reason = _supported(patch)
    if patch.name in _disabled_by_env():
        reason = f"disabled by {ENV_DISABLE}"
    if reason is None:
        try:
            parent, attr = _resolve_parent(module, patch.attribute)
            original = getattr(parent, attr)
        except AttributeError as exc:
            reason = f"target missing: {exc}"
    if reason is not None:
        _applied[patch.name] = f"skipped: {reason}"
        log.warning("patch %s not applied (%s)", patch.name, reason)
        return
    if patch.replace:
        setattr(parent, attr, patch.wrapper(original))
        _applied[patch.name] = "applied"
        return
    _wrap(parent, attr, _stored(parent, attr), patch)
    _applied[patch.name] = "applied"
    log.debug("patch %s applied to %s.%s", patch.name, patch.module, patch.attribute)


def apply_pending(module) -> None:
    """Apply every registered patch of the imported ``module`` not applied yet (idempotent).

    The post-import hook :func:`install` registers; a patch set whose targets are created
    after the import (``patches/comm.py``) calls it again.
    """
    with _lock:
        for patch in list(_patches.values()):
            if patch.module == module.__name__:
                _apply(module, patch)




_relayered: Dict[str, tuple] = {}  # name -> (parent, attr, under, layer), in the order put on


def _has_layer(obj, name: str) -> bool:
    """Whether a layer of patch ``name`` is in ``obj``'s chain of wrapped functions:
    ``__wrapped__`` (functools.wraps, wrapt), ``__func__`` (descriptors, methods) and the
    parent of a wrapt bound wrapper (what ``getattr(cls, name)`` returns for our layer)."""
    for _ in range(100):
        for o in (obj, getattr(obj, "_self_parent", None)):
            if isinstance(o, _Gate) and o._self_patch.name == name:
                return True
        if isinstance(obj, (staticmethod, classmethod, types.MethodType)):
            obj = obj.__func__
        else:
            obj = getattr(obj, "__wrapped__", None)
        if obj is None:
            return False
    return False


def _rebind(attr: str, old, new) -> None:
    """Every module global ``attr`` that is ``old`` (``from m import f`` copies) -> ``new``."""
    for mod in list(sys.modules.values()):
        try:
            if vars(mod).get(attr) is old:
                setattr(mod, attr, new)
        except TypeError:  # not a module (no __dict__)
            continue


def _reapply() -> None:
    """Put a layer back on top of every target where another patcher dropped ours."""
    with _lock:
        for patch in list(_patches.values()):
            module = sys.modules.get(patch.module)
            if patch.name not in _wrapping or _applied.get(patch.name) != "applied" or module is None:
                continue
            try:
                parent, attr = _resolve_parent(module, patch.attribute)
                under = _stored(parent, attr)
            except AttributeError:
                continue
            if _has_layer(under, patch.name):
                continue
            layer = _wrap(parent, attr, under, patch)
            if not isinstance(parent, type):
                _rebind(attr, under, layer)
            _relayered[patch.name] = (parent, attr, under, layer)
            log.info("patch %s put back on top of %s.%s (replaced by another patcher)",
                     patch.name, patch.module, patch.attribute)


def _peel() -> None:
    """Take off the layers :func:`_reapply` put on, so MindSpeed finds the functions it set
    (it recognises them by identity to rebind or restore them)."""
    with _lock:
        for parent, attr, under, layer in reversed(list(_relayered.values())):
            if _stored(parent, attr) is layer:
                setattr(parent, attr, under)
                if not isinstance(parent, type):
                    _rebind(attr, layer, under)
        _relayered.clear()


def _around_mindspeed(wrapped, instance, args, kwargs):
    """Around MindSpeed's apply_patches()/remove_patches(): it sets its targets from the
    functions it recorded at its first application (patch_utils.py ``Patch.apply_patch``),
    then we put our dropped layers back on top."""
    _peel()
    try:
        return wrapped(*args, **kwargs)
    finally:
        _reapply()


def install(patches: Iterable[Patch] = ()) -> None:
    """Register ``patches`` and hook every target module (idempotent)."""
    with _lock:
        for p in patches:
            register(p)
        for name in sorted({p.module for p in _patches.values()}):
            if name not in _hooked_modules:
                _hooked_modules.add(name)
                wrapt.register_post_import_hook(apply_pending, name)


def report() -> List[dict]:
    """One row per registered patch: name, target, feature, active, status, doc."""
    with _lock:
        return [
            {
                "name": p.name,
                "target": f"{p.module}:{p.attribute}",
                "feature": p.feature,
                # a replacement stays in place with its feature off, but every replacement is
                # either of the always-on ``core`` feature or a gated wrapper that then passes
                # every call through (patches/comm.py): active means "changes behaviour now"
                "active": p.feature in _enabled and _applied.get(p.name) == "applied",
                "status": _applied.get(p.name, "pending import"),
                "doc": p.doc,
            }
            for p in sorted(_patches.values(), key=lambda p: p.name)
        ]


def active(feature: Optional[str] = None) -> List[str]:
    """Names of patches that are applied and whose feature is enabled."""
    return [r["name"] for r in report() if r["active"] and (feature is None or r["feature"] == feature)]


for _entry in ("apply_patches", "remove_patches"):
    register(Patch(f"compose.mindspeed.{_entry}", "mindspeed.patch_utils", f"MindSpeedPatchesManager.{_entry}",
                   _around_mindspeed, "core", versions=None,
                   doc=f"put our layers back on top after MindSpeed's {_entry}()"))
