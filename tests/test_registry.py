"""Patch registry: data-declared patches, applied once on import, gated by feature."""

import sys
import types

import pytest

from mindspeed_ha.patches import registry
from mindspeed_ha.patches.registry import Patch


def _install_fake_module(name):
    mod = types.ModuleType(name)

    def add(a, b):
        return a + b

    class K:
        def mul(self, a, b):
            return a * b

    mod.add, mod.K = add, K
    return mod


def _times_ten(wrapped, instance, args, kwargs):
    return 10 * wrapped(*args, **kwargs)


@pytest.fixture
def fake_module():
    name = "mindspeed_ha_fake_target"
    yield name
    sys.modules.pop(name, None)
    registry.disable("testing")


def test_patch_applies_on_import_and_is_gated(fake_module):
    registry.install([
        Patch("t.add", fake_module, "add", _times_ten, "testing", versions=None),
        Patch("t.mul", fake_module, "K.mul", _times_ten, "testing", versions=None),
    ])
    mod = _install_fake_module(fake_module)
    sys.modules[fake_module] = mod
    # wrapt fires post-import hooks through its import finder; trigger them explicitly.
    import wrapt

    wrapt.notify_module_loaded(mod)
    assert mod.add(2, 3) == 5, "feature off: pass-through"
    assert mod.K().mul(2, 3) == 6
    registry.enable("testing")
    assert mod.add(2, 3) == 50
    assert mod.K().mul(2, 3) == 60
    rows = {r["name"]: r for r in registry.report()}
    assert rows["t.add"]["status"] == "applied" and rows["t.add"]["active"]
    # Applied once: notifying again does not wrap twice.
    wrapt.notify_module_loaded(mod)
    assert mod.add(2, 3) == 50
    assert "t.add" in registry.active("testing")


def test_unsupported_version_is_skipped(fake_module):
    registry.install([Patch("t.old", fake_module, "add", _times_ten, "testing", versions=("0.1.0", "0.2.0"))])
    mod = _install_fake_module(fake_module)
    sys.modules[fake_module] = mod
    import wrapt

    wrapt.notify_module_loaded(mod)
    registry.enable("testing")
    assert mod.add(1, 1) == 2
    row = {r["name"]: r for r in registry.report()}["t.old"]
    assert row["status"].startswith("skipped") and not row["active"]


def test_unknown_feature_rejected():
    with pytest.raises(ValueError, match="feature"):
        Patch("x", "m", "a", _times_ten, "nope")
    with pytest.raises(ValueError, match="unknown feature"):
        registry.enable("nope")


def test_duplicate_name_rejected():
    registry.register(Patch("t.dup", "m1", "a", _times_ten, "testing", versions=None))
    with pytest.raises(ValueError, match="twice"):
        registry.register(Patch("t.dup", "m2", "a", _times_ten, "testing", versions=None))


def test_every_declared_patch_is_well_formed():
    from mindspeed_ha.patches import all_patches

    patches = all_patches()
    names = [p.name for p in patches]
    assert len(names) == len(set(names))
    assert {"replica.grad_sync", "replica.grad_norm_group", "ha.train_step.trainer"} <= set(names)
    for p in patches:
        assert p.doc, p.name
