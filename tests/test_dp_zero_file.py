"""``distrib_optim.pt`` written in place by several shard savers (checkpoint/dp_zero.py,
checkpoint/torch_file.py): what ``torch.load`` reads equals the DP-zero state built by
concatenating the shards, whatever order the savers run in; the zip's CRCs are right;
a missing or mismatched saver fails the check; zip64 archives are laid out correctly."""

import os
import random
import zipfile
import zlib

import pytest
import torch

from mindspeed_ha.checkpoint import dp_zero, torch_file

DTYPE_KEY = (torch.float32, torch.float32)
KEYS = dp_zero.STATE_KEYS


def _groups(num_shards):
    """Two buffers; buckets of world size divisible by ``num_shards``, unpadded tails of varied length."""
    out = []
    for gbuf_idx, specs in enumerate([[(12, 11), (8, 8), (16, 9)], [(4, 1)]]):
        buckets, offset = [], 0
        for world, unpadded in specs:
            world *= num_shards
            buckets.append(dp_zero.Bucket(world, unpadded, offset))
            offset += unpadded
        out.append(dp_zero.Group(gbuf_idx, DTYPE_KEY, offset, tuple(buckets)))
    return out


def _world(groups, seed=0):
    """The full (padded) bucket tensors a DP group holds: {(gbuf, bucket): {key: tensor}}."""
    g = torch.Generator().manual_seed(seed)
    return {(grp.gbuf_idx, i): {k: torch.randn(b.world, generator=g) for k in KEYS}
            for grp in groups for i, b in enumerate(grp.buckets)}


def _shard_items(groups, world, shard_id, num_shards):
    for grp in groups:
        for i, b in enumerate(grp.buckets):
            local = b.world // num_shards
            shard = {k: world[(grp.gbuf_idx, i)][k][shard_id * local:(shard_id + 1) * local].clone() for k in KEYS}
            shard.update(gbuf_world_numel=b.world, numel_unpadded=b.unpadded)
            yield grp.gbuf_idx, grp.numel, grp.dtype_key, i, shard


def _expected(groups, world):
    state = {"buckets_coalesced": True}
    for grp in groups:
        st = {k: torch.cat([world[(grp.gbuf_idx, i)][k][:b.unpadded] for i, b in enumerate(grp.buckets)])
              for k in KEYS}
        st["numel_unpadded"] = grp.numel
        state[grp.gbuf_idx] = {grp.dtype_key: st}
    return state


def _write(tmp_path, groups, world, num_shards, order, iteration=7):
    path = str(tmp_path / "iter" / "distrib_optim.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for j in order:  # each saver plans the layout on its own, as separate processes do
        plan = dp_zero.FilePlan(groups)
        dp_zero.write_shard(path, plan, j, num_shards, _shard_items(groups, world, j, num_shards),
                            str(tmp_path), 0, 0, iteration)
    return path


@pytest.mark.parametrize("num_shards,order", [(1, [0]), (3, [2, 0, 1])])
def test_savers_write_a_file_torch_load_reads_as_the_dp_zero_state(tmp_path, num_shards, order):
    groups = _groups(num_shards)
    world = _world(groups)
    path = _write(tmp_path, groups, world, num_shards, order)
    dp_zero.finalize(path, dp_zero.FilePlan(groups), num_shards, str(tmp_path), 0, 0, 7)
    got = torch.load(path, weights_only=True)  # what megatron-core's load_parameter_state does
    want = _expected(groups, world)
    assert list(got) == list(want)
    for grp in groups:
        a, b = got[grp.gbuf_idx][DTYPE_KEY], want[grp.gbuf_idx][DTYPE_KEY]
        assert a["numel_unpadded"] == b["numel_unpadded"]
        for k in KEYS:
            assert a[k].dtype == torch.float32 and torch.equal(a[k], b[k]), k
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every record's CRC-32 is right


def test_a_missing_or_stale_saver_fails_the_check(tmp_path):
    groups = _groups(2)
    world = _world(groups)
    path = _write(tmp_path, groups, world, 2, [1])
    with pytest.raises(dp_zero.DPZeroError, match="shard 0 of .tp=0, pp=0.: no record"):
        dp_zero.finalize(path, dp_zero.FilePlan(groups), 2, str(tmp_path), 0, 0, 7)
    _write(tmp_path, groups, world, 2, [0], iteration=6)
    with pytest.raises(dp_zero.DPZeroError, match="iteration 6"):
        dp_zero.finalize(path, dp_zero.FilePlan(groups), 2, str(tmp_path), 0, 0, 7)


def test_ranges_must_tile_each_record():
    crc = zlib.crc32(b"abcdef")
    parts = [(3, 3, zlib.crc32(b"def")), (0, 3, zlib.crc32(b"abc"))]
    assert torch_file.combine_ranges(6, parts) == crc
    with pytest.raises(torch_file.TorchFileError, match=r"\[3, 6\) missing"):
        torch_file.combine_ranges(6, parts[1:])
    with pytest.raises(torch_file.TorchFileError, match="written twice"):
        torch_file.combine_ranges(6, parts + [(2, 1, zlib.crc32(b"c"))])
    rng = random.Random(0)
    for _ in range(20):
        a, b = rng.randbytes(rng.randrange(300)), rng.randbytes(rng.randrange(300))
        assert torch_file.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_zip64_layout(tmp_path):
    """A storage over 4 GiB: the archive uses zip64 records; only the layout is planned
    (the big tensor is never touched), the file is sparse."""
    big = torch.empty((1_100_000_000,), dtype=torch.float32)
    obj = {"big": big, "small": torch.empty((10,), dtype=torch.float32)}
    layout = torch_file.plan(obj)
    assert layout.size > 4 << 30
    path = str(tmp_path / "big.pt")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, layout.size)
        layout.write_skeleton(fd)
        key, off = layout.storage_offset(obj["small"])
        data = torch.arange(10, dtype=torch.float32).numpy().tobytes()
        os.pwrite(fd, data, off)
        layout.patch_crc(fd, key, zlib.crc32(data))
    finally:
        os.close(fd)
    got = torch.load(path, mmap=True, weights_only=True)
    assert torch.equal(got["small"], torch.arange(10, dtype=torch.float32)) and got["big"].shape == big.shape
    with zipfile.ZipFile(path) as z:
        info = {i.filename.split("/", 1)[1]: i for i in z.infolist()}
        assert info[f"data/{key}"].CRC == zlib.crc32(data)
        with z.open(info[f"data/{key}"]) as f:
            assert f.read() == data


@pytest.mark.parametrize("chunk", [8, 1 << 20])
def test_digest_fed_while_writing_is_the_verified_digest(tmp_path, monkeypatch, chunk):
    """The saver's digest, fed chunk by chunk as it writes (padding too), equals the digest
    the VERIFY round computes over the same shard (``integrity.digest_shard_buckets``)."""
    from mindspeed_ha.checkpoint import integrity

    monkeypatch.setattr(dp_zero, "CHUNK_BYTES", chunk)
    groups = _groups(2)
    world = _world(groups)
    path = str(tmp_path / "iter" / "distrib_optim.pt")
    os.makedirs(os.path.dirname(path))
    for j in (0, 1):
        streamed = integrity.StreamingShardDigest(2)
        dp_zero.write_shard(path, dp_zero.FilePlan(groups), j, 2, _shard_items(groups, world, j, 2),
                            str(tmp_path), 0, 0, 7, streamed)
        assert streamed.result() == integrity.digest_shard_buckets(2, _shard_items(groups, world, j, 2))
    dp_zero.finalize(path, dp_zero.FilePlan(groups), 2, str(tmp_path), 0, 0, 7)
    got = torch.load(path, weights_only=True)
    assert torch.equal(got[0][DTYPE_KEY]["exp_avg"], _expected(groups, world)[0][DTYPE_KEY]["exp_avg"])


def test_save_writes_what_torch_save_writes(tmp_path):
    """torch_file.save (one writer): views of one storage, bf16, empty tensors, tensors
    inside an object; torch.load reads the same values, the CRCs are right."""
    import argparse

    buf = torch.randn(100)
    obj = {"a": buf[10:20], "b": buf[30:50].view(4, 5), "bf": torch.randn(3).bfloat16(), "e": torch.empty(0),
           "ns": argparse.Namespace(t=torch.arange(4), n=1), "l": [torch.ones(2), (torch.zeros(1), 5)]}
    path = str(tmp_path / "m.pt")
    torch_file.save(obj, path)
    got = torch.load(path, weights_only=False)
    for k in ("a", "b", "bf", "e"):
        assert got[k].dtype == obj[k].dtype and torch.equal(got[k], obj[k]), k
    assert torch.equal(got["ns"].t, obj["ns"].t) and got["ns"].n == 1
    assert torch.equal(got["l"][0], obj["l"][0]) and torch.equal(got["l"][1][0], obj["l"][1][0])
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None


def test_layout_without_skip_data_is_the_same(monkeypatch):
    """torch < 2.5 has no ``torch.serialization.skip_data``: the storages' writes are
    recognised by address; same records and offsets, and no storage byte is kept."""
    groups = _groups(2)
    with_skip = dp_zero.FilePlan(groups).file
    monkeypatch.delattr(torch.serialization, "skip_data")
    without = dp_zero.FilePlan(groups).file
    assert without.size == with_skip.size
    assert {k: (r.data_offset, r.nbytes) for k, r in without.records.items()} == \
        {k: (r.data_offset, r.nbytes) for k, r in with_skip.records.items()}
    assert sum(len(b) for _, b in without.chunks) == sum(len(b) for _, b in with_skip.chunks)


def _fake_optimizer(local, params):
    """A DistributedOptimizer as far as ``shards.shard_buckets`` reads it: one buffer, one
    bucket of ``local`` elements per shard (one shard), ``params`` = [(lo, hi)] ranges in it."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(3)
    states = {f"p{i}": {k: torch.rand(hi - lo, generator=g) + 1 for k in KEYS} for i, (lo, hi) in enumerate(params)}
    param_map = {name: {"gbuf_local": SimpleNamespace(start=lo, end=hi)} for name, (lo, hi) in zip(states, params)}
    bucket = SimpleNamespace(grad_data=torch.empty(local), numel_unpadded=local)
    return SimpleNamespace(
        gbuf_ranges=[{DTYPE_KEY: [{"param_map": param_map}]}],
        buffers=[SimpleNamespace(numel_unpadded=local, buckets=[bucket])],
        data_parallel_group=SimpleNamespace(size=lambda: 1),
        _get_main_param_and_optimizer_states=lambda name: states[name]), states


def test_shard_gather_sets_every_element_padding_zero(monkeypatch):
    """``shard_buckets`` allocates its shard uninitialised and writes each element once: the
    parameters' ranges copied, the padding between and after them zero, whatever the
    allocator hands back (here NaN). Padding left uninitialised would make the digest of
    one shard differ between VERIFY and the save and between replicas."""
    from mindspeed_ha.checkpoint import shards

    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    params = [(3, 10), (16, 40), (40, 41), (64, 90)]  # gaps [0,3) [10,16) [41,64) [90,100)
    opt, states = _fake_optimizer(100, params)
    (_, _, _, _, shard), = list(shards.shard_buckets(opt, 1))
    (_, _, _, _, pieces), = list(shards.shard_buckets(opt, 1, copy=False))
    for k in KEYS:
        want = torch.zeros(100)
        for name, (lo, hi) in zip(states, params):
            want[lo:hi] = states[name][k]
        assert torch.equal(shard[k], want), k
        assert torch.equal(torch.cat(pieces[k]), want), k
        # without copy the parameters' pieces are their own state's memory
        assert {t.data_ptr() for t in pieces[k]} >= {states[n][k].data_ptr() for n in states}, k
    assert list(shards.gaps([(5, 7), (0, 2), (7, 9)], 12)) == [(2, 5), (9, 12)]
    assert list(shards.gaps([], 4)) == [(0, 4)] and list(shards.gaps([(0, 4)], 4)) == []


def test_background_fsync_joins_and_raises_the_fsync_error(tmp_path, monkeypatch):
    """The shard's fsync in a thread (the saver writes its model file meanwhile): every
    fsync is joined when the block ends and an fsync error (EIO) fails the block; an error
    inside the block wins over it; no thread is left."""
    import errno
    import threading

    from mindspeed_ha.checkpoint import files

    path = str(tmp_path / "f")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        with files.fsync_in_background() as bg:  # a real fsync: fine
            os.write(fd, b"x")
            bg(fd)
        real_fsync = os.fsync

        def failing(f):
            real_fsync(f)
            raise OSError(errno.EIO, "injected")

        monkeypatch.setattr(files.os, "fsync", failing)
        with pytest.raises(OSError, match="injected"):
            with files.fsync_in_background() as bg:
                bg(fd)
        with pytest.raises(ValueError, match="the block's"):
            with files.fsync_in_background() as bg:
                bg(fd)
                raise ValueError("the block's")
    finally:
        os.close(fd)
    assert not [t for t in threading.enumerate() if t.name == "mindspeed-ha-fsync"]


def test_shard_written_from_pieces_is_the_file_and_digest_of_the_whole(tmp_path, monkeypatch):
    """A saver writing its shard from the parameters' own tensors (``shard_buckets(copy=False)``:
    a list of pieces per state) writes the same bytes, CRCs and digest as from one gathered
    tensor, whatever the chunk size cuts through the pieces."""
    from mindspeed_ha.checkpoint import integrity

    monkeypatch.setattr(dp_zero, "CHUNK_BYTES", 12)
    groups = _groups(2)
    world = _world(groups)

    def pieces(items):
        for g, n, dk, i, shard in items:
            cut = dict(shard)
            for k in KEYS:  # uneven pieces, an empty one too
                t = shard[k]
                cut[k] = [t[:1], t[1:1], t[1:4], t[4:]]
            yield g, n, dk, i, cut

    out = {}
    for name, wrap in (("whole", lambda x: x), ("pieces", pieces)):
        path = str(tmp_path / name / "distrib_optim.pt")
        os.makedirs(os.path.dirname(path))
        for j in (0, 1):
            d = integrity.StreamingShardDigest(2)
            dp_zero.write_shard(path, dp_zero.FilePlan(groups), j, 2, wrap(_shard_items(groups, world, j, 2)),
                                str(tmp_path / name), 0, 0, 7, d)
            assert d.result() == integrity.digest_shard_buckets(2, _shard_items(groups, world, j, 2))
        dp_zero.finalize(path, dp_zero.FilePlan(groups), 2, str(tmp_path / name), 0, 0, 7)
        with open(path, "rb") as f:
            out[name] = f.read()
    assert out["pieces"] == out["whole"]
    with pytest.raises(dp_zero.DPZeroError, match="expected contiguous CPU float32"):
        items = list(pieces(_shard_items(groups, world, 0, 2)))
        items[0][4]["param"] = items[0][4]["param"][:-1]  # one element short
        dp_zero.write_shard(str(tmp_path / "short"), dp_zero.FilePlan(groups), 0, 2, items,
                            str(tmp_path / "short_root"), 0, 0, 7)
