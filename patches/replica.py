"""Feature ``replica``: N optimizer replicas on megatron-core's partial distributed optimizer.

megatron-core 0.12.1 already cuts each DP group into ``num_distributed_optimizer_instances``
contiguous instances and shards the distributed optimizer over one instance (the
reference's replica layout). Four things differ from what the reference needs, and
are patched here only while the feature is on (``--enable-high-availability`` with the
distributed optimizer and ``--ha-replica-count`` > 1):

* gradient sync: stock reduce-scatters inside the instance, then all-reduces across
  instances, which sums in another order than a run without replicas. We run upstream's own
  ``start_grad_sync``/``finish_grad_sync`` with the bucket group seen as one instance
  without distributed optimizer over the full DP group (:func:`_as_full_dp_all_reduce`):
  one all-reduce per bucket (the reference's "compute instead of transfer"), async from
  the backward hook when overlapping; every instance then runs the same optimizer update
  on its shard. On gloo a reduce-scatter equals an all-reduce's slice bit for bit
  (measured), so the gradients are bitwise those of a run without replicas.
* grad norm: stock reduces the distributed optimizer's statistics over the whole world,
  which counts every shard N times (norm too large by sqrt(N)). Each rank holds the
  fully reduced gradient buffer, so it feeds the norm exactly the gradient slices that
  DP rank ``r`` of a run *without* replicas would own (shard ``r`` of ``d`` of every
  bucket, in the distributed optimizer's own order) and the world reduction stays as
  stock: the grad norm, hence clipping, is bitwise that of a run without replicas.
  Where a bucket is not divisible by ``d`` (padding is only to the instance size) the
  statistics are reduced over one instance instead (each shard once; equal to within
  rounding). The zero count (``--log-num-zeros-in-grad``) still counts each shard N times.
  With ``--fp16`` the slices are unscaled by the factor stock unscales its main grads with
  (before, the replica run's norm was that of the loss-scaled grads: 2^18 too large here,
  and clipping differed from a run without replicas).
* ``--data-parallel-random-init``: stock ``broadcast_params`` sends DP rank 0's weights
  within one instance only, so each instance would start from other weights; a second
  broadcast over the full DP group follows it (:func:`_broadcast_over_full_dp`).
* the CPU backend has no CUDA stream for the instance's communication stream (DDP still
  creates one; grad sync no longer uses it): handled by the CPU backend patch set.
"""

from __future__ import annotations

from .registry import Patch

#: all ranks (every TP/PP/DP position) of this rank's optimizer instance (None before
#: ``initialize_model_parallel``, or with one instance); the grad-norm fallback reduces over it
_INSTANCE_GROUP = None


def _after_initialize_model_parallel(wrapped, instance, args, kwargs):
    """After stock ``initialize_model_parallel`` with N > 1 instances: every rank learns each
    rank's instance (one all_gather of an int64 over WORLD) and creates one group per
    instance, every rank every group in the same order (``new_group`` is collective)."""
    global _INSTANCE_GROUP
    result = wrapped(*args, **kwargs)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    import inspect

    from mindspeed_ha.accelerator import collective_device

    bound = inspect.signature(wrapped).bind_partial(*args, **kwargs)
    n = bound.arguments.get("num_distributed_optimizer_instances", 1)
    if n <= 1:
        return result
    my_instance = dist.get_rank(mpu.get_inter_partial_data_parallel_group())
    world = dist.get_world_size()
    mine = torch.tensor([my_instance], dtype=torch.int64, device=collective_device())
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    ids = [int(t.item()) for t in every]
    for i in range(n):  # every rank creates every group, in the same order
        ranks = [r for r, inst in enumerate(ids) if inst == i]
        group = dist.new_group(ranks)
        if i == my_instance:
            _INSTANCE_GROUP = group
    return result


class _OneFullDPAllReduce:
    """The bucket group's ``ddp_config`` as upstream's grad sync should read it: no
    distributed optimizer, one optimizer instance; every other field is the live config's."""

    use_distributed_optimizer = False
    num_distributed_optimizer_instances = 1

    def __init__(self, ddp_config):
        self._ddp_config = ddp_config

    def __getattr__(self, name):
        return getattr(self._ddp_config, name)


def _as_full_dp_all_reduce(wrapped, instance, args, kwargs):
    """Run upstream ``start_grad_sync``/``finish_grad_sync`` as one all-reduce over the full DP group.

    megatron-core 0.12.1 ``distributed/param_and_grad_buffer.py``, class
    ``_ParamAndGradBucketGroup``, reads two ``ddp_config`` fields to choose the collective:

    * ``start_grad_sync`` (l.279-391): ``num_distributed_optimizer_instances`` > 1 makes
      ``async_op`` False (l.317-320) and puts the calls on ``communication_stream``
      (l.321-334); ``use_distributed_optimizer`` picks the instance group (l.336-339),
      a reduce-scatter per bucket (l.344-354; the all-reduce branch is l.355-358) and the
      all-reduce across instances (l.361-381).
    * ``finish_grad_sync`` (l.393-417): with instances > 1 it waits on the stream and
      returns (l.409-411) instead of waiting on ``grad_reduce_handle`` (l.412-417).

    For the duration of the call the bucket group's ``ddp_config`` is a view with
    ``use_distributed_optimizer=False`` and ``num_distributed_optimizer_instances=1`` and
    its ``data_parallel_group`` is the full DP group (with CP): upstream's own code then
    does everything else unchanged (NaN/large-grad checks, gradient scaling, reduce op,
    ``async_op = overlap_grad_reduce``, ``_coalescing_manager``, the ``grad_reduce_handle``
    it stores and ``finish_grad_sync``'s wait on it), and the collective is one
    all-reduce per bucket over the full DP group. Nothing else reads the two fields on
    this path. Bucket groups whose instance group is not the partial DP group (expert
    buckets) run stock.

    Equivalence: with one instance the same bucket is reduce-scattered over the full DP
    group with the same op and pre-scaling (``gradient_scaling_factor`` is 1/d or 1 with
    AVG either way); an all-reduce's slice equals that reduce-scatter bit for bit on gloo
    (measured), so every rank's shard of the gradient is that of a run without replicas
    (and the rest of the buffer holds the other ranks' shards, which the instance's
    optimizer update needs). With ``--overlap-grad-reduce`` the sync is dispatched
    asynchronously from the backward hook as with one instance; the instance
    ``communication_stream`` is left unused by grad sync.
    """
    cfg = instance.ddp_config
    if not (cfg.use_distributed_optimizer and cfg.num_distributed_optimizer_instances > 1):
        return wrapped(*args, **kwargs)  # stock, or already inside the view (nested call)
    from megatron.core import parallel_state as mpu

    if instance.intra_distributed_optimizer_instance_group is not mpu.get_data_parallel_group(
            with_context_parallel=True, partial_data_parallel=True):
        return wrapped(*args, **kwargs)
    had_group = "data_parallel_group" in vars(instance)
    saved_group = getattr(instance, "data_parallel_group", None)
    instance.ddp_config = _OneFullDPAllReduce(cfg)
    instance.data_parallel_group = mpu.get_data_parallel_group(
        with_context_parallel=True, partial_data_parallel=False)
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.ddp_config = cfg
        if had_group:
            instance.data_parallel_group = saved_group
        else:
            del instance.data_parallel_group


def _broadcast_over_full_dp(wrapped, instance, args, kwargs):
    """Upstream ``DistributedDataParallel.broadcast_params``, then the same broadcast over the
    full DP group: every DP rank ends with DP rank 0's parameters, as without replicas.

    ``--data-parallel-random-init`` seeds each DP rank differently (Megatron-LM core_v0.12.1
    ``megatron/training/initialize.py`` ``_set_random_seed``: ``seed + 10 * dp_rank``) and then
    relies on ``broadcast_params`` (``megatron/training/training.py`` ``get_model``, l.1041-1044)
    to give every DP rank the weights of DP rank 0. megatron-core 0.12.1
    ``distributed/distributed_data_parallel.py`` l.503-520 broadcasts a non-expert param over
    ``get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)``: with
    ``num_distributed_optimizer_instances`` N > 1 that is one optimizer instance of d/N ranks,
    so instance ``i`` would train from the weights of DP rank ``i * d/N``. Expert params
    (``allreduce`` False) use the expert DP group, which instances do not split: left as stock.
    The extra broadcast runs once, at model set-up, only with replicas; it copies bytes, so
    the weights are bitwise those of a run without replicas.
    """
    result = wrapped(*args, **kwargs)
    if instance.ddp_config.num_distributed_optimizer_instances <= 1:
        return result
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    group = mpu.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    src = dist.get_global_rank(group, 0)
    for param in instance.module.parameters():
        if getattr(param, "allreduce", True):  # upstream's test for a non-expert param
            dist.broadcast(param.data, src=src, group=group)
    return result


def _replicated(opt) -> bool:
    ddp = getattr(opt, "ddp_config", None)
    return ddp is not None and ddp.num_distributed_optimizer_instances > 1


def _remember_param_groups(wrapped, instance, args, kwargs):
    """Record each model param's optimizer group index before the shards replace them."""
    import inspect

    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    torch_opt = bound.arguments["optimizer"]
    group_of = {p: i for i, g in enumerate(torch_opt.param_groups) for p in g["params"]}
    result = wrapped(*args, **kwargs)
    instance._ha_param_group_of = group_of
    return result


def _virtual_shard_plan(opt):
    """``[(model_param, start, end)]``: the slices DP rank ``r`` of a replica-free run feeds
    to the grad norm, in the distributed optimizer's own order; None if not applicable.

    Computed once per optimizer with megatron-core's own range builder
    (``DistributedOptimizer._build_model_gbuf_param_range_map``) for shard ``r`` of ``d``;
    the order is ``_build_optimizer_group_ranges``'s: by param group, then buffer, bucket
    and param order.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.optimizer.distrib_optimizer import Range
    from megatron.core.transformer.module import param_is_not_shared

    group_of = getattr(opt, "_ha_param_group_of", None)
    if group_of is None or opt.config.use_precision_aware_optimizer:
        return None
    d = mpu.get_data_parallel_world_size(with_context_parallel=True)
    r = mpu.get_data_parallel_rank(with_context_parallel=True)
    per_group = [[] for _ in opt.optimizer.param_groups]
    for buffer in opt.buffers:
        for bucket in buffer.buckets:
            size = bucket.grad_data.numel()
            if size % d:
                return None
            start = r * (size // d)
            world = Range(start + bucket.offset, start + size // d + bucket.offset)
            ranges = opt._build_model_gbuf_param_range_map(buffer.param_index_map, world, bucket.offset)
            for model_param, rng in ranges.items():
                if model_param not in group_of:
                    return None
                if not (param_is_not_shared(model_param)
                        and tensor_parallel.param_is_not_tensor_parallel_duplicate(model_param)):
                    continue
                per_group[group_of[model_param]].append((model_param, rng["param"].start, rng["param"].end))
    return [item for group in per_group for item in group]


def _virtual_shard_grads(opt):
    """The grads of :func:`_virtual_shard_plan` (views into the reduced grad buffer), or None.

    With a grad scaler (``--fp16``) they are unscaled first by the factor megatron-core
    0.12.1's ``prepare_grads`` unscaled the main grads with, which the stock norm reads
    (``grad * inv_scale``, float32; taken before the scaler's update that follows, see
    :func:`_note_unscale`): without it the norm, hence clipping, was that of the scaled grads."""
    if not hasattr(opt, "_ha_virtual_shard_plan"):
        opt._ha_virtual_shard_plan = _virtual_shard_plan(opt)
    plan = opt._ha_virtual_shard_plan
    if plan is None:
        return None
    grads = [p.main_grad.view(-1)[lo:hi].float() for p, lo, hi in plan]
    inv_scale = getattr(opt, "_ha_unscaled_by", None) if getattr(opt, "grad_scaler", None) is not None else None
    if inv_scale is not None:
        grads = [g * inv_scale for g in grads]
    return grads


def _note_unscale(wrapped, instance, args, kwargs):
    """``_unscale_main_grads_and_check_for_nan``: remember the factor it unscales with (the
    grad scaler's ``inv_scale`` now; ``prepare_grads`` updates the scaler right after)."""
    if _replicated(instance) and instance.grad_scaler is not None:
        instance._ha_unscaled_by = instance.grad_scaler.inv_scale
    return wrapped(*args, **kwargs)


def _main_grads_of_virtual_shard(wrapped, instance, args, kwargs):
    if _replicated(instance):
        grads = _virtual_shard_grads(instance)
        if grads is not None:
            return grads
        instance._ha_norm_over_instance = True
    return wrapped(*args, **kwargs)


def _grad_stats_over_instance(wrapped, instance, args, kwargs):
    if _INSTANCE_GROUP is not None and getattr(instance, "_ha_norm_over_instance", False):
        return _INSTANCE_GROUP
    return wrapped(*args, **kwargs)


PATCHES = [
    Patch(
        name="replica.instance_groups",
        module="megatron.core.parallel_state",
        attribute="initialize_model_parallel",
        wrapper=_after_initialize_model_parallel,
        feature="replica",
        doc="after model-parallel init, build one process group per optimizer instance",
    ),
    Patch(
        name="replica.grad_sync",
        module="megatron.core.distributed.param_and_grad_buffer",
        attribute="_ParamAndGradBucketGroup.start_grad_sync",
        wrapper=_as_full_dp_all_reduce,
        feature="replica",
        doc="upstream grad sync as one all-reduce over the full DP group (bitwise equal to no replicas)",
    ),
    Patch(
        name="replica.grad_sync_finish",
        module="megatron.core.distributed.param_and_grad_buffer",
        attribute="_ParamAndGradBucketGroup.finish_grad_sync",
        wrapper=_as_full_dp_all_reduce,
        feature="replica",
        doc="finish_grad_sync waits on the all-reduce's handle (--overlap-grad-reduce)",
    ),
    Patch(
        name="replica.broadcast_params",
        module="megatron.core.distributed.distributed_data_parallel",
        attribute="DistributedDataParallel.broadcast_params",
        wrapper=_broadcast_over_full_dp,
        feature="replica",
        doc="--data-parallel-random-init: params broadcast from DP rank 0 over the full DP group, not one instance",
    ),
    Patch(
        name="replica.param_groups",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer.__init__",
        wrapper=_remember_param_groups,
        feature="replica",
        doc="remember each model param's optimizer group (for the replica-free grad norm)",
    ),
    Patch(
        name="replica.grad_norm_grads",
        module="megatron.core.optimizer.optimizer",
        attribute="MegatronOptimizer.get_main_grads_for_grad_norm",
        wrapper=_main_grads_of_virtual_shard,
        feature="replica",
        doc="grad norm over the replica-free shard r of d (bitwise equal to no replicas)",
    ),
    Patch(
        name="replica.grad_norm_unscale",
        module="megatron.core.optimizer.optimizer",
        attribute="MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan",
        wrapper=_note_unscale,
        feature="replica",
        doc="--fp16: the replica-free grad norm reads the grads unscaled by the factor stock unscales with",
    ),
    Patch(
        name="replica.grad_norm_group",
        module="megatron.core.optimizer.distrib_optimizer",
        attribute="DistributedOptimizer.get_grad_stats_parallel_group",
        wrapper=_grad_stats_over_instance,
        feature="replica",
        doc="fallback: reduce grad norm over one optimizer instance (each shard once)",
    ),
]
