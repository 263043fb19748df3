"""mindspeed-ha patch sets (installed as ``mindspeed_ha.patches``).

Each module declares ``PATCHES: list[Patch]``; :func:`all_patches` collects them.
Declaring a patch imports nothing heavy: wrappers import torch/megatron lazily.
"""

from .registry import Patch, active, enable, install, is_enabled, report  # noqa: F401

_MODULES = ("cpu_backend", "cpu_training", "compat", "comm", "rejoin", "megatron_fixes", "arguments", "replica", "optimizer", "training", "megatron_state", "testing", "mindspeed_llm")


def all_patches():
    import importlib

    out = []
    for name in _MODULES:
        try:
            mod = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:  # a patch set not written yet
            if exc.name != f"{__name__}.{name}":
                raise
            continue
        out.extend(getattr(mod, "PATCHES", ()))
    return out
