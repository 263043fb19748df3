"""Feature ``ha``: bracket the optimizer update (adaptation point 2) and finish it in place.

``step_with_ready_grads`` is the part of ``optimizer.step()`` that mutates state (the
inner optimizer step, main -> model param copy, the distributed optimizer's param
all-gather); everything before it (grad copy, found-inf and grad-norm collectives) only
reads. So UPDATING(k) brackets exactly the mutation, and a rank that failed in the
grad-norm collective still holds a consistent state at ``k-1``. Nested calls (the
distributed optimizer calls its parent's method) report once.

With in-place recovery possible, the outermost bracket also holds the rank in a commit
barrier after its update (:meth:`HARuntime.commit_update`): no rank leaves the update of
k before every rank finished it. A fault inside the update (a UCE in the optimizer
state, a network error in the parameter all-gather) then finds every rank inside it,
reported as ``where="update"`` (this rank's update did not finish: its state is dirty)
or ``"update_done"`` (finished, waiting in the barrier). The controller's plan is a roll
forward (:mod:`mindspeed_ha.control.recovery_plan`): ranks whose update did not finish
receive the finished state from a replica that finished it, and every rank returns from
here as if its update had run (``True``, megatron-core 0.12.1's value for a done update),
so ``train_step`` goes on with its own frame: the grad norm, the losses and the
scheduler step are those the uninterrupted step computes.

Worker restart (``--enable-worker-reboot``) turns the commit barrier on too: a rank
SIGKILLed inside the update of j leaves every survivor inside it (some finished it, their
pre-update state gone), so the job rolls forward with the restarted process: it receives
the finished state of j from a replica and runs a catch-up step j, in which the script's
``train_step`` gets the holder's forward-backward losses and ``optimizer.step()`` values
instead of computing them (catch-up mode: ``_forward_backward`` and ``_catch_up_step``
below; what the holder sends was remembered by the same patches: the losses,
``clip_grad_norm`` / ``get_grad_norm``, ``count_zeros``), so it joins the survivors' rest of step j (Megatron-LM core_v0.12.1
``train_step``'s model-parallel all-reduces after ``optimizer.step()``, ``train``'s logging).
"""

from __future__ import annotations

import traceback

from .registry import Patch


def _update_bracket(wrapped, instance, args, kwargs):
    from mindspeed_ha.runtime import get_runtime

    rt = get_runtime()
    if rt is None or rt.current is None:
        return wrapped(*args, **kwargs)
    outer = not rt.in_update
    rt.begin_update()  # a recovery's abort raises here: the update has not begun
    try:
        if outer:
            rt.injector.fire("optimizer", rt.current, rt.ctx)
        result = wrapped(*args, **kwargs)
    except Exception as exc:  # SystemExit / KeyboardInterrupt pass through
        rt.abort_update()  # stays UPDATING: the state is dirty
        if not outer:
            raise
        return _finish_in_place(rt, exc, "update", True)
    rt.end_update()
    if outer:
        try:
            rt.commit_update()
        except Exception as exc:
            return _finish_in_place(rt, exc, "update_done", result)
    return result


def _finish_in_place(rt, exc: BaseException, where: str, result):
    """Report ``exc`` raised inside the update; on a roll-forward RETRY, recover and
    return ``result``; else raise ``exc`` (it carries the controller's action, e.g. a
    reload, for the ``train_step`` wrapper). A failed recovery is reported and the
    controller's next roll-forward RETRY followed (:meth:`HARuntime.recover`); any other
    answer raises the failure (its action is the ``train_step`` wrapper's)."""
    action = rt.handle_fault(exc, where=where)
    if action is None or getattr(action, "kind", None) != "retry" or action.params.get("mode") != "forward":
        raise exc
    traceback.clear_frames(exc.__traceback__)  # the aborted frames' locals hold the old groups
    rt.recover(action, where=where, modes=("forward",))
    if where == "update":
        rt.end_update_by_repair()
    return result


def _noting(key: str, what: str):
    """A wrapper that remembers ``what`` returns, as ``rt.step_stats[key]``, for the step in
    progress (what ``optimizer.step()`` returns; a restarted process's catch-up step answers
    it, see :func:`mindspeed_ha.recovery.handover.inside_update`)."""

    def note(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        from mindspeed_ha.runtime import get_runtime

        rt = get_runtime()
        if rt is not None and rt.current is not None:
            rt.step_stats[key] = result
        return result

    note.__doc__ = f"``{what}``: remember its result for the step in progress (``step_stats[{key!r}]``)."
    return note


#: ``clip_grad_norm`` / ``ChainedOptimizer.get_grad_norm``
_note_grad_norm = _noting("grad_norm", "clip_grad_norm")
#: ``count_zeros``
_note_zeros = _noting("num_zeros", "count_zeros")


def _forward_backward(wrapped, instance, args, kwargs):
    """``get_forward_backward_func()`` as ``train_step`` calls it: the schedule it returns
    is wrapped to remember its result (the per-micro-batch losses of the step in
    progress, which a restarted process's catch-up step needs), and in that catch-up
    step (``rt.state.catching_up``) replaced by one that returns the holder's
    losses without computing (the state after the step's update was received)."""
    schedule = wrapped(*args, **kwargs)
    from mindspeed_ha.runtime import get_runtime

    rt = get_runtime()
    if rt is None or rt.processor is None:
        return schedule

    def forward_backward(*a, **kw):
        if rt.state.catching_up is not None:
            return rt.catch_up_losses()
        result = schedule(*a, **kw)
        if rt.current is not None:
            rt.step_stats["losses"] = result
        return result

    return forward_backward


def _catch_up_step(wrapped, instance, args, kwargs):
    """``optimizer.step()``: in a restarted process's catch-up step (ARF roll forward, see
    :meth:`HARuntime._start_catch_up`) the attached optimizer's first call is answered
    with the holder's ``(True, grad norm, zero count)`` without touching the state (it
    holds the finished update of the step already); every other call runs as usual."""
    from mindspeed_ha.runtime import get_runtime

    rt = get_runtime()
    answer = rt.catch_up_step(instance) if rt is not None else None
    if answer is None:
        return wrapped(*args, **kwargs)
    return answer


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
        doc="begin_update(k) / end_update(k) around the optimizer's state mutation; commit barrier; roll forward",
    )
    for module, attr in _TARGETS
]
PATCHES += [
    Patch(name=f"optimizer.note_grad_norm.{cls}", module="megatron.core.optimizer.optimizer",
          attribute=f"{cls}.{method}", wrapper=_note_grad_norm, feature="ha",
          doc="remember the step's gradient norm (a restarted process's catch-up step answers it)")
    for cls, method in (("MegatronOptimizer", "clip_grad_norm"), ("ChainedOptimizer", "get_grad_norm"))
] + [
    Patch(name=f"optimizer.note_zeros.{cls}", module="megatron.core.optimizer.optimizer",
          attribute=f"{cls}.count_zeros", wrapper=_note_zeros, feature="ha",
          doc="remember the step's gradient zero count (a restarted process's catch-up step answers it)")
    for cls in ("MegatronOptimizer", "ChainedOptimizer")
] + [
    Patch(name=f"worker_reboot.catch_up_step.{cls}", module="megatron.core.optimizer.optimizer",
          attribute=f"{cls}.step", wrapper=_catch_up_step, feature="worker_reboot",
          doc="ARF roll forward: a restarted process's catch-up step answers optimizer.step() from the holder")
    for cls in ("MixedPrecisionOptimizer", "FP32Optimizer", "ChainedOptimizer")
] + [
    Patch(name=f"ha.forward_backward.{name}", module=module, attribute="get_forward_backward_func",
          wrapper=_forward_backward, feature="ha", versions=None,
          doc="remember the step's losses; a restarted process's catch-up step answers them (ARF roll forward)")
    for name, module in (("megatron", "megatron.training.training"),
                         ("trainer", "mindspeed_ha.testing.trainer.training"))
]
