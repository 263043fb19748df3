"""Feature ``core``: MindSpeed-LLM 2.3.0's own high-availability feature stays off while
mindspeed-ha owns the four HA flags.

MindSpeed-LLM's high-availability feature (class
``HighAvailabilityFeature``) sees the HA flags off while mindspeed-ha owns them
(:mod:`mindspeed_ha.integrations.mindspeed_llm`): it neither imports ``mindio_ttp`` in
``validate_args`` nor registers its patches. With ``MINDSPEED_HA_PROVIDER=mindio_ttp`` it
sees them as given. (The CPU scope, the guards and the patch report on MindSpeed-LLM's own
``pretrain``/``train``/``save_checkpoint`` are declared beside Megatron-LM's: cpu_training.py,
training.py, testing.py.)
"""

from __future__ import annotations

import argparse

from .registry import Patch

#: MindSpeed-LLM's names for the flags of its high-availability feature
HA_FLAGS = ("enable_high_availability", "enable_hbmfault_repair", "enable_worker_reboot",
            "distributed_optimizer_no_replica", "enable_elastic_training")


def flags_off(ns):
    """A copy of namespace ``ns`` with MindSpeed-LLM's HA flags off."""
    copy = argparse.Namespace(**vars(ns))
    for flag in HA_FLAGS:
        if hasattr(copy, flag):
            setattr(copy, flag, False)
    return copy


def _feature_sees_flags_off(wrapped, instance, args, kwargs):
    from mindspeed_ha.integrations.mindspeed_llm import ours

    if not ours():
        return wrapped(*args, **kwargs)
    args = tuple(flags_off(a) if isinstance(a, argparse.Namespace) else a for a in args)
    kwargs = {k: flags_off(v) if isinstance(v, argparse.Namespace) else v for k, v in kwargs.items()}
    return wrapped(*args, **kwargs)


_HA = "mindspeed_llm.features_manager.high_availability.high_availability"

PATCHES = [
    *[Patch(f"arguments.mindspeed_llm_ha_feature.{method}", _HA, f"HighAvailabilityFeature.{method}",
            _feature_sees_flags_off, "core", versions=None,
            doc=f"MindSpeed-LLM's own HA feature (mindio_ttp) sees the HA flags off in {method}() "
                "while mindspeed-ha owns them")
      for method in ("pre_validate_args", "validate_args", "post_validate_args", "pre_register_patches",
                     "register_patches")],
]
