"""MindSpeed-LLM 2.3.0's own code paths (its ``pretrain_gpt.py`` calls its own functions).

MindSpeed-LLM's ``pretrain_gpt.py`` imports ``pretrain`` from
``mindspeed_llm.training.training``, whose ``pretrain`` calls that module's ``train`` and
``save_checkpoint`` (imported from ``megatron.training.checkpointing``), not Megatron-LM's
``megatron.training.training`` ones our other patches sit on. The same wrappers are put on
MindSpeed-LLM's functions here (feature gates as for Megatron-LM's):

* ``pretrain``: the CPU device scope (``cpu_backend``) and the patch report (``testing``);
* ``train`` / ``save_checkpoint`` / ``evaluate_and_print_results``: the fault guards (``ha``;
  a guard nested in another of its kind passes through, so a function reached through two
  layers is guarded once).

And feature ``core``: MindSpeed-LLM's high-availability feature (class
``HighAvailabilityFeature``) sees the HA flags off while mindspeed-ha owns them
(:mod:`mindspeed_ha.integrations.mindspeed_llm`): it neither imports ``mindio_ttp`` in
``validate_args`` nor registers its patches. With ``MINDSPEED_HA_PROVIDER=mindio_ttp`` it
sees them as given.
"""

from __future__ import annotations

import argparse

from .cpu_training import _pretrain_on_cpu
from .registry import Patch
from .testing import _report_after_pretrain
from .training import _guard, _save_guard

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


_T = "mindspeed_llm.training.training"
_HA = "mindspeed_llm.features_manager.high_availability.high_availability"

PATCHES = [
    Patch("cpu.mindspeed_llm_pretrain", _T, "pretrain", _pretrain_on_cpu, "cpu_backend", versions=None,
          doc="MindSpeed-LLM's pretrain(): device='cuda' factories and .cuda() map to CPU"),
    Patch("testing.patch_report.mindspeed_llm", _T, "pretrain", _report_after_pretrain, "testing",
          versions=None, doc="MINDSPEED_HA_PATCH_REPORT: active patches per rank after MindSpeed-LLM's pretrain()"),
    Patch("ha.guard.train.mindspeed_llm", _T, "train", _guard("train"), "ha", versions=None,
          doc="fault guard around MindSpeed-LLM's training loop"),
    Patch("ha.guard.save_checkpoint.mindspeed_llm", _T, "save_checkpoint", _save_guard, "ha", versions=None,
          doc="fault guard around MindSpeed-LLM's periodic and final save_checkpoint"),
    Patch("ha.guard.evaluate.mindspeed_llm", _T, "evaluate_and_print_results", _guard("eval"), "ha",
          versions=None, doc="fault guard around MindSpeed-LLM's evaluation"),
    *[Patch(f"arguments.mindspeed_llm_ha_feature.{method}", _HA, f"HighAvailabilityFeature.{method}",
            _feature_sees_flags_off, "core", versions=None,
            doc=f"MindSpeed-LLM's own HA feature (mindio_ttp) sees the HA flags off in {method}() "
                "while mindspeed-ha owns them")
      for method in ("pre_validate_args", "validate_args", "post_validate_args", "pre_register_patches",
                     "register_patches")],
]
