"""Feature ``ha``: start the runtime and put the exception decorator around ``train_step``.

Adaptation points 1 (start processors once model-parallel groups exist) and 5 (catch,
classify, report, wait for the controller's action). The wrapped ``train_step`` has
Megatron-LM core_v0.12.1's signature ``train_step(forward_step_func, data_iterator,
model, optimizer, opt_param_scheduler, config)``; the same wrapper serves Megatron-LM's
``megatron.training.training`` and our Megatron-shaped ``mindspeed_ha.testing.trainer.training``.
"""

from __future__ import annotations

import functools
import inspect

from .registry import Patch


@functools.lru_cache(maxsize=None)
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)



def _start_runtime(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    from mindspeed_ha.runtime import get_runtime

    rt = get_runtime()
    if rt is not None:
        rt.on_model_parallel_initialized()
    return result


def _with_injection(forward_step_func, rt, iteration):
    """Wrap ``forward_step_func`` so armed forward/backward faults fire on the first micro-batch."""
    inj = rt.injector
    if not (inj.armed("forward", iteration) or inj.armed("backward", iteration)):
        return forward_step_func
    state = {"calls": 0}

    def forward_step(*a, **kw):
        state["calls"] += 1
        first = state["calls"] == 1
        if first:
            inj.fire("forward", iteration)
        out = forward_step_func(*a, **kw)
        if first and inj.armed("backward", iteration):
            tensor = out[0] if isinstance(out, tuple) else out
            if getattr(tensor, "requires_grad", False):
                tensor.register_hook(lambda grad: inj.fire("backward", iteration))
        return out

    return forward_step


def _train_step(wrapped, instance, args, kwargs):
    from mindspeed_ha.runtime import get_runtime

    rt = get_runtime()
    if rt is None:
        return wrapped(*args, **kwargs)
    bound = _signature(wrapped).bind(*args, **kwargs)  # once per function, not per iteration
    call = bound.arguments
    rt.attach(call.get("model"), call.get("optimizer"), call.get("opt_param_scheduler"))
    iteration = rt.enter_iteration()
    if "forward_step_func" in call:
        call["forward_step_func"] = _with_injection(call["forward_step_func"], rt, iteration)
    try:
        result = wrapped(*bound.args, **bound.kwargs)
    except Exception as exc:  # SystemExit / KeyboardInterrupt pass through
        rt.handle_fault(exc)
        raise
    rt.iteration_done()
    return result


def _grad_sync_injection(wrapped, instance, args, kwargs):
    from mindspeed_ha.runtime import get_runtime

    rt = get_runtime()
    if rt is not None and rt.current is not None:
        rt.injector.fire("grad_sync", rt.current)
    return wrapped(*args, **kwargs)


PATCHES = [
    Patch(
        name="ha.start_runtime",
        module="megatron.core.parallel_state",
        attribute="initialize_model_parallel",
        wrapper=_start_runtime,
        feature="ha",
        doc="after model-parallel init: layout, auth key, controller, processor thread",
    ),
    Patch(
        name="ha.train_step.megatron",
        module="megatron.training.training",
        attribute="train_step",
        wrapper=_train_step,
        feature="ha",
        versions=None,
        doc="exception decorator + step protocol around Megatron-LM's train_step",
    ),
    Patch(
        name="ha.train_step.trainer",
        module="mindspeed_ha.testing.trainer.training",
        attribute="train_step",
        wrapper=_train_step,
        feature="ha",
        versions=None,
        doc="exception decorator + step protocol around mindspeed_ha.testing.trainer's train_step",
    ),
    Patch(
        name="testing.inject_grad_sync",
        module="megatron.core.distributed.param_and_grad_buffer",
        attribute="_ParamAndGradBucketGroup.finish_grad_sync",
        wrapper=_grad_sync_injection,
        feature="testing",
        doc="fault injector hook at DDP gradient synchronisation",
    ),
]
