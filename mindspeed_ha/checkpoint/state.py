"""What a rank holds for a dying checkpoint: the snapshot of iteration ``k``, the live
objects, and the state dict a regular save of ``k`` would have written.

Megatron-LM's names and file contents come from :mod:`mindspeed_ha.integrations.megatron_lm`.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from mindspeed_ha.checkpoint.staging import staging_root  # noqa: F401 - where callers find it
from mindspeed_ha.integrations import megatron_lm as mlm


@dataclass
class IterationSnapshot:
    """What a regular save of ``iteration`` would write that the live objects may no longer
    hold when the dying checkpoint is written (the training thread moved on, or stopped
    half-way through Megatron-LM's bookkeeping). Each value is taken where Megatron-LM
    holds it for ``iteration``, never recomputed from the iteration number.

    Filled in this order (:class:`mindspeed_ha.runtime.HARuntime` and
    ``patches/megatron_state.py``):

    1. the optimizer update of ``iteration`` ended: ``rng_state``;
    2. ``train_step`` returned: ``rerun_state``, ``scheduler_state`` (stepped by
       ``train_step`` after the update), ``consumed_before`` (the training loop has not
       counted the iteration yet), ``rng_states`` (gathered over the DP group with
       ``--data-parallel-random-init``: a collective, impossible once a peer is dead),
       ``returned``;
    3. Megatron-LM's ``train`` counted the iteration (``num_floating_point_operations``
       called right after ``consumed_train_samples`` / ``skipped_train_samples`` were
       increased): ``args`` (provisional), ``flops``;
    4. ``checkpoint_and_decide_exit(iteration, ..., num_floating_point_operations_so_far,
       ...)``, where Megatron-LM's periodic save of ``iteration`` runs (after the
       evaluation of ``iteration``): ``args`` and ``flops`` final, as that save sees them.
       Without Megatron-LM's loop (the built-in trainer): ``args`` when the next
       ``train_step`` starts.

    Attributes:
        iteration: the iteration whose update completed.
        rng_state: this rank's RNG state (:func:`~mindspeed_ha.integrations.megatron_lm.collect_rng_state`).
        rerun_state: the rerun state machine's checkpoint entry.
        rng_states: Megatron-LM's ``rng_state`` list (one state per DP rank under
            ``--data-parallel-random-init``, else None: ``[rng_state]``).
        scheduler_state: ``opt_param_scheduler.state_dict()`` as ``train_step`` left it.
        returned: ``train_step`` of ``iteration`` returned.
        consumed_before: ``args.consumed_train_samples`` then (the loop's count of
            ``iteration`` adds the batch to it right after).
        args: shallow copy of the run's args after Megatron-LM counted ``iteration``
            (``consumed_train_samples``, ``skipped_train_samples``, ``consumed_valid_samples``...).
        args_final: ``args`` were taken where a regular save of ``iteration`` reads them.
        flops: ``num_floating_point_operations_so_far`` after ``iteration`` (FLOPs).
        flops_before: the same after the previous iteration (None: unknown).
    """

    iteration: int
    rng_state: Any
    rerun_state: Any = None
    rng_states: Optional[List[Any]] = None
    scheduler_state: Optional[Dict[str, Any]] = None
    returned: bool = False
    consumed_before: Optional[int] = None
    args: Any = None
    args_final: bool = False
    flops: Optional[float] = None
    flops_before: Optional[float] = None

    def take_args(self, args, final: bool, flops: Optional[float] = None) -> None:
        """Keep a shallow copy of ``args`` (and ``flops`` when given) unless final ones are held."""
        if self.args_final or args is None:
            return
        self.args = copy.copy(args)
        self.args_final = final
        if flops is not None:
            self.flops = flops

    def count_flops(self, flops_in_batch: float) -> bool:
        """Megatron-LM's ``num_floating_point_operations_so_far += flops_in_batch`` for this
        iteration, once, after ``train_step`` returned. Returns whether it counted."""
        if not self.returned or self.flops is not None or self.flops_before is None:
            return False
        self.flops = self.flops_before + flops_in_batch
        return True


@dataclass
class DyingContext:
    """What a rank needs to take part in a dying checkpoint (set by the runtime)."""

    args: Any
    model: Any
    optimizer: Any
    opt_param_scheduler: Any
    tp_rank: int
    pp_rank: int
    pp_size: int
    shard_id: int


def model_path(ctx: DyingContext, iteration: int) -> str:
    """This rank's ``model_optim_rng.pt`` in the staging dir (``torch`` layout)."""
    return mlm.get_checkpoint_name(staging_root(ctx.args.save, iteration), iteration,
                                   pipeline_parallel=ctx.pp_size > 1, tensor_rank=ctx.tp_rank,
                                   pipeline_rank=ctx.pp_rank)


def model_state(ctx: DyingContext, iteration: int, snapshot: IterationSnapshot,
                ckpt_format: str = "torch") -> Dict[str, Any]:
    """This rank's checkpoint content of ``iteration`` as Megatron-LM's ``save_checkpoint``
    builds it (key by key; ``tests/test_megatron_counters.py`` compares them), from
    ``snapshot``: ``model_optim_rng.pt`` for ``ckpt_format`` ``torch``, the sharded state
    dict ``dist_checkpointing.save`` takes for ``torch_dist``.

    What a fault kept Megatron-LM from doing for ``iteration`` is done on copies with
    Megatron-LM's own functions: the scheduler step when ``train_step`` did not return (a
    fault in the collectives after the optimizer update,
    :func:`~mindspeed_ha.integrations.megatron_lm.scheduler_after_step` and the param
    groups' learning rate it sets: a rank in the optimizer update's commit barrier or in
    the collectives after it), the training loop's count when the fault came before it
    (:func:`~mindspeed_ha.integrations.megatron_lm.count_iteration`).

    Raises:
        RuntimeError: ``--data-parallel-random-init`` and the DP ranks' RNG states of
            ``iteration`` were not gathered (a fault during that gather).
    """
    args, sched, flops = snapshot.args, snapshot.scheduler_state, snapshot.flops
    stepped = contextlib.nullcontext()
    if sched is None and ctx.opt_param_scheduler is not None:
        sched = mlm.scheduler_after_step(ctx.opt_param_scheduler, ctx.args)
        # ... and the learning rate / weight decay that step sets in the param groups
        stepped = mlm.param_groups_after_step(ctx.opt_param_scheduler, sched)
    if args is None:
        live = ctx.args
        if snapshot.returned and getattr(live, "consumed_train_samples", None) != snapshot.consumed_before:
            args = copy.copy(live)  # counted by the loop (the built-in trainer's: just before its save)
        else:
            args, flops = mlm.count_iteration(live, snapshot.flops_before)
    if flops is None:
        flops = getattr(args, "num_floating_point_operations_so_far", None)
    rng_states = snapshot.rng_states
    if rng_states is None:
        if mlm.needs_rng_gather(args):
            raise RuntimeError(f"iteration {iteration}: --data-parallel-random-init needs every data-parallel "
                               "rank's RNG state and they were not gathered (a fault during the gather)")
        rng_states = [snapshot.rng_state]
    with stepped:
        return mlm.generate_state_dict(
            args, mlm.unwrap_model(ctx.model), ctx.optimizer, ctx.opt_param_scheduler, rng_states,
            iteration=iteration, rerun_state=mlm.rerun_state(ckpt_format, snapshot.rerun_state),
            num_floating_point_operations_so_far=flops, ckpt_format=ckpt_format, scheduler_state=sched,
        )
