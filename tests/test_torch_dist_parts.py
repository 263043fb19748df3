"""The torch_dist dying checkpoint's part writer and merge, on real megatron-core sharded
tensors, read back with megatron-core's own ``dist_checkpointing.load``."""

import os

import pytest
import torch

from mindspeed_ha.config import ConfigError, validate_ha_args
from mindspeed_ha.checkpoint import torch_dist_parts as td


@pytest.fixture
def single_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _full():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 4, generator=g), "flat": torch.randn(4, 5, generator=g)}


def _part_state(dp_rank, dp_size, full):
    """What DP rank ``dp_rank`` of ``dp_size`` holds: half of ``w`` by rows (a TP-style
    shard, replicated over DP) and a flattened range of ``flat`` (distributed-optimizer style)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rows = full["w"].shape[0] // 2
    n = full["flat"].numel()
    lo, hi = dp_rank * n // dp_size, (dp_rank + 1) * n // dp_size
    out = {}
    for half in (0, 1):
        out[f"w{half}"] = ShardedTensor.from_rank_offsets(
            "w", full["w"][half * rows:(half + 1) * rows].clone(), (0, half, 2), replica_id=(0, 0, dp_rank))
    out["flat"] = ShardedTensor.from_rank_offsets_flat(
        "flat", full["flat"].flatten()[lo:hi].clone(), full["flat"].shape, flattened_range=slice(lo, hi),
        replica_id=(0, 0, 0))
    out["obj"] = ShardedObject("obj", {"dp": dp_rank}, (1,), (0,), replica_id=dp_rank)
    return out


def _load(ckpt_dir, full):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    want = {"w": ShardedTensor.from_rank_offsets("w", torch.empty_like(full["w"]), replica_id=0),
            "flat": ShardedTensor.from_rank_offsets_flat("flat", torch.empty(full["flat"].numel()),
                                                         full["flat"].shape, flattened_range=slice(0, full["flat"].numel()),
                                                         replica_id=0),
            "obj": ShardedObject("obj", None, (1,), (0,), replica_id=0)}
    return dist_checkpointing.load(want, str(ckpt_dir))


def test_parts_from_two_savers_merge_into_a_loadable_checkpoint(tmp_path, single_process_group):
    full = _full()
    parts = []
    for dp_rank in (0, 1):  # e.g. the two survivors of a DP group of 2, each standing in for DP 0
        part = tmp_path / f"part{dp_rank}"
        td.write_part(_part_state(dp_rank, 2, full), str(part))
        parts.append(str(part))
    td.write_common({"iteration": 5}, parts[0])
    out = tmp_path / "iter_0000005"
    td.merge_parts(parts, str(out))
    assert {"common.pt", "metadata.json", ".metadata"} <= set(os.listdir(out))
    assert not any(os.path.exists(p) for p in parts)
    loaded = _load(out, full)
    assert torch.equal(loaded["w"], full["w"])
    assert torch.equal(loaded["flat"], full["flat"].flatten())
    assert loaded["obj"] == {"dp": 0}  # written by the stand-in for DP rank 0, once
    assert torch.load(out / "common.pt", weights_only=False)["iteration"] == 5


def test_a_shard_written_twice_is_kept_once(tmp_path, single_process_group):
    full = _full()
    parts = []
    for i, dp_rank in enumerate((0, 1, 1)):  # a replicated shard saved by two holders
        part = tmp_path / f"part{i}"
        td.write_part(_part_state(dp_rank, 2, full), str(part))
        parts.append(str(part))
    td.write_common({}, parts[0])
    md = td.merge_parts(parts, str(tmp_path / "out"))
    assert len(md.state_dict_metadata["flat"].chunks) == 2
    assert torch.equal(_load(tmp_path / "out", full)["flat"], full["flat"].flatten())


def test_a_missing_shard_fails_the_merge(tmp_path, single_process_group):
    full = _full()
    part = tmp_path / "part0"
    td.write_part(_part_state(0, 2, full), str(part))  # DP rank 1's half of "flat" is lost
    td.write_common({}, str(part))
    with pytest.raises(td.TorchDistCheckpointError, match="flat: shards cover 10 of 20"):
        td.merge_parts([str(part)], str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / ".metadata")


def test_exactly_one_common_state(tmp_path, single_process_group):
    full = _full()
    part = tmp_path / "part0"
    td.write_part(_part_state(0, 1, full), str(part))
    with pytest.raises(td.TorchDistCheckpointError, match="common.pt"):
        td.merge_parts([str(part)], str(tmp_path / "out"))


class _Args:
    enable_high_availability = True
    use_distributed_optimizer = True

    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.parametrize("kw,match", [
    (dict(ckpt_format="torch_dcp"), "--ckpt-format torch_dcp"),
    (dict(ckpt_format="zarr"), "--ckpt-format zarr"),
    (dict(ckpt_format="torch_dist", ckpt_fully_parallel_save=False), "--no-ckpt-fully-parallel-save"),
    (dict(ckpt_format="torch_dist", virtual_pipeline_model_parallel_size=2), "virtual pipeline"),
])
def test_unsupported_checkpoint_combinations_fail_at_start_up(kw, match):
    with pytest.raises(ConfigError, match=match):
        validate_ha_args(_Args(**kw), 4, 1, 2, env={})


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_supported_checkpoint_formats_pass(fmt):
    validate_ha_args(_Args(ckpt_format=fmt, ckpt_fully_parallel_save=True), 4, 1, 2, env={})


def test_resharded_load_of_a_padded_tensor_reads_no_uninitialised_memory(tmp_path, single_process_group, monkeypatch):
    """A ``torch_dist`` resume at another TP size: a distributed-optimizer state of a tensor
    whose global shape may change (``allow_shape_mismatch``: the vocab-padded embedding,
    4224 rows at TP1, 4352 at TP2) is reassembled by megatron-core in a ``torch.empty``
    tensor (resharding.py ``sh_ten_merge_fn``); the new padding rows, which the checkpoint
    does not hold, kept whatever memory was there (resumed runs that differ, a loss of 35
    or NaN). Here: 10 x 4 saved in one piece (TP1), loaded as a 12 x 4 tensor split over
    two TP ranks, each flattened into DP shards, as one rank would (the shard with the
    padding, and two without it, twice each); ``torch.empty`` hands out NaN-filled memory during the load so a missed element cannot
    go unseen. Patch ``fix.dist_ckpt_reshard_padding``: the rows outside the checkpoint are
    zero (what megatron-core gives the parameter itself), the rest is the checkpoint's,
    every time."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    saved = torch.arange(40, dtype=torch.float32).reshape(10, 4) + 1
    part, ckpt = str(tmp_path / "part"), str(tmp_path / "iter_0000004")
    td.write_part({"emb": ShardedTensor.from_rank_offsets_flat(
        "emb", saved.flatten().clone(), saved.shape, flattened_range=slice(0, 40))}, part)
    td.write_common({"iteration": 4}, part)
    td.merge_parts([part], ckpt)
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):  # what an allocator may hand back: anything
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    padded = torch.cat([saved, torch.zeros(2, 4)])  # rows 10, 11: the new padding
    for tp, shard in ((1, slice(8, 24)), (1, slice(0, 8)), (0, slice(8, 24))):
        for _ in range(2):
            want = ShardedTensor.from_rank_offsets_flat(
                "emb", real_empty(shard.stop - shard.start), (6, 4), (0, tp, 2), flattened_range=shard,
                allow_shape_mismatch=True)
            # what one rank asks for (TP rank tp, one DP shard): the others' parts are not asked here
            got = dist_checkpointing.load({"emb": want}, ckpt, validate_access_integrity=False)["emb"]
            assert torch.equal(got, padded[6 * tp:6 * (tp + 1)].flatten()[shard]), (tp, shard, got)
