"""This rank's distributed-optimizer shard, read without collectives.

megatron-core core_v0.12.1 ``DistributedOptimizer`` (megatron/core/optimizer/distrib_optimizer.py):
``gbuf_ranges[gbuf_idx][dtype_key][bucket_idx]["param_map"]`` maps each model parameter
to its range in the bucket's local shard (``gbuf_local``); the bucket's world size is
``buffers[gbuf_idx].buckets[bucket_idx].grad_data.numel()``, a multiple of the optimizer
instance size (the DP group's size).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

from mindspeed_ha.errors import IntegrityError

#: the per-parameter optimizer state a shard holds (fp32): main param, Adam moments
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")

#: one bucket of this rank's shard: ``(gbuf_idx, buffer numel_unpadded, dtype_key,
#: bucket_idx, {"param", "exp_avg", "exp_avg_sq": CPU fp32 tensor of W_b / c elements (or
#: a list of contiguous CPU fp32 tensors, that tensor in order: ``shard_buckets(copy=False)``),
#: "gbuf_world_numel": W_b, "numel_unpadded": int})``
ShardBucket = Tuple[int, int, Any, int, Dict[str, Any]]


def unwrap_distributed_optimizer(optimizer):
    """The single DistributedOptimizer inside ``optimizer`` (or None for non-distributed ones).

    Raises:
        NotImplementedError: several optimizers of which one is distributed.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    dist = [o for o in opts if isinstance(o, DistributedOptimizer)]
    if not dist:
        return None
    if len(dist) != 1 or len(opts) != 1:
        raise NotImplementedError("dying checkpoint supports one DistributedOptimizer per rank")
    return dist[0]


def num_shards(opt) -> int:
    """The optimizer instance size ``c``: how many shards the state is split into."""
    import torch

    group = opt.data_parallel_group
    return group.size() if hasattr(group, "size") else torch.distributed.get_world_size(group)


def shard_buckets(opt, count: int, copy: bool = True) -> Iterator[ShardBucket]:
    """This rank's shard of ``opt`` (``count`` shards), one bucket at a time, as CPU fp32
    (:data:`ShardBucket`), in layout order.

    ``copy=True``: each state is one new tensor of the bucket's local size (the
    parameters' ranges copied, the padding between and after them zero). ``copy=False``
    (a saver writing the shard): each state is a list of contiguous CPU fp32 tensors whose
    concatenation is that tensor: the parameters' own state tensors, no copy where they
    already are CPU fp32 (else copied, one parameter at a time), and zero tensors for the
    padding; they must not change while they are used (the saver's state is frozen).

    Raises:
        IntegrityError: a main param or state does not have the size of its shard range,
            or two parameters' ranges overlap.
    """
    import torch

    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        buf_numel = opt.buffers[gbuf_idx].numel_unpadded
        for dtype_key, range_maps in gbuf_range_maps.items():
            for bucket_idx, range_map in enumerate(range_maps):
                bucket = opt.buffers[gbuf_idx].buckets[bucket_idx]
                world_numel = bucket.grad_data.numel()
                local_numel = world_numel // count
                # copy: every element set once (torch.zeros would write the whole shard twice)
                shard = {k: torch.empty((local_numel,), dtype=torch.float32) for k in STATE_KEYS} if copy else {}
                pieces = []  # (lo, hi, {state key: CPU fp32 tensor of hi - lo elements}), without copy
                for model_param, param_range in range_map["param_map"].items():
                    # megatron-core's own accessor of one parameter's main param and states
                    tensors = opt._get_main_param_and_optimizer_states(model_param)
                    lo, hi = param_range["gbuf_local"].start, param_range["gbuf_local"].end
                    part = {}
                    for k in STATE_KEYS:
                        t = tensors[k]
                        if t.numel() != hi - lo or not t.is_floating_point():
                            raise IntegrityError(
                                f"{k} of buffer {gbuf_idx} bucket {bucket_idx} [{lo}:{hi}]: {t.dtype} "
                                f"{tuple(t.shape)}, expected {hi - lo} floating-point values")
                        if copy:
                            shard[k][lo:hi].copy_(t.detach().reshape(-1).to("cpu", torch.float32))
                        else:
                            part[k] = t.detach().reshape(-1).to("cpu", torch.float32).contiguous()
                    pieces.append((lo, hi, part))
                pieces.sort(key=lambda x: x[0])
                for (_, a_hi, _), (b_lo, _, _) in zip(pieces, pieces[1:]):
                    if b_lo < a_hi:
                        raise IntegrityError(f"buffer {gbuf_idx} bucket {bucket_idx}: parameter ranges overlap "
                                             f"at {b_lo}")
                for lo, hi in list(gaps([(lo, hi) for lo, hi, _ in pieces], local_numel)):
                    if copy:
                        for k in STATE_KEYS:
                            shard[k][lo:hi].zero_()
                    else:
                        pieces.append((lo, hi, {k: torch.zeros((hi - lo,), dtype=torch.float32)
                                                for k in STATE_KEYS}))
                if not copy:
                    pieces.sort(key=lambda x: x[0])
                    shard = {k: [part[k] for _, _, part in pieces] for k in STATE_KEYS}
                shard["gbuf_world_numel"] = world_numel
                shard["numel_unpadded"] = bucket.numel_unpadded
                yield gbuf_idx, buf_numel, dtype_key, bucket_idx, shard


def gaps(ranges, n: int) -> Iterator[Tuple[int, int]]:
    """The ``[lo, hi)`` parts of ``[0, n)`` that none of ``ranges`` (``(lo, hi)`` pairs) covers."""
    pos = 0
    for lo, hi in sorted(ranges):
        if lo > pos:
            yield pos, lo
        pos = max(pos, hi)
    if pos < n:
        yield pos, n
