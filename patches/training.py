"""Feature ``ha``: start the runtime and put the exception decorator around the whole run.

Adaptation points 1 (start processors once model-parallel groups exist) and 5 (catch,
classify, report, wait for the controller's action). The wrapped ``train_step`` has
Megatron-LM core_v0.12.1's signature ``train_step(forward_step_func, data_iterator,
model, optimizer, opt_param_scheduler, config)``; the same wrapper serves Megatron-LM's
``megatron.training.training`` and our Megatron-shaped ``mindspeed_ha.testing.trainer.training``.

Fault guards (:func:`_guard`) cover what runs around ``train_step`` once training has
started, with the same path (:meth:`HARuntime.handle_fault`): the rest of the training
loop (``train``: logging, batch-size ramp-up, exit checks, between iterations), every
``save_checkpoint`` (periodic ones inside ``train``, the final one in ``pretrain``) and
``evaluate_and_print_results`` (during training and after it). A fault there is reported
with the last completed iteration; a rank blocked in a collective with a dead peer
(e.g. the save's barrier, Megatron-LM checkpointing.py ``save_checkpoint``) gets gloo's
"Connection closed by peer" and waits for the controller's action instead of exiting 1.
Start-up (model build, ``--load``, data iterator creation) is not guarded: before the
first iteration there is nothing a dying checkpoint could add, and a configuration
error there must surface as itself.
"""

from __future__ import annotations

import functools
import inspect
import traceback

from .registry import Patch

#: what the main thread is inside of, outermost first ("train", "save", "final_save", "eval")
_activity: list = []
#: (point, iteration) of an armed save fault, fired at the save's first barrier (testing)
_save_fault: list = []


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
    from mindspeed_ha.recovery import reload

    bound = _signature(wrapped).bind(*args, **kwargs)  # once per function, not per iteration
    call = bound.arguments
    rt.attach(call.get("model"), call.get("optimizer"), call.get("opt_param_scheduler"),
              loader=reload.script_loader(wrapped))
    if "data_iterator" in call:  # a re-run of the step reads the same batches again
        call["data_iterator"] = rt.replay_iterator(call["data_iterator"])
    forward_step_func = call.get("forward_step_func")
    iteration = None
    while True:
        try:
            # first: the RNG and timers at the step's entry (a recovery's abort may already
            # stop this rank in enter_iteration's pause point; the re-run starts from here)
            rt.begin_attempt()
            if iteration is None:
                iteration = rt.enter_iteration()
                reload.track(rt)  # no replica: the data since the last save is kept for a reload
                if forward_step_func is not None:
                    call["forward_step_func"] = _with_injection(forward_step_func, rt, iteration)
                if rt.state.reruns:  # ARF without a replica: a restarted process re-runs those after its checkpoint
                    reload.rerun(rt, lambda: wrapped(*bound.args, **bound.kwargs))
            result = wrapped(*bound.args, **bound.kwargs)
            break
        except Exception as exc:  # SystemExit / KeyboardInterrupt pass through
            action = rt.handle_fault(exc)
            if action is None or getattr(action, "kind", None) != "retry":
                raise
            # the aborted attempt's frames (kept by the tracebacks) hold the old process
            # groups and their ops' Works in their locals: cleared, so the rebuild leaves no
            # holder behind and the old groups' sockets and threads go with them
            _clear_frames(exc)
        # RETRY (in-place recovery): clean, rebuild groups, repair, roll back (a reload: the
        # iterations after the checkpoint re-run first, results discarded); then re-run the
        # step. A failure is reported as a new fault and the controller's next action
        # followed: another RETRY (e.g. a controller successor's plan) recovers again; the
        # dying checkpoint's EXIT ends this rank; anything else raises the failure here.
        rt.recover(action, then=lambda: _rerun_after_reload(rt, wrapped, bound))
    rt.iteration_done()
    return result


def _rerun_after_reload(rt, wrapped, bound) -> None:
    """After a reload (no replica): the iterations after the checkpoint, re-run silently."""
    if rt.state.reruns:
        from mindspeed_ha.recovery import reload

        reload.rerun(rt, lambda: wrapped(*bound.args, **bound.kwargs))


def _clear_frames(exc: BaseException) -> None:
    """Clear the locals of every finished frame in the tracebacks of ``exc`` and of the
    exceptions chained to it (``__context__``, ``__cause__``): a gloo Work left in a local
    keeps its group's context, sockets and event-loop thread alive until the garbage
    collector happens to break the exception -> traceback -> frame cycle (+4 descriptors
    and +1 thread per abandoned op, now and then, over 10 recoveries measured here)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        for chained in (exc.__cause__,):
            if chained is not None:
                _clear_frames(chained)
        exc = exc.__context__


def _guarded_call(rt, where: str, wrapped, args, kwargs):
    if _activity and _activity[-1] == where:  # a second guard of the same call (two layers): one reports
        return wrapped(*args, **kwargs)
    _activity.append(where)
    try:
        return wrapped(*args, **kwargs)
    except Exception as exc:  # SystemExit / KeyboardInterrupt pass through
        rt.handle_fault(exc, where=where)  # returns only if the controller cannot act
        raise
    finally:
        _activity.pop()


def _guard(where: str):
    """Fault guard for a function that runs outside ``train_step`` (``where`` names it in logs)."""

    def wrapper(wrapped, instance, args, kwargs):
        from mindspeed_ha.runtime import get_runtime

        rt = get_runtime()
        if rt is None:
            return wrapped(*args, **kwargs)
        return _guarded_call(rt, where, wrapped, args, kwargs)

    return wrapper


def _first_arg(args, kwargs, name: str, position: int):
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else None


def _save_guard(wrapped, instance, args, kwargs):
    """``save_checkpoint(iteration, ...)``: a periodic save inside ``train``, else the final save."""
    from mindspeed_ha.runtime import get_runtime

    rt = get_runtime()
    if rt is None:
        return wrapped(*args, **kwargs)
    if _activity and _activity[-1] in ("save", "final_save"):  # a second guard of the same save
        return wrapped(*args, **kwargs)
    point = "save" if "train" in _activity else "final_save"
    iteration = _first_arg(args, kwargs, "iteration", 0)
    armed = iteration is not None and rt.injector.armed(point, int(iteration))
    if armed:
        _save_fault[:] = [(point, int(iteration))]
    try:
        result = _guarded_call(rt, point, wrapped, args, kwargs)
    finally:
        _save_fault.clear()
    if iteration is not None:  # saved: the data kept for a reload (no replica) starts after it
        from mindspeed_ha.recovery import reload

        reload.on_save(rt, int(iteration))
    return result


def _eval_injection(wrapped, instance, args, kwargs):
    """``evaluate(forward_step_func, ...)``: an armed ``eval`` fault fires at its first forward step."""
    from mindspeed_ha.runtime import get_runtime

    rt = get_runtime()
    iteration = rt.completed if rt is not None else None
    if iteration is None or not rt.injector.armed("eval", iteration):
        return wrapped(*args, **kwargs)
    bound = _signature(wrapped).bind(*args, **kwargs)
    inner = bound.arguments["forward_step_func"]
    state = {"fired": False}

    def forward_step(*a, **kw):
        if not state["fired"]:
            state["fired"] = True
            rt.injector.fire("eval", iteration, rt.ctx)
        return inner(*a, **kw)

    bound.arguments["forward_step_func"] = forward_step
    return wrapped(*bound.args, **bound.kwargs)


def _save_barrier_injection(wrapped, instance, args, kwargs):
    """``torch.distributed.barrier`` during a save with an armed ``save``/``final_save`` fault:
    fire it at the save's first barrier, after this rank wrote its files."""
    if _save_fault:
        point, iteration = _save_fault.pop()
        from mindspeed_ha.runtime import get_runtime

        rt = get_runtime()
        if rt is not None:
            rt.injector.fire(point, iteration, rt.ctx)
    return wrapped(*args, **kwargs)


def _data_injection(wrapped, instance, args, kwargs):
    """``get_batch_on_this_tp_rank``: an armed ``data`` fault fires when this rank fetches a batch."""
    from mindspeed_ha.runtime import get_runtime

    rt = get_runtime()
    if rt is not None and rt.current is not None:
        rt.injector.fire("data", rt.current, rt.ctx)
    return wrapped(*args, **kwargs)


def _helper_dies_with_rank(wrapped, instance, args, kwargs):
    """``BaseManager.start`` in a rank: the manager's server process (Megatron-LM's
    ``torch_dist`` save starts one, megatron/core/dist_checkpointing/strategies/
    filesystem_async.py ``_get_write_results_queue``, and stops it only at a normal
    interpreter exit) runs :func:`_manager_server_setup` first, then the caller's own
    initializer. Runs in the rank; the setup in the server (a ``spawn`` child)."""
    import inspect

    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    user = bound.arguments.get("initializer")
    user_args = tuple(bound.arguments.get("initargs") or ())
    return wrapped(initializer=_manager_server_setup, initargs=(user, user_args))


def _manager_server_setup(user=None, user_args=()) -> None:
    """In a rank's manager server: it ends when the rank dies, by a signal or by the
    ``os._exit`` that ends a rank after a dying checkpoint (Linux
    ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, linux/prctl.h: 1), and on SIGTERM (that, or
    torchrun ending the worker's session) it removes its own ``multiprocessing`` directory
    (its listener socket; made by this process, named in its own config), then exits.
    Otherwise a killed rank's server outlived it, holding the rank's stdout and stderr (so
    whatever reads them never saw them close), and was later SIGKILLed with the rank's
    session, leaving its ``pymp-*`` directory in the temp dir. Elsewhere than Linux: only
    the caller's initializer."""
    import os
    import signal

    def end(signum, frame):  # noqa: ARG001 - signal handler signature
        from mindspeed_ha.mp_tempdir import release_own_tempdir

        release_own_tempdir()
        os._exit(0)

    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))
    except (OSError, AttributeError):  # no libc prctl: not Linux
        pass
    else:
        signal.signal(signal.SIGTERM, end)
        if os.getppid() != parent:  # the rank died before prctl took effect
            os._exit(0)
    if user is not None:
        user(*user_args)


def _grad_sync_injection(wrapped, instance, args, kwargs):
    from mindspeed_ha.runtime import get_runtime

    rt = get_runtime()
    if rt is not None and rt.current is not None:
        rt.injector.fire("grad_sync", rt.current)
    return wrapped(*args, **kwargs)


def _rejoin_after_setup(wrapped, instance, args, kwargs):
    """``setup_model_and_optimizer``: in a restarted process (ARF), rejoin the running job
    right after the model and optimizer exist (before the data iterators, so they start
    at the received consumed samples): :meth:`HARuntime.rejoin_after_setup`."""
    result = wrapped(*args, **kwargs)
    from mindspeed_ha.runtime import get_runtime

    rt = get_runtime()
    if rt is not None and rt.processor is not None and rt.processor.incarnation > 0 and rt.config.worker_reboot:
        model, optimizer, opt_param_scheduler = result[:3]
        from mindspeed_ha.recovery import reload

        rt.attach(model, optimizer, opt_param_scheduler, loader=reload.script_loader(wrapped))
        try:
            rt.rejoin_after_setup(model, optimizer, opt_param_scheduler)  # follows the controller's next RETRY
        except Exception as exc:  # no rejoin (a failure is reported already): the controller's verdict ends the rank
            rt.handle_fault(exc, where="rejoin")
            raise
    return result


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
        name="ha.rejoin.setup.megatron",
        module="megatron.training.training",
        attribute="setup_model_and_optimizer",
        wrapper=_rejoin_after_setup,
        feature="ha",
        versions=None,
        doc="ARF: a restarted process rejoins after its model and optimizer are built",
    ),
    Patch(
        name="ha.rejoin.setup.trainer",
        module="mindspeed_ha.testing.trainer.training",
        attribute="setup_model_and_optimizer",
        wrapper=_rejoin_after_setup,
        feature="ha",
        versions=None,
        doc="ARF: a restarted process rejoins after its model and optimizer are built (built-in trainer)",
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
        name="ha.guard.train.megatron",
        module="megatron.training.training",
        attribute="train",
        wrapper=_guard("train"),
        feature="ha",
        versions=None,
        doc="fault guard around Megatron-LM's training loop (between iterations, logging, exit checks)",
    ),
    Patch(
        name="ha.guard.save_checkpoint.megatron",
        module="megatron.training.training",
        attribute="save_checkpoint",
        wrapper=_save_guard,
        feature="ha",
        versions=None,
        doc="fault guard around Megatron-LM's periodic and final save_checkpoint",
    ),
    Patch(
        name="ha.guard.evaluate.megatron",
        module="megatron.training.training",
        attribute="evaluate_and_print_results",
        wrapper=_guard("eval"),
        feature="ha",
        versions=None,
        doc="fault guard around Megatron-LM's evaluation (during and after training)",
    ),
    Patch(
        name="ha.guard.train.trainer",
        module="mindspeed_ha.testing.trainer.training",
        attribute="train",
        wrapper=_guard("train"),
        feature="ha",
        versions=None,
        doc="fault guard around mindspeed_ha.testing.trainer's training loop",
    ),
    Patch(
        name="ha.guard.save_checkpoint.trainer",
        module="mindspeed_ha.testing.trainer.training",
        attribute="save_checkpoint",
        wrapper=_save_guard,
        feature="ha",
        versions=None,
        doc="fault guard around mindspeed_ha.testing.trainer's periodic and final save_checkpoint",
    ),
    # MindSpeed-LLM's pretrain_gpt.py calls its own pretrain, which calls its own train and
    # save_checkpoint (from megatron.training.checkpointing), not megatron.training.training's
    *[Patch(name=f"ha.guard.{what}.mindspeed_llm", module="mindspeed_llm.training.training", attribute=attr,
            wrapper=wrapper, feature="ha", versions=None, doc=f"fault guard around MindSpeed-LLM's own {attr}")
      for what, attr, wrapper in (("train", "train", _guard("train")), ("save_checkpoint", "save_checkpoint", _save_guard),
                                  ("evaluate", "evaluate_and_print_results", _guard("eval")))],
    Patch(
        name="ha.helper_dies_with_rank",
        module="multiprocessing.managers",
        attribute="BaseManager.start",
        wrapper=_helper_dies_with_rank,
        feature="ha",
        versions=None,
        doc="a multiprocessing manager's server process (torch_dist save) ends, and removes its temp dir, when its rank dies",
    ),
    Patch(
        name="testing.inject_eval",
        module="megatron.training.training",
        attribute="evaluate",
        wrapper=_eval_injection,
        feature="testing",
        versions=None,
        doc="fault injector hook at the first forward step of an evaluation",
    ),
    Patch(
        name="testing.inject_save",
        module="torch.distributed",
        attribute="barrier",
        wrapper=_save_barrier_injection,
        feature="testing",
        versions=None,
        doc="fault injector hook at the first barrier of a checkpoint save (this rank's files written)",
    ),
    Patch(
        name="testing.inject_data",
        module="megatron.training.utils",
        attribute="get_batch_on_this_tp_rank",
        wrapper=_data_injection,
        feature="testing",
        versions=None,
        doc="fault injector hook where a rank fetches a training batch",
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
