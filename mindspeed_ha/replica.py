"""Replica-group math: pure functions of the rank layout, DP size and replica count.

The reference (MindIO TFT, reproduced by megatron-core 0.12.1's
``num_distributed_optimizer_instances``) cuts each data-parallel (DP) group of size
``d`` into ``N`` contiguous *optimizer instances* of ``d/N`` ranks. The distributed
optimizer shards its state over one instance, so every optimizer shard is held by
``N`` ranks (one per instance): the replicas a dying checkpoint and repairs read from.

Source for the instance layout: megatron/core/parallel_state.py (core_v0.12.1),
``initialize_model_parallel``: instance ``i`` of a DP group ``ranks`` is
``ranks[i*d/N:(i+1)*d/N]``; inter-instance groups are ``ranks[j::d/N]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple


def validate_replica_count(dp_size: int, replica_count: int) -> None:
    """Raise ``ValueError`` unless ``1 <= replica_count <= dp_size`` and ``dp_size % replica_count == 0``."""
    if dp_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp_size}")
    if not (1 <= replica_count <= dp_size) or dp_size % replica_count:
        ok = [n for n in range(1, dp_size + 1) if dp_size % n == 0]
        raise ValueError(
            f"--ha-replica-count={replica_count} must divide the data-parallel size "
            f"{dp_size}; accepted values: {ok}"
        )


def instances(dp_ranks: Sequence[int], replica_count: int) -> List[List[int]]:
    """Split one DP group (global ranks, DP order) into ``replica_count`` contiguous instances.

    >>> instances([0, 2, 4, 6], 2)
    [[0, 2], [4, 6]]
    """
    validate_replica_count(len(dp_ranks), replica_count)
    size = len(dp_ranks) // replica_count
    return [list(dp_ranks[i * size:(i + 1) * size]) for i in range(replica_count)]


def instance_and_shard(dp_rank: int, dp_size: int, replica_count: int) -> Tuple[int, int]:
    """``(instance_id, shard_id)`` of the rank at position ``dp_rank`` in its DP group.

    ``shard_id`` is the rank's index inside its instance = which optimizer shard it holds.
    """
    validate_replica_count(dp_size, replica_count)
    size = dp_size // replica_count
    return dp_rank // size, dp_rank % size


def shard_holders(dp_ranks: Sequence[int], replica_count: int) -> Dict[int, List[int]]:
    """``{shard_id: [global ranks holding it]}`` for one DP group; each list has ``replica_count`` ranks."""
    out: Dict[int, List[int]] = {}
    for inst in instances(dp_ranks, replica_count):
        for shard_id, rank in enumerate(inst):
            out.setdefault(shard_id, []).append(rank)
    return out


@dataclass(frozen=True)
class MemoryModel:
    """Bytes per parameter held on one device by model + optimizer state (Adam).

    Source: Megatron-LM ``docs/source/api-guide/dist_optimizer.md`` (core_v0.12.1), table
    of bytes per parameter. With ``N`` replicas the sharded part is held by ``d/N`` ranks
    instead of ``d``, so its ``/d`` becomes ``*N/d``:

    ===========================  ===============  ====================
    params / grads                non-distributed  distributed
    ===========================  ===============  ====================
    bf16 / bf16                   20               ``4 + 16*N/d``
    bf16 / fp32 (Megatron-LM's    18               ``6 + 12*N/d``
    bf16 default)
    fp32 / fp32                   16               ``8 + 8*N/d``
    ===========================  ===============  ====================
    """

    dp_size: int
    replica_count: int = 1
    distributed: bool = True
    bf16: bool = True
    fp32_grads: bool = False

    def bytes_per_param(self) -> float:
        if not self.bf16:
            unsharded, sharded, whole = 8.0, 8.0, 16.0
        elif self.fp32_grads:
            unsharded, sharded, whole = 6.0, 12.0, 18.0
        else:
            unsharded, sharded, whole = 4.0, 16.0, 20.0
        if not self.distributed:
            return whole
        return unsharded + sharded * self.replica_count / self.dp_size
