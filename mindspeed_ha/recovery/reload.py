"""In-place reload of the latest periodic checkpoint (a UCE that no replica can repair).

When a rank's device memory is damaged (UCE, ``--enable-hbmfault-repair``) and no healthy
rank holds a copy of its state (``--distributed-optimizer-no-replica``, a distributed
optimizer with one instance, every replica damaged), the controller's plan is
``RecoveryPlan(mode="reload", iteration=k)``, k the last iteration every rank completed
(:mod:`mindspeed_ha.control.recovery_plan`). Every rank, in its training thread, after
the clean-up and the process-group rebuild (:data:`mindspeed_ha.recovery.stages.IN_PLACE`):

1. :func:`reload_in_place` checks, before touching any state, that the latest periodic
   checkpoint c (Megatron-LM's tracker ``latest_checkpointed_iteration.txt`` in
   ``--save``; ``torch`` and ``torch_dist`` formats write it alike) exists, c <= k, the
   run can be replayed exactly from it (see :func:`check_replayable`) and the data
   iterators still hold the batches taken after c (:class:`~.rollback.ReplayIterator`
   keep mode, turned on by :func:`track`). Any failure raises :class:`ReloadError`
   with the state intact: the controller falls back to the dying checkpoint.
2. It reports its optimizer status UNKNOWN (dirty: no dying checkpoint and no in-place
   plan uses this rank's state until the re-runs end), then loads c in place into the
   live model, optimizer and scheduler with the training script's own loader
   (Megatron-LM: ``megatron.training.checkpointing.load_checkpoint``; another script,
   e.g. the built-in trainer: the ``load_checkpoint`` its ``train_step`` module uses,
   :func:`script_loader`), ``--load``
   pointed at ``--save`` for the call; the loader restores the RNG state saved with c.
   The counters the loader overwrites (consumed samples...) are put back: Megatron-LM's
   loop already counted iterations up to k.
3. The data iterators serve again the batches taken after c; the iterations c+1 .. k are
   returned, and :func:`rerun` (called by the ``train_step`` wrapper) runs them silently
   (results discarded, no logs, no injector, no optimizer status): they rebuild the
   model, optimizer, scheduler and RNG state of k bit for bit. Then the status is UPDATED
   at k again, the RNG is the one step k+1 started with, and the wrapper re-runs k+1.

Memory: keep mode holds the data items since the last save (see
:class:`~.rollback.ReplayIterator`); it is on only where a reload can be planned
(:func:`possible`).
"""

from __future__ import annotations

from mindspeed_ha.errors import ReloadError  # noqa: F401  (one error tree)
import logging
import os
from typing import Any, Callable, List, NamedTuple, Optional

from mindspeed_ha.integrations import megatron_lm

log = logging.getLogger("mindspeed_ha.recovery.reload")

#: args the loaders set from the checkpoint (Megatron-LM core_v0.12.1 checkpointing.py
#: ``load_checkpoint``: it asserts the three counters are 0, then sets them; ``finetune``
#: with ``--pretrained-checkpoint``); put back after the load
_LOADER_ARGS = ("load", "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples", "finetune")


#: --async-save: the iteration of the previous save (its items are forgotten at the next one)
_last_save: List[Optional[int]] = [None]


# ---- keeping the data since the last save ------------------------------------------------
def possible(rt) -> bool:
    """Whether the controller may plan a reload for this job: UCE repair on
    (``--enable-hbmfault-repair``) or worker restart (``--enable-worker-reboot``: a
    restarted rank's state exists nowhere in memory), one copy of each optimizer shard
    (no replica), and periodic saves (``--save`` with ``--save-interval``) to reload from."""
    args = _args(rt)
    lay = getattr(rt, "layout", None)
    return bool((getattr(rt.config, "hbm_repair", False) or getattr(rt.config, "worker_reboot", False))
                and lay is not None and lay.replica_count == 1
                and getattr(args, "save", None) and getattr(args, "save_interval", None))


def track(rt) -> None:
    """At the start of a step (after ``enter_iteration``): turn keep mode on for every data
    iterator wrapper that has not got it, from the last completed iteration, when a
    reload is :func:`possible`. A few microseconds."""
    if rt.completed is None or not possible(rt):
        return
    # a process restarted without a replica: its iterators start after the checkpoint c it
    # loaded (reload_for_rejoin), so what they take first are c's successors
    since, rt.state.kept_from = rt.state.kept_from, None
    for wrapper in rt.state.replay_wrappers():
        if not wrapper.keeping:
            wrapper.keep_since(rt.completed if since is None else since)


def on_save(rt, iteration: int) -> None:
    """A checkpoint of ``iteration`` was saved (``save_checkpoint`` returned): the data
    iterators forget the items up to it. With ``--async-save`` the save is committed
    later (at the latest before the next one starts), so the items up to the previous
    save are forgotten instead."""
    args = _args(rt)
    wrappers = [w for w in rt.state.replay_wrappers() if w.keeping]
    if not wrappers:
        return
    upto: Optional[int] = int(iteration)
    if getattr(args, "async_save", False):
        upto, _last_save[0] = _last_save[0], upto
    if upto is not None:
        for w in wrappers:
            w.forget_through(upto)


# ---- the reload ----------------------------------------------------------------------------
def latest_checkpoint(save: Optional[str]) -> int:
    """The iteration of the latest checkpoint in ``save`` (Megatron-LM's tracker, read
    locally; the loader's own read takes the max over ranks).

    Raises:
        ReloadError: no ``--save``, no tracker, a ``release`` or unreadable tracker, or the
            ``iter_XXXXXXX`` directory it names is missing.
    """
    if not save:
        raise ReloadError("no --save directory: there is no periodic checkpoint to reload")
    tracker = megatron_lm.get_checkpoint_tracker_filename(save)
    if not os.path.isfile(tracker):
        raise ReloadError(f"no periodic checkpoint yet ({tracker} does not exist)")
    c = megatron_lm.read_tracker_iteration(save)
    if c is None or c <= 0:
        raise ReloadError(f"{tracker} does not name an iteration")
    directory = megatron_lm.get_checkpoint_name(save, c, return_base_dir=True)
    if not os.path.isdir(directory):
        raise ReloadError(f"{tracker} names iteration {c} but {directory} is missing")
    return c


def check_replayable(args, c: int, k: int) -> None:
    """Raise :class:`ReloadError` when iterations c+1 .. k cannot be re-run exactly from
    the checkpoint of c: the load would skip the optimizer or the RNG state
    (``--no-load-optim``, ``--no-load-rng``, ``--finetune``), or a batch-size ramp-up
    (``--rampup-batch-size``) may have changed the number of micro-batches in the window
    (conservative: the samples consumed after k minus (k - c) full global batches are
    still inside the ramp-up)."""
    for flag in ("no_load_optim", "no_load_rng", "finetune"):
        if getattr(args, flag, False):
            raise ReloadError(f"--{flag.replace('_', '-')} is set: a reload would not restore the state of "
                              f"iteration {c}")
    ramp = getattr(args, "rampup_batch_size", None)
    if ramp:
        ramp_samples = int(ramp[2])
        at_c = int(getattr(args, "consumed_train_samples", 0) or 0) - (k - c) * int(args.global_batch_size)
        if at_c < ramp_samples:
            raise ReloadError(f"batch-size ramp-up (--rampup-batch-size, {ramp_samples} samples) may fall in "
                              f"iterations {c + 1}..{k}: they cannot be replayed exactly")


def reload_in_place(rt, plan) -> List[int]:
    """Load the latest periodic checkpoint c into the live model, optimizer and scheduler.

    Args:
        rt: the rank's :class:`~mindspeed_ha.runtime.HARuntime` (``ctx``: model,
            optimizer, scheduler; process groups already rebuilt).
        plan: the RETRY's :class:`~mindspeed_ha.control.recovery_plan.RecoveryPlan`
            (``mode == "reload"``; ``iteration`` = k, the last iteration every rank completed).

    Returns:
        The iterations :func:`rerun` must re-run silently, c+1 .. k (empty when c == k).

    Raises:
        ReloadError: before any state was touched (no checkpoint, c > k, not replayable,
            the data after c not held) or after (the loader returned another iteration);
            whatever the loader raised (``SystemExit`` from Megatron-LM's loader becomes a
            ReloadError). After the status was set UNKNOWN a failure leaves it so: no
            dying checkpoint uses this rank's state.
    """
    k, ctx, loader, args, c = _target(rt, plan, "no model/optimizer attached (the fault hit before the first step)")
    check_replayable(args, c, k)
    wrappers = rt.state.replay_wrappers()
    missing = [w for w in wrappers if not w.can_rewind_to(c)]
    if missing:
        raise ReloadError(f"the data iterator does not hold the batches taken after iteration {c} (keep mode is on "
                          "only with --enable-hbmfault-repair, no replica, --save and --save-interval)")
    _invalidate(rt)
    _load_latest(ctx, loader, args, c)
    for w in wrappers:
        w.rewind_to(c)
    reruns = list(range(c + 1, k + 1))
    log.warning("rank %d: reloaded the periodic checkpoint of iteration %d in place from %s; re-running "
                "iterations %s silently, then %d", rt.rank, c, args.save, reruns or "none", k + 1)
    if not reruns:
        _finish(rt, k)
    return reruns


def reload_for_rejoin(rt, plan) -> List[int]:
    """ARF without a replica, in the restarted process at its rejoin point (process groups
    rebuilt with the survivors, model and optimizer fresh): load the latest periodic
    checkpoint c, as every survivor does in :func:`reload_in_place` at the same time (the
    ``torch_dist`` load is collective), with the same checks first.

    ``args.consumed_train_samples`` (and the other counters the loader sets) stay those of
    c: the data iterators, built next, start after c, so the re-runs read the batches of
    c+1 .. k; the rejoin's repair stage sets the counters of k for the training
    loop and :meth:`HARuntime.enter_iteration` puts k's consumed samples back at the first step.

    Returns:
        The iterations c+1 .. k to re-run silently before k+1 (:func:`rerun`).

    Raises:
        ReloadError: no checkpoint, c > k, not replayable (before loading), or the loader
            loaded another iteration.
    """
    k, ctx, loader, args, c = _target(rt, plan, "no model/optimizer attached at the rejoin point")
    # the ramp-up check is the survivors' (they know the samples consumed up to k)
    for flag in ("no_load_optim", "no_load_rng", "finetune"):
        if getattr(args, flag, False):
            raise ReloadError(f"--{flag.replace('_', '-')} is set: a reload would not restore the state of "
                              f"iteration {c}")
    _load_latest(ctx, loader, args, c, restore=("load", "finetune"))
    rt.state.rejoin_reload = True
    rt.state.kept_from = c  # the data iterators it builds next start after c (track)
    reruns = list(range(c + 1, k + 1))
    log.warning("rank %d: restarted: loaded the periodic checkpoint of iteration %d from %s; re-running iterations "
                "%s silently with the survivors, then %d", rt.rank, c, args.save, reruns or "none", k + 1)
    return reruns


def rerun(rt, run_step: Callable[[], Any]) -> None:
    """Re-run the iterations :func:`reload_in_place` returned (``rt.state.reruns``), then clear them.

    Each is one call of ``run_step`` (the wrapped ``train_step`` with the step's
    arguments); its results are discarded (Megatron-LM's loop counted and logged these
    iterations before the fault). While they run, ``rt.current`` is None: the optimizer
    bracket, the processor's status and the injector leave them alone (the status stays
    UNKNOWN). The data iterators are marked after each. At the end: the rerun state
    machine as it was after k, the RNG of the step's entry (the state the re-runs
    reached, taken before the fault), status UPDATED(k).

    Raises:
        whatever a re-run raised (``rt.current`` is back to the step in progress, the
        status UNKNOWN: the fault is reported as one during recovery).
    """
    state = rt.state
    its, state.reruns = list(state.reruns), []
    if not its:
        return
    step = rt.current
    wrappers = state.replay_wrappers()
    restarted = state.rejoin_reload
    if restarted:
        # a restarted process (reload_for_rejoin) at its first step: the re-runs themselves
        # reach k's RNG and rerun-machine count from the checkpoint's (no state of k to go
        # back to, unlike a survivor); its status is UNKNOWN until they end
        state.rejoin_reload = False
        state.entry_rng = None
        state.rerun_state = None
        _invalidate(rt)
    try:
        for i in its:
            rt.current = None
            run_step()
            for w in wrappers:
                w.mark(i)
    finally:
        rt.current = step
    if restarted:
        state.entry_rng = megatron_lm.collect_rng_state()
        state.capture_rerun_machine()
        snap = rt.snapshot  # the start-up snapshot of k was taken before the re-runs
        if snap is not None and snap.iteration == its[-1]:
            snap.rng_state = state.entry_rng
            snap.rerun_state = megatron_lm.capture_rerun_state()
            snap.scheduler_state = megatron_lm.scheduler_state(getattr(rt.ctx, "opt_param_scheduler", None))
    _finish(rt, its[-1])
    log.warning("rank %d: re-ran iterations %d..%d after the reload; state of iteration %d restored",
                rt.rank, its[0], its[-1], its[-1])


# ---- helpers ------------------------------------------------------------------------------
def _args(rt):
    ctx = getattr(rt, "ctx", None)
    return ctx.args if ctx is not None else rt.args


class ScriptLoader(NamedTuple):
    """The training script's checkpoint loader and its global args."""

    load_checkpoint: Callable[..., Any]
    get_args: Callable[[], Any]


def script_loader(fn) -> Optional[ScriptLoader]:
    """The ``load_checkpoint`` and ``get_args`` that ``fn``'s module uses (``fn``: the
    script's ``train_step`` or ``setup_model_and_optimizer``; Megatron-shaped scripts
    import both by name, e.g. Megatron-LM's and the built-in trainer's ``training.py``),
    or None when its module has not both."""
    names = getattr(fn, "__globals__", None) or {}
    load, get_args = names.get("load_checkpoint"), names.get("get_args")
    if not (callable(load) and callable(get_args)):
        return None
    return ScriptLoader(load, get_args)


def _loader(rt):
    """(load_checkpoint, args) of the training script in use: Megatron-LM's when its
    global args are set, else the one the script's own module uses (``rt.script_loader``,
    handed in by the ``train_step`` / ``setup_model_and_optimizer`` patches).

    Raises:
        ReloadError: neither is known.
    """
    stock = megatron_lm.current_args()
    if stock is not None:
        from megatron.training import checkpointing

        return checkpointing.load_checkpoint, stock
    loader = rt.script_loader
    if loader is None:
        raise ReloadError("the training script's load_checkpoint is not known (no Megatron-LM global args, and "
                          "its train_step's module imports no load_checkpoint / get_args)")
    return loader.load_checkpoint, loader.get_args()


def _invalidate(rt) -> None:
    """Report this rank's optimizer status UNKNOWN (its state is about to be overwritten:
    neither a dying checkpoint nor an in-place plan may use it)."""
    if rt.processor is not None:
        rt.processor.mark_unknown()


def _finish(rt, k: int) -> None:
    """The state of k is back: rerun state machine and RNG as step k+1 started, status UPDATED(k)."""
    from mindspeed_ha.recovery import rollback

    state = rt.state
    if state.rerun_state is not None:
        rollback.reset_rerun_machine(state.rerun_state)
    if state.entry_rng is not None:
        megatron_lm.set_rng_state(state.entry_rng)
    if rt.processor is not None:
        rt.processor.end_update(k)  # UNKNOWN -> UPDATED(k); rt.snapshot is still that of k


__all__ = ["ReloadError", "ScriptLoader", "script_loader", "possible", "track", "on_save", "latest_checkpoint",
           "check_replayable", "reload_in_place", "reload_for_rejoin", "rerun"]


def _target(rt, plan, unattached: str):
    """(k, ctx, loader, args, c): the plan's iteration k, the rank's state, the script's
    loader and args, and the latest periodic checkpoint c <= k.

    Raises:
        ReloadError: no state attached (``unattached``), or c > k.
    """
    k = int(plan.iteration)
    ctx = rt.ctx
    if ctx is None:
        raise ReloadError(unattached)
    loader, args = _loader(rt)
    c = latest_checkpoint(getattr(args, "save", None))
    if c > k:
        raise ReloadError(f"the latest checkpoint ({c}) is newer than the last iteration every survivor completed "
                          f"({k})")
    return k, ctx, loader, args, c


def _load_latest(ctx, loader, args, c: int, restore=_LOADER_ARGS) -> None:
    """Load checkpoint ``c`` of ``--save`` into ``ctx`` with the script's own ``loader``, as a
    fresh start would; the arguments named in ``restore`` get their values back afterwards.

    Raises:
        ReloadError: the loader exited, or loaded another iteration than ``c``.
    """
    saved = {name: getattr(args, name) for name in restore if hasattr(args, name)}
    try:
        args.load = args.save
        for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
            if hasattr(args, name):
                setattr(args, name, 0)  # Megatron-LM's loader asserts 0 (a fresh start)
        if ctx.opt_param_scheduler is not None:
            # OptimizerParamScheduler.load_state_dict steps by the saved count from the
            # current one (megatron/core/optimizer_param_scheduler.py: step(increment=
            # num_steps)): 0 at start-up; in place it would count twice
            ctx.opt_param_scheduler.num_steps = 0
        try:
            iteration, _ = loader(ctx.model, ctx.optimizer, ctx.opt_param_scheduler)
        except SystemExit as exc:  # Megatron-LM's loader exits on some errors
            raise ReloadError(f"the checkpoint loader exited ({exc.code})") from exc
    finally:
        for name, value in saved.items():
            setattr(args, name, value)
    if int(iteration) != c:
        raise ReloadError(f"the loader loaded iteration {iteration}, not the latest checkpoint {c}")
