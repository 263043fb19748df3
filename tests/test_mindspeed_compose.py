"""Our patches compose with MindSpeed's patch manager, in either order.

The fake ``mindspeed.patch_utils`` below behaves as Ascend/MindSpeed
``mindspeed/patch_utils.py`` at tag v2.3.0_core_r0.12.1 (the MindSpeed paired with
MindSpeed-LLM 2.3.0; unchanged in substance at master) does, written from reading it:

* ``register_patch(name, fn)`` (lines 165-181, ``Patch.set_patch_func`` 69-77): ``fn``
  whose ``__name__`` ends in ``wrapper``/``decorator`` is a wrapper, stacked; any other
  is *the* replacement (a second one raises unless ``force_patch``). Registering marks the
  patch not applied.
* ``apply_patch`` (105-128): resolve the target now (importing its module, 130-159; a
  class inside a module works too); the first time, remember it as ``orig_func``; the
  result is the replacement (else ``orig_func``) passed through every wrapper; set it on
  the owner, then on every module in ``sys.modules`` whose attribute of that name *is*
  the function just found (names imported with ``from m import f``).
* ``remove_patch`` (94-103): every module (names containing ``mindspeed`` skipped) whose
  attribute is the applied result gets ``orig_func`` back; a class attribute is not
  restored. ``remove_patches`` (195-199) also forgets the wrappers.
* Features call ``MindSpeedPatchesManager.apply_patches()`` (201-205) after registering:
  ``mindspeed/features_manager/features_manager.py`` lines 21 and 29, at import of
  ``mindspeed.megatron_adaptor`` and of MindSpeed-LLM's ``megatron_adaptor_v2``, and
  again in ``mindspeed.megatron_adaptor.repatch`` after ``remove_patches``.
"""

import functools
import itertools
import sys
import textwrap
import types

import pytest
import wrapt

from mindspeed_ha.patches import registry
from mindspeed_ha.patches.registry import Patch

FAKE_PATCH_UTILS = textwrap.dedent('''
    import importlib
    import sys


    def _is_wrapper(fn):
        return getattr(fn, "__name__", "").endswith(("wrapper", "decorator"))


    class Patch:
        def __init__(self, target, fn):
            self.owner_name, self.attr = target.rsplit(".", 1)
            self.owner = self.orig = self.replacement = self.final = None
            self.wrappers = []
            self.applied = False
            self.set(fn)

        def set(self, fn, force=False):
            if _is_wrapper(fn):
                if fn not in self.wrappers:
                    self.wrappers.append(fn)
            elif self.replacement is not None and not force:
                raise RuntimeError("the patch of %s exist !" % self.attr)
            else:
                self.replacement = fn
            self.applied = False

        def _resolve(self):
            try:
                owner = importlib.import_module(self.owner_name)
            except ModuleNotFoundError:
                module, cls = self.owner_name.rsplit(".", 1)
                owner = getattr(importlib.import_module(module), cls)
            return owner, getattr(owner, self.attr)

        def apply(self):
            if self.applied:
                return
            owner, found = self._resolve()
            if self.owner is None:
                self.owner, self.orig = owner, found
            result = self.orig if self.replacement is None else self.replacement
            for wrapper in self.wrappers:
                result = wrapper(result)
            setattr(self.owner, self.attr, result)
            for mod in list(sys.modules.values()):
                if hasattr(mod, self.attr) and getattr(mod, self.attr) is found:
                    setattr(mod, self.attr, result)
            self.applied, self.final = True, result

        def remove(self):
            for key, mod in list(sys.modules.items()):
                if "mindspeed" not in key and hasattr(mod, self.attr) and getattr(mod, self.attr) is self.final:
                    setattr(mod, self.attr, self.orig)
            self.replacement = self.final = None
            self.applied = False


    class MindSpeedPatchesManager:
        patches_info = {}

        @staticmethod
        def register_patch(target, fn, force_patch=False):
            info = MindSpeedPatchesManager.patches_info
            if target in info:
                info[target].set(fn, force_patch)
            else:
                info[target] = Patch(target, fn)

        @staticmethod
        def apply_patches():
            for patch in MindSpeedPatchesManager.patches_info.values():
                patch.apply()

        @staticmethod
        def remove_patches():
            for patch in MindSpeedPatchesManager.patches_info.values():
                patch.remove()
                patch.wrappers.clear()
''')


@pytest.fixture(scope="module")
def mindspeed(tmp_path_factory):
    """The fake MindSpeed, imported for real (our post-import hook on it fires once per
    process, as with the real one)."""
    root = tmp_path_factory.mktemp("fake_mindspeed")
    (root / "mindspeed").mkdir()
    (root / "mindspeed" / "__init__.py").write_text("")
    (root / "mindspeed" / "patch_utils.py").write_text(FAKE_PATCH_UTILS)
    sys.path.insert(0, str(root))
    try:
        import mindspeed.patch_utils as pu

        assert {"compose.mindspeed.apply_patches", "compose.mindspeed.remove_patches"} <= set(registry.active())
        yield pu.MindSpeedPatchesManager
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("mindspeed.patch_utils", None)
        sys.modules.pop("mindspeed", None)


_names = itertools.count()
CALLS = []


def _ours(wrapped, instance, args, kwargs):
    CALLS.append("ours")
    return wrapped(*args, **kwargs)


def _build_target(name):
    """A Megatron-like module (a function and a method), in ``sys.modules``."""
    mod = types.ModuleType(name)

    def train_step(x):
        CALLS.append("original")
        return x + 1

    class Optimizer:
        def step(self, x):
            CALLS.append("original")
            return x + 1

    mod.train_step, mod.Optimizer = train_step, Optimizer
    sys.modules[name] = mod
    return mod


def _user_of(mod):
    """A module that ran ``from <mod> import train_step`` now."""
    user = types.ModuleType(mod.__name__ + "_user")
    user.train_step = mod.train_step
    sys.modules[user.__name__] = user
    return user


@pytest.fixture
def target(mindspeed):
    """(name of a fresh target module, the fake MindSpeedPatchesManager); our patches on the
    target are declared (feature ``testing`` on), not applied: its module is not loaded yet."""
    name = f"fake_megatron_{next(_names)}"
    mindspeed.patches_info.clear()
    CALLS.clear()
    registry.install([
        Patch(f"{name}.train_step", name, "train_step", _ours, "testing", versions=None, doc="test"),
        Patch(f"{name}.step", name, "Optimizer.step", _ours, "testing", versions=None, doc="test"),
    ])
    registry.enable("testing")
    yield name, mindspeed
    registry.disable("testing")
    mindspeed.patches_info.clear()
    for key in (name, name + "_user"):
        sys.modules.pop(key, None)


def _load(name):
    """Import the target module (our post-import hook applies our patches to it at once),
    then a module that imports its function by name, as mindspeed-ha-run's order gives."""
    mod = _build_target(name)
    wrapt.notify_module_loaded(mod)
    return mod, _user_of(mod)


def _replacement(x):  # MindSpeed replaces the function (name does not end in "wrapper")
    CALLS.append("mindspeed")
    return x + 1


def _method_replacement(self, x):
    CALLS.append("mindspeed")
    return x + 1


def _ms_wrapper(fn):  # a MindSpeed wrapper, functools.wraps as MindSpeed writes them
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        CALLS.append("mindspeed")
        return fn(*args, **kwargs)

    return wrapper


def _bare_wrapper(fn):  # a wrapper without functools.wraps: our layer below it is invisible
    def wrapper(*args, **kwargs):
        CALLS.append("mindspeed")
        return fn(*args, **kwargs)

    return wrapper


def _calls(fn, *args):
    CALLS.clear()
    assert fn(*args) == 2
    return sorted(CALLS)


BOTH = ["mindspeed", "original", "ours"]
BOTH_REPLACED = ["mindspeed", "ours"]


def _layers(obj, patch_name):
    n = 0
    while obj is not None:
        if isinstance(obj, registry._Gate) and obj._self_patch.name == patch_name:
            n += 1
        obj = getattr(obj, "__wrapped__", None)
    return n


def test_ours_first_then_mindspeed_replacement(target):
    name, ms = target
    mod, user = _load(name)
    assert _calls(mod.train_step, 1) == ["original", "ours"]
    ms.register_patch(f"{name}.train_step", _replacement)
    ms.register_patch(f"{name}.Optimizer.step", _method_replacement)
    ms.apply_patches()
    # MindSpeed's replacement is what we wrap now, everywhere the name was bound.
    assert _calls(mod.train_step, 1) == BOTH_REPLACED
    assert _calls(user.train_step, 1) == BOTH_REPLACED
    assert _calls(mod.Optimizer().step, 1) == BOTH_REPLACED
    # Applying again (a feature registered later) keeps exactly one layer of ours.
    ms.register_patch(f"{name}.train_step", _ms_wrapper)
    ms.apply_patches()
    ms.apply_patches()
    assert _calls(mod.train_step, 1) == ["mindspeed", "mindspeed", "ours"]
    assert _layers(mod.train_step, f"{name}.train_step") == 1


def test_mindspeed_first_then_ours(target):
    name, ms = target
    # The target was imported before mindspeed_ha (our hook has not fired) and MindSpeed
    # patches it first. (Names copied from it before mindspeed_ha is imported keep
    # MindSpeed's function, as they would keep the original without MindSpeed: import
    # mindspeed_ha first, as mindspeed-ha-run does.)
    mod = _build_target(name)
    ms.register_patch(f"{name}.train_step", _replacement)
    ms.register_patch(f"{name}.Optimizer.step", _ms_wrapper)
    ms.apply_patches()
    assert _calls(mod.train_step, 1) == ["mindspeed"]
    wrapt.notify_module_loaded(mod)  # our patches land on MindSpeed's functions
    assert _calls(mod.train_step, 1) == BOTH_REPLACED
    assert _calls(mod.Optimizer().step, 1) == BOTH
    # A later MindSpeed application rebuilds from the function it saw first: ours come back on top.
    ms.register_patch(f"{name}.train_step", _ms_wrapper)
    ms.register_patch(f"{name}.Optimizer.step", _method_replacement)
    ms.apply_patches()
    assert _calls(mod.train_step, 1) == ["mindspeed", "mindspeed", "ours"]
    assert _calls(mod.Optimizer().step, 1) == ["mindspeed", "mindspeed", "ours"]


def test_ours_first_then_mindspeed_wrapper(target):
    name, ms = target
    mod, user = _load(name)
    ms.register_patch(f"{name}.train_step", _ms_wrapper)
    ms.register_patch(f"{name}.Optimizer.step", _ms_wrapper)
    ms.apply_patches()
    # MindSpeed wrapped our layer: nothing to put back, each runs once.
    assert _calls(mod.train_step, 1) == BOTH and _calls(user.train_step, 1) == BOTH
    assert _calls(mod.Optimizer().step, 1) == BOTH
    assert f"{name}.train_step" not in registry._relayered
    assert f"{name}.step" not in registry._relayered


def test_wrapper_hiding_our_layer_does_not_run_ours_twice(target):
    name, ms = target
    mod, _ = _load(name)
    ms.register_patch(f"{name}.train_step", _bare_wrapper)
    ms.apply_patches()
    # Our layer is under a wrapper without __wrapped__: another goes on top, the inner passes.
    assert f"{name}.train_step" in registry._relayered
    assert _calls(mod.train_step, 1) == BOTH


def test_mindspeed_remove_patches_keeps_ours(target):
    name, ms = target
    mod, user = _load(name)
    ms.register_patch(f"{name}.train_step", _replacement)
    ms.apply_patches()  # ours put back on top of MindSpeed's replacement
    assert f"{name}.train_step" in registry._relayered
    ms.remove_patches()  # MindSpeed finds its own function (we peeled ours) and restores what it found
    assert _calls(mod.train_step, 1) == ["original", "ours"]
    assert _calls(user.train_step, 1) == ["original", "ours"]
    ms.register_patch(f"{name}.train_step", _replacement)  # repatch: remove, register, apply
    ms.apply_patches()
    assert _calls(mod.train_step, 1) == BOTH_REPLACED
    assert _layers(mod.train_step, f"{name}.train_step") == 1


def test_feature_off_is_pass_through_under_mindspeed(target):
    name, ms = target
    mod, _ = _load(name)
    ms.register_patch(f"{name}.train_step", _replacement)
    ms.apply_patches()
    registry.disable("testing")
    assert _calls(mod.train_step, 1) == ["mindspeed"]


# ---- the argument patch when the framework defines the HA flags itself ------------------
#
# MindSpeed-LLM 2.3.0 defines the four flags (mindspeed_llm/features_manager/
# high_availability/high_availability.py lines 10-21, store_true) through the provider its
# parse_args decorator adds (mindspeed_llm/training/arguments.py lines 34-52: the user's
# provider first, then every feature's register_args).

def _framework_parse_args(extra_args_provider=None, ignore_unknown_args=False, argv=()):
    """Megatron-LM core_v0.12.1 parse_args' structure (arguments.py lines 69-98)."""
    import argparse

    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--num-distributed-optimizer-instances", type=int, default=1)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        return parser.parse_known_args(list(argv))[0]
    return parser.parse_args(list(argv))


def _add_mindspeed_llm_ha_flags(parser):
    group = parser.add_argument_group(title="high-availability")
    for flag in ("--enable-high-availability", "--enable-hbmfault-repair", "--enable-worker-reboot",
                 "--distributed-optimizer-no-replica"):
        group.add_argument(flag, action="store_true")
    return parser


def _mindspeed_llm_parse_args_decorator(parse_args):
    @functools.wraps(parse_args)
    def wrapper(extra_args_provider=None, ignore_unknown_args=False, **kw):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return _add_mindspeed_llm_ha_flags(parser)

        return parse_args(provider, ignore_unknown_args, **kw)

    return wrapper


def _with_our_patch(fn):
    from mindspeed_ha.patches.arguments import _parse_args_wrapper

    return wrapt.FunctionWrapper(fn, _parse_args_wrapper)


@pytest.fixture
def ha_parse(monkeypatch):
    from mindspeed_ha import runtime

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    for var in ("TTP_ADDR", "CONTROLLER_ADDR", "TTP_PORT"):
        monkeypatch.delenv(var, raising=False)
    before = set(registry.enabled_features())
    yield
    registry.disable(*(set(registry.enabled_features()) - before))
    runtime.reset()


STACKS = {
    # the base parser already defines the flags
    "framework-defines": lambda: _with_our_patch(lambda provider=None, ignore=False, **kw: _framework_parse_args(
        lambda p: provider(_add_mindspeed_llm_ha_flags(p)), ignore, **kw)),
    # MindSpeed-LLM's decorator around ours (mindspeed_ha imported first: its hook wraps first)
    "mindspeed-outside": lambda: _mindspeed_llm_parse_args_decorator(_with_our_patch(_framework_parse_args)),
    # ours around MindSpeed-LLM's decorator (mindspeed_ha imported after MindSpeed patched):
    # its provider adds the flags after ours ran
    "mindspeed-inside": lambda: _with_our_patch(_mindspeed_llm_parse_args_decorator(_framework_parse_args)),
}


@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("ignore_unknown", [False, True])
def test_framework_defined_ha_flags_parse_and_we_validate(ha_parse, stack, ignore_unknown):
    from mindspeed_ha.config import ConfigError

    parse_args = STACKS[stack]()
    base = ["--use-distributed-optimizer", "--pipeline-model-parallel-size", "2", "--enable-high-availability"]
    args = parse_args(None, ignore_unknown, argv=base + ["--ha-replica-count", "4"])
    assert args.enable_high_availability and args.num_distributed_optimizer_instances == 4
    assert registry.is_enabled("ha") and registry.is_enabled("replica")
    args = parse_args(None, ignore_unknown, argv=base + ["--enable-hbmfault-repair", "--distributed-optimizer-no-replica"])
    assert args.enable_hbmfault_repair and args.num_distributed_optimizer_instances == 1
    # our validation runs on the framework's flags: d = 8 / 2 = 4, N = 3 does not divide it
    with pytest.raises(ConfigError, match="--ha-replica-count"):
        parse_args(None, ignore_unknown, argv=base + ["--ha-replica-count", "3"])
    with pytest.raises(ConfigError, match="--enable-high-availability"):
        parse_args(None, ignore_unknown, argv=["--enable-worker-reboot"])
