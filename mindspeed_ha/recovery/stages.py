"""Recovery as plans of stages: plan mode -> the ordered stages every rank runs.

The controller's :class:`~mindspeed_ha.control.recovery_plan.RecoveryPlan` says what to
do (its ``mode``); this module says how, as data: :data:`IN_PLACE` (a survivor, in its
training thread, :func:`mindspeed_ha.recovery.executor.recover`) and :data:`REJOINING`
(a restarted process at its rejoin point, :func:`mindspeed_ha.recovery.executor.rejoin`)
map each mode to ``(name, stage)`` pairs. A stage is a function of one
:class:`RecoveryContext`; the executor runs them in order and times each one (its name is
the key of the RETRY result's seconds and of the rank's phase event).

In place (every rank, the same order):

* ``rollback`` / ``rejoin``: clean (pending communication handles, grad buckets and their
  flags, gradients, timers: :func:`rollback.clean`); rebuild every process group
  (:func:`groups.rebuild_process_groups`, generation ``plan.generation``; the start-up
  fallback group is kept); repair (a damaged rank receives its parameters and optimizer
  shard from its replica holder, point to point over the new world group:
  :mod:`transfer`; a restarted rank also its progress); roll back (the data iterators
  replay the batches of the aborted attempt, the RNG returns to the attempt's entry).
  Model and optimizer are still those of ``plan.iteration``: the plan is only made when
  no rank started the optimizer update.
* ``forward`` (every rank was stopped inside the optimizer update of ``plan.iteration``):
  clean only the in-flight communication (the step goes on after its update: grads and
  timers are kept), rebuild, repair (a rank whose update did not finish gets the finished
  state from a rank that finished it); no roll back.
* ``reload`` (no replica): clean, rebuild, reload the latest periodic checkpoint in place
  (:func:`reload.reload_in_place`, sets the re-runs), repair (a restarted rank gets the
  loop's counters only).

A new recovery mode is a policy function (control/recovery_plan.py), a stage list here
and its tests.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from typing import Any, Callable, Dict, Optional, Tuple

from mindspeed_ha import env as ha_env
from mindspeed_ha.integrations import megatron_lm

log = logging.getLogger("mindspeed_ha.runtime")


@dataclasses.dataclass
class RecoveryContext:
    """What the stages of one recovery share.

    Attributes:
        rt: the rank's runtime (:class:`mindspeed_ha.runtime.HARuntime`; its public API).
        plan: the RETRY's plan.
        model, optimizer, scheduler, args: the rank's training state (None before the
            first step attached it).
        repaired: how many times this rank received state (0: it repaired no one / was not repaired).
        received: a restarted process: the progress it received.
    """

    rt: Any
    plan: Any
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    args: Any = None
    repaired: int = 0
    received: Optional[dict] = None

    @property
    def rank(self) -> int:
        return self.rt.rank


Stage = Callable[[RecoveryContext], None]


def check_no_stale_holders(rank: int) -> None:
    """``MINDSPEED_HA_TESTING_CHECK_HOLDERS=1`` (tests): after a rebuild, nothing but
    torch's registries may still hold a replaced group (parallel_state's TP-DP / TP-CP
    groups, DDP buckets, the optimizer, Megatron's timers' barrier group...): raise
    naming them (the recovery then fails and falls back, so a test sees it). A replaced
    group still alive after a full collection is held somewhere; then the whole-heap walk
    names the holders (~0.3-1 s)."""
    if os.environ.get(ha_env.TESTING_CHECK_HOLDERS) != "1":
        return
    import gc

    from mindspeed_ha.recovery import groups

    gc.collect()
    alive = groups.retired_groups()
    stale = groups.stale_holders(alive) if alive else []
    del alive
    if stale:
        raise RuntimeError(f"rank {rank}: {len(stale)} holder(s) still reference a replaced process group: "
                           f"{stale[:8]}")
    log.warning("rank %d: no holder of a replaced process group is left (%s)", rank, ha_env.TESTING_CHECK_HOLDERS)


def _rebuild_groups(c: RecoveryContext):
    """Every process group of generation ``plan.generation`` (the fallback group kept);
    bounded: a member that never comes fails the rebuild (-> the dying checkpoint) instead
    of waiting Megatron's --distributed-timeout-minutes."""
    from mindspeed_ha.recovery import groups

    exclude = c.rt.fallback_group.groups() if c.rt.fallback_group is not None else []
    return groups.rebuild_process_groups(c.plan.generation, exclude=exclude,
                                         timeout=datetime.timedelta(seconds=c.rt.config.action_timeout_s))


def _repairs(c: RecoveryContext) -> Dict[int, int]:
    """The plan's repairs (damaged rank -> source), or none with ``MINDSPEED_HA_TESTING_SKIP_REPAIR=1``."""
    repairs = c.plan.repairs
    if repairs and os.environ.get(ha_env.TESTING_SKIP_REPAIR) == "1":
        log.error("rank %d: %s=1: the repair is SKIPPED (testing only): the damaged state stays",
                  c.rank, ha_env.TESTING_SKIP_REPAIR)
        return {}
    return repairs


# ---- in place (a survivor, training thread) ---------------------------------------------------
def clean(c: RecoveryContext) -> None:
    """Abandon the aborted attempt: communication, grad buckets, gradients, timers (the
    attempt's entry timers kept), Megatron's rerun state machine; the grad scalers back to
    the attempt's entry (before the repair: a source sends that state)."""
    from mindspeed_ha.recovery import comm, rollback

    comm.reset()
    c.rt.state.update_depth = 0
    rollback.clean(c.model, c.optimizer, rerun_state=c.rt.state.rerun_state, keep_timers=c.rt.state.entry_timers,
                   grad_scalers=c.rt.state.entry_scalers)


def clean_communication(c: RecoveryContext) -> None:
    """Roll forward: abandon only the in-flight communication (the step goes on after its
    update: gradients and timers are kept)."""
    from mindspeed_ha.recovery import comm, rollback

    comm.reset()
    c.rt.state.update_depth = 0
    rollback.clean_communication(c.model)


def rebuild(c: RecoveryContext) -> None:
    """The injector's ``recover`` point (testing), then every process group anew."""
    c.rt.injector.fire("recover", c.plan.iteration + 1, c.rt.ctx)
    _rebuild_groups(c)
    check_no_stale_holders(c.rank)


def reload_in_place(c: RecoveryContext) -> None:
    """Every rank: the latest periodic checkpoint in place; the iterations after it are
    re-run by the ``train_step`` wrapper (:func:`reload.rerun`) before k+1."""
    from mindspeed_ha.recovery import reload

    c.rt.state.reruns = reload.reload_in_place(c.rt, c.plan)


def _transfer_state(c: RecoveryContext, progress_of: Callable[[Any, int], dict]) -> None:
    """Damaged ranks receive their state from their source; a restarted rank (in
    ``plan.rejoin``) also its progress, ``progress_of(rt, plan.iteration)``."""
    from mindspeed_ha.recovery import progress, transfer

    for dst, src in sorted(_repairs(c).items()):
        if c.rank == dst:
            transfer.recv_state(c.model, c.optimizer, src, None)
            c.repaired += 1
        elif c.rank == src:
            transfer.send_state(c.model, c.optimizer, dst, None)
            if dst in c.plan.rejoin:  # a restarted process: also the counters, scheduler, RNG
                progress.send(progress_of(c.rt, c.plan.iteration), dst)


def repair(c: RecoveryContext) -> None:
    """Rollback: the state of k; a restarted rank also the progress at the end of k."""
    from mindspeed_ha.recovery import handover

    _transfer_state(c, handover.after)


def repair_forward(c: RecoveryContext) -> None:
    """Roll forward: the finished update of j; a restarted rank also the progress as at
    the entry of j's update and j's forward-backward results (its catch-up step)."""
    from mindspeed_ha.recovery import handover

    _transfer_state(c, handover.inside_update)


def repair_at_pause(c: RecoveryContext) -> None:
    """A hot switch's replica fallback (its outgoing process died in its handoff), a paused
    rank that stays: a replica holder sends the new process the state of K and the progress
    at the pause (:func:`handover.at_pause`: counters and scheduler of K, the RNG of the entry
    of K+1), as the outgoing process would have, over the switch's groups; the others have
    nothing to do."""
    from mindspeed_ha.recovery import handover

    _transfer_state(c, handover.at_pause)


def send_counters(c: RecoveryContext) -> None:
    """Reload with a restarted rank: its source sends it the loop's counters of k only
    (it loads the checkpoint itself)."""
    from mindspeed_ha.recovery import handover, progress

    for dst, src in sorted(_repairs(c).items()):
        if c.rank == src:
            progress.send(handover.counters(c.rt, c.plan.iteration), dst)


def roll_back(c: RecoveryContext) -> None:
    """The data iterators replay the aborted attempt's batches; the RNG returns to its entry."""
    for wrapper in c.rt.state.replay_wrappers():
        wrapper.rewind()
    if c.rt.state.entry_rng is not None:
        megatron_lm.set_rng_state(c.rt.state.entry_rng)


_ROLLBACK = (("clean", clean), ("rebuild", rebuild), ("repair", repair), ("rollback", roll_back))
#: plan mode -> the stages of an in-place recovery (a survivor)
IN_PLACE: Dict[str, Tuple[Tuple[str, Stage], ...]] = {
    "rollback": _ROLLBACK,
    "rejoin": _ROLLBACK,
    "forward": (("clean", clean_communication), ("rebuild", rebuild), ("repair", repair_forward)),
    "reload": (("clean", clean), ("rebuild", rebuild), ("reload", reload_in_place), ("repair", send_counters)),
    # a hot switch (recovery/switch.py): the paused ranks that stay only rebuild, on their
    # action thread; the outgoing rank hands its state to its new process instead (SWITCH_OUT)
    "switch": (("rebuild", rebuild),),
    # its replica fallback: the groups stay as rebuilt, a replica holder sends (action thread)
    "switch_repair": (("repair", repair_at_pause),),
}


# ---- rejoining (a restarted process, at its rejoin point) ---------------------------------------
def check_catch_up_possible(args) -> None:
    """A catch-up step (roll forward with rejoin) answers the forward-backward once:
    megatron-core's rerun state machine must be off (``--rerun-mode disabled``, the
    default), else its validation re-runs and data-iterator checkpoints would differ
    from the survivors'; no batch-size ramp-up (``--rampup-batch-size``: Megatron-LM's
    loop sizes the step from the consumed samples, which the catch-up step holds at j's
    end until it starts). Raises RuntimeError (the job takes the dying checkpoint)."""
    if getattr(args, "rampup_batch_size", None):
        raise RuntimeError("a catch-up step is not exact with --rampup-batch-size")
    try:
        from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine
    except ImportError:  # pragma: no cover - megatron-core always has it
        return
    mode = get_rerun_state_machine().mode
    if mode != RerunMode.DISABLED:
        raise RuntimeError(f"a catch-up step needs --rerun-mode disabled (it is {mode.value})")


def rebuild_rejoining(c: RecoveryContext) -> None:
    """Every process group with the survivors (the start-up's deferred groups become real ones)."""
    from mindspeed_ha.recovery import rejoin

    rejoin.preload()  # the record lives in the first generation's store
    with rejoin.live():  # the rejoin's own communication is real, not replayed
        report = _rebuild_groups(c)
        log.info("rank %d: rejoin rebuilt %d groups: %s", c.rank, report.groups_rebuilt, report.groups)
        check_no_stale_holders(c.rank)


def reload_rejoining(c: RecoveryContext) -> None:
    """No replica: the latest periodic checkpoint, loaded with the survivors (collective)."""
    from mindspeed_ha.recovery import rejoin, reload

    with rejoin.live():
        c.rt.state.reruns = reload.reload_for_rejoin(c.rt, c.plan)


def _take_progress(c: RecoveryContext, received: dict) -> None:
    """The received RNG (for the first step) and, restarted inside the update of j, the
    catch-up step j (the data iterators, built next, start after j)."""
    from mindspeed_ha.recovery import progress

    c.received = received
    state = c.rt.state
    if received.get("rng") is not None:
        state.rejoin_rng = progress.decode_rng(received["rng"])
    if received.get("forward") is not None:  # restarted inside the update of j: catch up step j
        check_catch_up_possible(c.args)
        state.catch_up = received["forward"]
        c.args.consumed_train_samples += int(state.catch_up["samples"])  # the iterators start after j


def receive_state(c: RecoveryContext) -> None:
    """The parameters and optimizer shard, then the progress (counters, scheduler, RNG),
    from the plan's source."""
    from mindspeed_ha.recovery import progress, rejoin, transfer

    src = c.plan.repairs[c.rank]
    with rejoin.live():
        transfer.recv_state(c.model, c.optimizer, src, None, materialize=True)
        received = progress.recv(src)
    progress.apply(received, c.args, c.scheduler)
    _take_progress(c, received)


def receive_counters(c: RecoveryContext) -> None:
    """After the reload: the loop's counters of k from the plan's source. The data
    iterators (built next) start after the checkpoint: the re-runs read its batches; the
    loop's counters are k's from the first step on (``enter_iteration`` puts them back)."""
    from mindspeed_ha.recovery import progress, rejoin

    with rejoin.live():
        received = progress.recv(c.plan.repairs[c.rank])
    loaded = c.args.consumed_train_samples
    progress.apply(received, c.args, None)
    c.rt.state.resume_consumed, c.args.consumed_train_samples = c.args.consumed_train_samples, loaded
    _take_progress(c, received)


def _pair_link(c: RecoveryContext, me: int):
    from mindspeed_ha.recovery import groups
    from mindspeed_ha.recovery.pair_link import PairLink

    timeout = datetime.timedelta(seconds=c.rt.config.action_timeout_s)
    return PairLink(groups.rendezvous_store(), c.plan.generation, c.rank, me, timeout)


def send_handoff(c: RecoveryContext) -> None:
    """A hot switch's outgoing rank (paused after ``plan.iteration``): its state (parameters,
    optimizer shard, host state) and progress (counters, scheduler, RNG at the entry of the
    next step) to its new process, over a :class:`~.pair_link.PairLink`."""
    from mindspeed_ha.recovery import handover, progress, transfer
    from mindspeed_ha.recovery.pair_link import INCOMING, OUTGOING

    c.rt.injector.fire("recover", c.plan.iteration + 1, c.rt.ctx)  # testing: e.g. dies before its handoff
    link = _pair_link(c, OUTGOING)
    try:
        stats = transfer.send_state(c.model, c.optimizer, INCOMING, link)
        c.rt.injector.fire("handoff", 1, c.rt.ctx)  # testing: e.g. dies in the middle of it (its only one)
        progress.send(handover.at_pause(c.rt, c.plan.iteration), INCOMING, link)
    finally:
        link.close()
    log.warning("rank %d: hot switch: state of iteration %d sent to the new process (%s)", c.rank,
                c.plan.iteration, stats)


def receive_handoff(c: RecoveryContext) -> None:
    """A hot switch's new process (after the rebuild): the state and progress from the
    outgoing process of its rank, not from a replica; from now on it is the rank."""
    from mindspeed_ha.recovery import progress, rejoin, transfer
    from mindspeed_ha.recovery.pair_link import INCOMING, OUTGOING

    with rejoin.live():
        link = _pair_link(c, INCOMING)
        try:
            transfer.recv_state(c.model, c.optimizer, OUTGOING, link, materialize=True)
            received = progress.recv(OUTGOING, link)
        finally:
            link.close()
    progress.apply(received, c.args, c.scheduler)
    _take_progress(c, received)
    if c.rt.processor is not None:
        c.rt.processor.switching = False  # a REGISTER again (a new controller) is the rank's


def receive_from_replica(c: RecoveryContext) -> None:
    """A hot switch's new process whose handoff failed (its outgoing process died), parked
    again at its rejoin point: the state of K and the progress from the plan's replica holder
    (:func:`receive_state`, ARF's rejoin repair) on the groups it rebuilt for the switch;
    from now on it is the rank."""
    receive_state(c)
    if c.rt.processor is not None:
        c.rt.processor.switching = False


_REJOIN = (("rebuild", rebuild_rejoining), ("repair", receive_state))
#: plan mode -> the stages of a restarted process's rejoin
REJOINING: Dict[str, Tuple[Tuple[str, Stage], ...]] = {
    "rejoin": _REJOIN,
    "forward": _REJOIN,
    "reload": (("rebuild", rebuild_rejoining), ("reload", reload_rejoining), ("repair", receive_counters)),
    "switch": (("rebuild", rebuild_rejoining), ("repair", receive_handoff)),
    "switch_repair": (("repair", receive_from_replica),),
}


#: a hot switch's outgoing rank (recovery/switch.py)
SWITCH_OUT: Tuple[Tuple[str, Stage], ...] = (("transfer", send_handoff),)


def rejoining(plan, rank: int) -> Tuple[Tuple[str, Stage], ...]:
    """The stages by which ``rank`` rejoins under ``plan``.

    Raises:
        RuntimeError: the plan does not rejoin this rank.
    """
    if plan.mode not in REJOINING or rank not in plan.rejoin or rank not in plan.repairs:
        raise RuntimeError(f"rank {rank}: a {plan.mode} plan does not rejoin this rank ({plan.reason})")
    return REJOINING[plan.mode]
