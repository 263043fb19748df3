"""Replica math: instances, shard holders, memory formula (pure functions)."""

import pytest

from mindspeed_ha import replica


def test_instances_are_contiguous_chunks():
    assert replica.instances([0, 2, 4, 6], 2) == [[0, 2], [4, 6]]
    assert replica.instances([0, 1, 2, 3], 1) == [[0, 1, 2, 3]]
    assert replica.instances([5, 7], 2) == [[5], [7]]


def test_instance_and_shard_matches_instances():
    ranks = list(range(8))
    for n in (1, 2, 4, 8):
        inst = replica.instances(ranks, n)
        for dp_rank in ranks:
            i, s = replica.instance_and_shard(dp_rank, 8, n)
            assert inst[i][s] == dp_rank


def test_every_shard_has_n_holders():
    holders = replica.shard_holders([0, 1, 2, 3, 4, 5], 3)
    assert holders == {0: [0, 2, 4], 1: [1, 3, 5]}


@pytest.mark.parametrize("d,n", [(4, 3), (4, 0), (2, 4), (6, 4)])
def test_bad_replica_count_names_the_flag(d, n):
    with pytest.raises(ValueError, match=r"--ha-replica-count.*accepted values"):
        replica.validate_replica_count(d, n)


def test_memory_formula():
    m = replica.MemoryModel(dp_size=8, replica_count=2, distributed=True, bf16=True)
    assert m.bytes_per_param() == 4 + 16 * 2 / 8
    assert replica.MemoryModel(8, 1, True, True).bytes_per_param() == 6.0
    assert replica.MemoryModel(8, 1, False, True).bytes_per_param() == 20.0
    assert replica.MemoryModel(8, 1, False, False).bytes_per_param() == 16.0
