"""What a replica holder hands a restarted process besides the model and optimizer state
(ARF): its progress (:mod:`mindspeed_ha.recovery.progress`), taken from the holder's
runtime (its snapshot of the iteration, the step state, the step's forward-backward
results)."""

from __future__ import annotations

from mindspeed_ha.integrations import megatron_lm
from mindspeed_ha.recovery import progress


def _args(rt):
    return rt.ctx.args if rt.ctx is not None else rt.args


def _rerun_iteration(rt):
    rerun = (rt.state.rerun_state or {}).get("current_iteration")
    return rerun if isinstance(rerun, int) else None


def _snapshot_of(rt, k: int, to_whom: str):
    """The holder's snapshot of iteration ``k`` and the args it was taken with.

    Raises:
        RuntimeError: the holder has no snapshot of ``k``.
    """
    snap = rt.snapshot
    if snap is None or snap.iteration != k:
        raise RuntimeError(f"rank {rt.rank}: no snapshot of iteration {k} to hand to {to_whom} "
                           f"(have {snap.iteration if snap is not None else None})")
    return snap, (snap.args if snap.args is not None else _args(rt))


def after(rt, k: int) -> dict:
    """The holder's progress at the end of iteration ``k``: the loop's counters and the
    scheduler as the snapshot of ``k`` holds them, the RNG at the entry of step k+1.

    Raises:
        RuntimeError: the holder has no snapshot of ``k``.
    """
    snap, args = _snapshot_of(rt, k, "a restarted process")
    return progress.capture(args, k, snap.scheduler_state, rt.state.entry_rng, flops=snap.flops,
                            rerun_iteration=_rerun_iteration(rt))


def at_pause(rt, k: int) -> dict:
    """The progress of a rank paused after iteration ``k`` (a hot switch's outgoing rank,
    its training thread holding in the pause point): as :func:`after`, but the RNG is the
    process's now (the entry of step k+1: nothing of k+1 ran).

    Raises:
        RuntimeError: the rank has no snapshot of ``k``.
    """
    snap, args = _snapshot_of(rt, k, "its new process")
    return progress.capture(args, k, snap.scheduler_state, megatron_lm.collect_rng_state(), flops=snap.flops,
                            rerun_iteration=_rerun_iteration(rt))


def counters(rt, k: int) -> dict:
    """The counters of k (the last iteration every survivor completed) for a process
    restarted without a replica (plan mode ``reload``): it loads the checkpoint itself
    and its re-runs give it the scheduler, RNG and rerun count, so only the training
    loop's counters are sent."""
    snap = rt.snapshot
    flops = None
    if snap is not None:
        flops = snap.flops if snap.iteration == k else snap.flops_before if snap.iteration == k + 1 else None
    return progress.capture(_args(rt), k, None, None, flops=flops)


def inside_update(rt, j: int) -> dict:
    """The holder's progress for a process restarted inside the optimizer update of
    ``j`` (roll forward with rejoin), called inside that update after the holder
    finished it: counters, scheduler and rerun count as at the end of j-1 (the loop
    and ``train_step`` count j after the update), the RNG now (after j's
    forward-backward), and :func:`mindspeed_ha.recovery.progress.forward_part` (the
    losses, gradient norm and zero count of j; the samples j consumes).

    Raises:
        RuntimeError: the holder holds no forward-backward result of step ``j``.
    """
    stats = rt.step_stats
    if rt.current != j or "losses" not in stats:
        raise RuntimeError(f"rank {rt.rank}: no forward-backward result of step {j} to hand to a restarted "
                           f"process (in step {rt.current})")
    args = _args(rt)
    optimizer = rt.ctx.optimizer if rt.ctx is not None else None
    try:  # optimizer.step()'s values where it computed none (megatron-core 0.12.1 optimizer.py)
        from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

        mixed = isinstance(optimizer, MixedPrecisionOptimizer)
    except ImportError:  # pragma: no cover - megatron-core is a dependency
        mixed = False
    grad_norm = stats.get("grad_norm", 0.0 if mixed else None)
    num_zeros = stats.get("num_zeros", 0 if mixed else None)
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    samples = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
    snap = rt.snapshot
    flops = snap.flops_before if snap is not None and snap.iteration == j else None
    sched = megatron_lm.scheduler_state(getattr(rt.ctx, "opt_param_scheduler", None))
    return progress.capture(args, j - 1, sched, megatron_lm.collect_rng_state(), flops=flops,
                            rerun_iteration=_rerun_iteration(rt),
                            forward=progress.forward_part(j, stats["losses"], grad_norm, num_zeros, samples))
