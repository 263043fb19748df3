"""Feature ``ha``: Megatron-LM's own counters for the dying checkpoint, where Megatron-LM holds them.

A regular save of iteration ``k`` (Megatron-LM core_v0.12.1 ``megatron/training/training.py``
``train``) sees ``args`` after the loop counted ``k`` (``consumed_train_samples``,
``skipped_train_samples``; ``consumed_valid_samples`` after the evaluation of ``k``) and
the FLOP count ``num_floating_point_operations_so_far``, a local of ``train`` that it
passes to ``checkpoint_and_decide_exit``. Two thin wrappers copy them into the runtime's
:class:`mindspeed_ha.checkpoint.state.IterationSnapshot` of ``k``; nothing is recomputed:

* ``num_floating_point_operations(args, batch_size)``: ``train`` calls it right after it
  counted ``k`` (the first call after ``train_step`` of ``k`` returned; ``training_log``
  calls it again with ``--log-throughput``, ignored). The snapshot adds the result to the
  count after ``k-1``, as ``train`` does, and copies ``args`` (provisional: a fault during
  the evaluation of ``k`` writes these).
* ``checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration,
  num_floating_point_operations_so_far, ...)``: where the periodic save of ``iteration``
  runs; ``args`` and Megatron-LM's own FLOP count become final.
"""

from __future__ import annotations

from .registry import Patch


def _count_flops(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    from mindspeed_ha.runtime import get_runtime

    rt = get_runtime()
    snap = rt.snapshot if rt is not None else None
    if snap is not None and snap.count_flops(result):
        snap.take_args(args[0] if args else kwargs.get("args"), final=False)
    return result


def _at_save_point(wrapped, instance, args, kwargs):
    from mindspeed_ha.runtime import get_runtime

    rt = get_runtime()
    snap = rt.snapshot if rt is not None else None
    if snap is not None:
        from mindspeed_ha.integrations.megatron_lm import current_args

        iteration = kwargs.get("iteration", args[3] if len(args) > 3 else None)
        flops = kwargs.get("num_floating_point_operations_so_far", args[4] if len(args) > 4 else None)
        if iteration == snap.iteration and snap.returned:
            snap.take_args(current_args(), final=True, flops=flops)
    return wrapped(*args, **kwargs)


PATCHES = [
    Patch(
        name="ha.counters.flops",
        module="megatron.training.training",
        attribute="num_floating_point_operations",
        wrapper=_count_flops,
        feature="ha",
        versions=None,
        doc="dying checkpoint: Megatron-LM's FLOP count and counted args of the iteration just ended",
    ),
    Patch(
        name="ha.counters.save_point",
        module="megatron.training.training",
        attribute="checkpoint_and_decide_exit",
        wrapper=_at_save_point,
        feature="ha",
        versions=None,
        doc="dying checkpoint: args and FLOP count as Megatron-LM's periodic save of the iteration sees them",
    ),
]
