"""Feature ``ha``: report the optimizer update's begin and end (adaptation point 2).

``step_with_ready_grads`` is the part of ``optimizer.step()`` that mutates state (the
inner optimizer step, main -> model param copy, the distributed optimizer's param
all-gather); everything before it (grad copy, found-inf and grad-norm collectives) only
reads. So UPDATING(k) brackets exactly the mutation, and a rank that failed in the
grad-norm collective still holds a consistent state at ``k-1``. Nested calls (the
distributed optimizer calls its parent's method) report once.
"""

from __future__ import annotations

from .registry import Patch


def _update_bracket(wrapped, instance, args, kwargs):
    from mindspeed_ha.runtime import get_runtime

    rt = get_runtime()
    if rt is None or rt.current is None:
        return wrapped(*args, **kwargs)
    rt.begin_update()
    ok = False
    try:
        result = wrapped(*args, **kwargs)
        ok = True
        return result
    finally:
        if ok:
            rt.end_update()
        else:
            rt.abort_update()  # stays UPDATING: the state is dirty


_TARGETS = [
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.step_with_ready_grads"),
    ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.step_with_ready_grads"),
    ("megatron.core.optimizer.optimizer", "FP32Optimizer.step_with_ready_grads"),
    ("megatron.core.optimizer.optimizer", "ChainedOptimizer.step_with_ready_grads"),
]

PATCHES = [
    Patch(
        name=f"optimizer.update_bracket.{attr.split('.')[0]}",
        module=module,
        attribute=attr,
        wrapper=_update_bracket,
        feature="ha",
        doc="begin_update(k) / end_update(k) around the optimizer's state mutation",
    )
    for module, attr in _TARGETS
]
