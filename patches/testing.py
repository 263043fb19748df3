"""Feature ``testing``: exact per-iteration losses of a Megatron-LM run, for loss-curve
proofs; the fault injector attached to the runtime.

Megatron-LM logs losses rounded to 7 significant digits; a bitwise comparison of a
recovered run with an uninterrupted one needs the exact values. With
``MINDSPEED_HA_LOSS_LOG=PATH`` every rank appends one JSON line per ``train_step`` to
``PATH.rank<R>``: ``{"iteration": k, "time": unix seconds at the end of the step,
"loss": {name: float.hex()}, "grad_norm": hex}``.
The recorder only reads ``train_step``'s return value; it works with every HA flag off
(the switch is the environment variable, not an HA flag).

With ``MINDSPEED_HA_INJECT`` set, the fault injector (:mod:`mindspeed_ha.testing.injector`,
loaded by name: the product never imports the test package) becomes the runtime's fault
points: :func:`autoenable` registers :func:`attach_injector` in
``mindspeed_ha.runtime.CONFIGURE_HOOKS`` once that module is imported.
"""

from __future__ import annotations

from mindspeed_ha import env as ha_env
import json
import os
import time

from .registry import Patch, enable

ENV_LOSS_LOG = ha_env.LOSS_LOG
ENV_PATCH_REPORT = ha_env.PATCH_REPORT
#: the fault injector's module (a test helper shipped with the package)
INJECTOR_MODULE = "mindspeed_ha.testing.injector"


def attach_injector(rt) -> None:
    """Make the fault injector configured by ``MINDSPEED_HA_INJECT`` (this rank's specs)
    the fault points of the runtime ``rt`` (a runtime configure hook)."""
    if not os.environ.get(ha_env.INJECT):
        return
    import importlib

    rt.injector = importlib.import_module(INJECTOR_MODULE).Injector.from_env(rt.rank)


def _register_injector(runtime_module) -> None:
    hooks = runtime_module.CONFIGURE_HOOKS
    if attach_injector not in hooks:
        hooks.append(attach_injector)


def _hex(value):
    if value is None:
        return None
    return float(value).hex()


def _record_losses(wrapped, instance, args, kwargs):
    path = os.environ.get(ENV_LOSS_LOG)
    result = wrapped(*args, **kwargs)
    if not path:
        return result
    from megatron.training.global_vars import get_args

    loss_dict, grad_norm = result[0], result[5]
    row = {"iteration": int(get_args().curr_iteration) + 1, "time": time.time(),
           "loss": {k: _hex(v) for k, v in (loss_dict or {}).items()},
           "grad_norm": _hex(grad_norm)}
    with open(f"{path}.rank{os.environ.get('RANK', '0')}", "a") as f:
        f.write(json.dumps(row) + "\n")
    return result


def _write_patch_report(path: str) -> None:
    from mindspeed_ha.runtime import get_runtime

    from .registry import active, enabled_features

    rt = get_runtime()
    row = {"features": enabled_features(), "active": active(), "runtime": rt is not None}
    with open(f"{path}.rank{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(row, f)


def _report_after_pretrain(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    path = os.environ.get(ENV_PATCH_REPORT)
    if path:
        _write_patch_report(path)
    return result


def autoenable() -> bool:
    """Enable feature ``testing`` when the loss log or the fault injector is configured
    (the injector: also registered to attach itself to the runtime, :func:`attach_injector`).

    ``MINDSPEED_HA_PATCH_REPORT=PATH``: when ``pretrain`` returns every rank writes ``PATH.rank<R>`` with the
    enabled features, the active patches and whether an HA runtime was configured
    (what ``mindspeed-ha patches`` shows, from inside a real run).
    """
    if os.environ.get(ha_env.INJECT):
        import wrapt

        wrapt.register_post_import_hook(_register_injector, "mindspeed_ha.runtime")
    if any(os.environ.get(v) for v in (ENV_LOSS_LOG, ENV_PATCH_REPORT, ha_env.INJECT)):
        enable("testing")
        return True
    return False


PATCHES = [
    Patch("testing.loss_log", "megatron.training.training", "train_step", _record_losses,
          "testing", versions=None,
          doc=f"{ENV_LOSS_LOG}: exact per-iteration losses and grad norm (hex floats)"),
    Patch("testing.patch_report", "megatron.training.training", "pretrain", _report_after_pretrain,
          "testing", versions=None,
          doc=f"{ENV_PATCH_REPORT}: active patches and runtime per rank after pretrain()"),
    Patch("testing.patch_report.mindspeed_llm", "mindspeed_llm.training.training", "pretrain", _report_after_pretrain,
          "testing", versions=None,
          doc=f"{ENV_PATCH_REPORT}: active patches and runtime per rank after MindSpeed-LLM's own pretrain()"),
]
