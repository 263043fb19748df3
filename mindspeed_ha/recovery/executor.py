"""The recovery executor: runs a plan's stages (:mod:`mindspeed_ha.recovery.stages`) in
order, records each one as a phase event of the rank (``EventRecorder("rank-<r>")``) and
sends the RETRY result built from those events: the seconds of each stage by its name
(``clean``, ``rebuild``, ``reload``, ``repair``, ``rollback``), with the rank, iteration,
generation, mode and whether it was repaired.

A stage that raises ends the attempt: the failure is logged and sent as the RETRY result
(the controller falls back to the dying checkpoint, or a controller successor plans again)
and re-raised; the caller (``HARuntime.recover``, ``HARuntime.rejoin_after_setup``) reports
it as a fault and follows the controller's next action (:func:`next_plan`).
"""

from __future__ import annotations

import json
import logging
import traceback
from typing import Dict, Optional, Sequence, Tuple

from mindspeed_ha.recovery import stages as stage_table
from mindspeed_ha.recovery.stages import RecoveryContext, Stage

log = logging.getLogger("mindspeed_ha.runtime")


def run_stages(stages: Sequence[Tuple[str, Stage]], c: RecoveryContext, recorder) -> Dict[str, float]:
    """Run ``stages`` in order, each one timed as a phase event of ``recorder``.

    Returns:
        Seconds per stage name (rounded to 1 us), read from the events.

    Raises:
        Whatever a stage raised (its event has ``ok=False``).
    """
    times: Dict[str, float] = {}
    for name, stage in stages:
        with recorder.phase(name, c.plan.iteration, mode=c.plan.mode, generation=c.plan.generation, rank=c.rank):
            stage(c)
        times[name] = round(recorder.last(name).seconds, 6)
    return times


def _failed(rt, action, exc: BaseException, what: str) -> None:
    """A recovery stage raised ``exc``: log it and send the failure as the RETRY result;
    the caller re-raises."""
    from mindspeed_ha.faults import describe

    log.exception("rank %d: %s failed", rt.rank, what)
    rt.processor.action_result(action.action_id, False, describe(exc))


def next_plan(rt, failure: BaseException, where: str, modes: Optional[Tuple[str, ...]] = None):
    """A recovery (or rejoin) attempt failed with ``failure`` (already sent as its RETRY
    result): report it as a fault of ``where`` (news, also when raised while handling the
    fault it recovers from) and return the controller's next action when it is a RETRY whose
    mode is in ``modes`` (any mode if None): a new plan, e.g. a controller successor's with
    its rendezvous store after the controller's node was lost during this recovery.

    A rank whose own state still holds a UCE's damage (``rt.unrepaired``: the recovery
    that was to repair it failed) reports the failure as that UCE
    (:class:`~mindspeed_ha.errors.UnrepairedDamage`, from ``failure``): the next plan
    repairs or reloads it and never takes its state as a source (before, the failed
    rebuild was reported as a network fault and a successor's rejoin plan copied the
    damaged parameters to the restarted ranks: exit 0, wrong losses).

    Raises:
        ``failure`` (or the UnrepairedDamage raised from it): the answer is anything else
            (the dying checkpoint: its DUMP runs on the action thread and its EXIT ends the
            process meanwhile; None: no controller).
    """
    damage = getattr(rt, "unrepaired", None)
    if damage is not None:  # reported as the UCE it still is: no plan may take this rank's state as a source
        from mindspeed_ha.errors import UnrepairedDamage

        wrapped = UnrepairedDamage(f"rank {rt.rank}: {damage} not repaired: the recovery failed: {failure}")
        wrapped.__cause__ = failure
        failure = wrapped
    action = rt.handle_fault(failure, where=where, news=True)
    mode = (getattr(action, "params", None) or {}).get("mode")
    if getattr(action, "kind", None) != "retry" or (modes is not None and mode not in modes):
        raise failure
    log.warning("rank %d: the recovery failed (%s); the controller's next plan (%s) is carried out", rt.rank,
                failure, mode)
    release_frames(failure)  # the failed attempt's locals hold old process groups
    return action


def release_frames(exc: BaseException) -> int:
    """Clear the local variables of every finished frame in the tracebacks of ``exc`` and of
    every exception it chains to (``__cause__``, ``__context__``, recursively; frames still
    running are left alone). Returns how many exceptions were visited.

    Why: a failed rebuild's cause (e.g. gloo's ``DistNetworkError`` from
    ``groups._create_like``) keeps the frames that raised it, whose locals hold the old process
    groups; the fault report keeps the exception, so the next rebuild found a destroyed group
    still alive and took the full collection and the whole-heap walk (a 3-15 s rebuild
    instead of 0.4 s, measured on the failover job beside two CPU hogs, the training
    thread holding the GIL in each gc call) -- clearing only the outer traceback left the
    chain's frames.
    """
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]
    return len(seen)


#: the log line of a recovery done, by plan mode (None: the modes that re-run the next step)
_RECOVERED = {
    "forward": "rank %(rank)d: recovered in place (%(kind)s, generation %(generation)d): iteration %(iteration)d "
               "goes on after its optimizer update; seconds %(times)s",
    None: "rank %(rank)d: recovered in place (%(kind)s, %(mode)s, generation %(generation)d): re-running "
          "iteration %(next)d; seconds %(times)s",
}


def recover(rt, action) -> Dict[str, float]:
    """Carry out RETRY(plan) in place (a survivor, training thread): the stages of
    ``stages.IN_PLACE[plan.mode]``; then the caller re-runs the step (roll forward: it
    returns from the optimizer update and the step goes on).

    Returns:
        Seconds per stage, also sent to the controller as the RETRY result.

    Raises:
        Whatever a stage raised (after the failure was sent as the RETRY result).
    """
    from mindspeed_ha.control.recovery_plan import RecoveryPlan

    plan = RecoveryPlan.from_params(action.params)
    ctx = rt.ctx
    c = RecoveryContext(rt, plan, model=ctx.model if ctx is not None else None,
                        optimizer=ctx.optimizer if ctx is not None else None)
    try:
        times = run_stages(stage_table.IN_PLACE[plan.mode], c, rt.events)
    except Exception as exc:
        _failed(rt, action, exc, "in-place recovery")
        raise
    rt.unrepaired = None  # repaired from a replica, or the whole state reloaded
    rt.mark_recovered()
    detail = dict(times, rank=rt.rank, iteration=plan.iteration, generation=plan.generation,
                  repaired=bool(c.repaired), mode=plan.mode)
    log.warning(_RECOVERED.get(plan.mode, _RECOVERED[None]), dict(
        rank=rt.rank, kind=plan.kind.value, mode=plan.mode, generation=plan.generation, iteration=plan.iteration,
        next=plan.iteration + 1, times=times))
    rt.processor.action_result(action.action_id, True, json.dumps(detail, sort_keys=True))
    return times


def rejoin(rt, action, model, optimizer, opt_param_scheduler) -> Dict[str, float]:
    """Carry out RETRY(plan) in a restarted process at its rejoin point: the stages of
    ``stages.REJOINING[plan.mode]``.

    Raises:
        RuntimeError: the plan does not rejoin this rank; or whatever a stage raised
            (after the failure was sent as the RETRY result).
    """
    from mindspeed_ha.control.recovery_plan import RecoveryPlan

    plan = RecoveryPlan.from_params(action.params)
    ctx = rt.ctx
    try:
        stages = stage_table.rejoining(plan, rt.rank)
        c = RecoveryContext(rt, plan, model=ctx.model if ctx is not None else model, optimizer=optimizer,
                            scheduler=opt_param_scheduler, args=ctx.args if ctx is not None else rt.args)
        times = run_stages(stages, c, rt.events)
    except Exception as exc:
        _failed(rt, action, exc, "rejoin")
        raise
    rt.mark_recovered()
    incarnation = rt.processor.incarnation
    log.warning("rank %d (incarnation %d): rejoined at iteration %d from rank %d; seconds %s", rt.rank,
                incarnation, plan.iteration, plan.repairs[rt.rank], times)
    rt.processor.action_result(action.action_id, True, json.dumps(
        dict(times, rank=rt.rank, iteration=plan.iteration, generation=plan.generation, repaired=True,
             mode=plan.mode, incarnation=incarnation), sort_keys=True))
    return times
