"""Checkpoints are never lost by the dying checkpoint's commit, and nothing is run from a
file in ``--save`` (issue 21, part 4). No processes: the directory layouts are built in
``tmp_path`` and the commit, discard, start-up sweep and validation are called directly.

A regular save's directory is not ours (Megatron-LM wrote it): it is published when it
validates, otherwise moved aside, never deleted, and put back when the commit fails. A
staging dir is deleted only when it is ours (name + owner marker) and never validated.
"""

import argparse
import errno
import json
import logging
import os
import stat
import subprocess
import sys

import pytest
import torch

from mindspeed_ha.checkpoint import dp_zero, dying, files, formats, leftovers, publish, safe_load, staging
from mindspeed_ha.checkpoint import torch_dist_parts as td
from mindspeed_ha.checkpoint.formats.torch import atomic_torch_save
from mindspeed_ha.errors import CheckpointError, ConfigError
from mindspeed_ha.integrations import megatron_lm as mlm

TRACKER = mlm.TRACKER_FILE
MODEL = mlm.MODEL_FILE


def _args(ep=1, **kw):
    return argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              expert_model_parallel_size=ep, use_distributed_optimizer=False,
                              no_save_optim=False, **kw)


def _regular(save, iteration, who="regular", ep=1, args=True):
    """A complete regular save of ``iteration`` (``mp_rank_00[_EEE]``), not in the tracker."""
    for e in range(ep):
        d = os.path.join(save, f"iter_{iteration:07d}", "mp_rank_00" + (f"_{e:03d}" if ep > 1 else ""))
        os.makedirs(d)
        sd = {"iteration": iteration, "who": who}
        if args:
            sd["args"] = _args(ep)
        torch.save(sd, os.path.join(d, MODEL))


def _half_written(save, iteration):
    d = os.path.join(save, f"iter_{iteration:07d}", "mp_rank_00")
    os.makedirs(d)
    with open(os.path.join(d, MODEL), "wb") as f:
        f.write(b"PK\x03\x04 truncated")


def _staged(save, iteration):
    """What the savers of a dying checkpoint of ``iteration`` leave for the commit."""
    root = staging.create(save, iteration)
    d = os.path.join(root, f"iter_{iteration:07d}", "mp_rank_00")
    os.makedirs(d)
    torch.save({"args": _args(), "iteration": iteration, "who": "dying"}, os.path.join(d, MODEL))
    return root


def _who(path):
    return safe_load.read_torch_file(os.path.join(path, "mp_rank_00", MODEL))["who"]


def _tree(path):
    """Every file under ``path`` with its bytes (to prove a directory was kept intact)."""
    out = {}
    for base, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(base, n), "rb") as f:
                out[os.path.relpath(os.path.join(base, n), path)] = f.read()
    return out


def _moved(save):
    """``{original name: moved path}`` of what the commit moved aside."""
    return {a.name: a.path for a, _ in leftovers.containers(save)}


def _disk_full(*a, **kw):
    raise OSError(errno.ENOSPC, "No space left on device")


# ---- (b) a complete regular save of k the tracker does not name --------------------------
def test_a_complete_untracked_save_of_k_is_published_not_replaced(tmp_path):
    save = str(tmp_path)
    mlm.write_tracker(save, 2)
    _regular(save, 4)
    _staged(save, 4)
    assert "published" in dying.commit(save, 4)
    assert mlm.read_tracker_iteration(save) == 4
    assert _who(os.path.join(save, "iter_0000004")) == "regular"
    assert sorted(os.listdir(save)) == ["iter_0000004", TRACKER]  # our redundant copy went


def test_a_complete_untracked_save_of_k_survives_a_failed_tracker_write(tmp_path, monkeypatch):
    save = str(tmp_path)
    mlm.write_tracker(save, 2)
    _regular(save, 4)
    before = _tree(os.path.join(save, "iter_0000004"))
    _staged(save, 4)
    monkeypatch.setattr(mlm, "write_tracker", _disk_full)
    with pytest.raises(OSError, match="space"):
        dying.commit(save, 4)
    assert mlm.read_tracker_iteration(save) == 2
    assert _tree(os.path.join(save, "iter_0000004")) == before  # where it was, untouched


# ---- (a) later untracked directories: moved aside, never deleted --------------------------
@pytest.mark.parametrize("kind", ["expert_parallel", "no_args", "unreadable", "complete"])
def test_later_untracked_directories_are_moved_aside_never_deleted(tmp_path, kind, monkeypatch):
    save = str(tmp_path)
    mlm.write_tracker(save, 2)
    if kind == "expert_parallel":
        _regular(save, 6, ep=2)
    elif kind == "no_args":
        _regular(save, 6, args=False)
    else:
        _regular(save, 6)
    later = os.path.join(save, "iter_0000006")
    before = _tree(later)
    if kind == "unreadable":  # EIO/EACCES/NFS: whatever reads it fails (root ignores chmod)
        real = safe_load.read_torch_file
        monkeypatch.setattr(safe_load, "read_torch_file", lambda p: _raise_eio(p) if "iter_0000006" in p else real(p))
    _staged(save, 4)
    dying.commit(save, 4)
    assert mlm.read_tracker_iteration(save) == 4
    moved = _moved(save)
    assert list(moved) == ["iter_0000006"] and not os.path.exists(later)
    assert _tree(moved["iter_0000006"]) == before


def _raise_eio(path):
    raise OSError(errno.EIO, "Input/output error", path)


def test_a_half_written_save_of_k_is_moved_aside_and_replaced(tmp_path):
    save = str(tmp_path)
    mlm.write_tracker(save, 2)
    _half_written(save, 4)
    before = _tree(os.path.join(save, "iter_0000004"))
    _staged(save, 4)
    dying.commit(save, 4)
    assert mlm.read_tracker_iteration(save) == 4
    assert _who(os.path.join(save, "iter_0000004")) == "dying"
    assert _tree(_moved(save)["iter_0000004"]) == before  # kept, hidden


def test_a_save_the_tracker_names_is_kept(tmp_path):
    save = str(tmp_path)
    _regular(save, 4)
    mlm.write_tracker(save, 4)
    _staged(save, 4)
    assert "already saved" in dying.commit(save, 4)
    assert sorted(os.listdir(save)) == ["iter_0000004", TRACKER]
    assert _who(os.path.join(save, "iter_0000004")) == "regular"


# ---- a failed commit: everything put back, the validated copy kept with its command ------
def test_a_failed_commit_puts_back_what_it_moved_and_keeps_the_validated_copy(tmp_path, monkeypatch, caplog):
    save = str(tmp_path)
    mlm.write_tracker(save, 2)
    _half_written(save, 4)
    _regular(save, 6)
    before = {n: _tree(os.path.join(save, n)) for n in ("iter_0000004", "iter_0000006")}
    root = _staged(save, 4)
    real_write_tracker = mlm.write_tracker
    monkeypatch.setattr(mlm, "write_tracker", _disk_full)
    with caplog.at_level(logging.ERROR), pytest.raises(OSError, match="space"):
        dying.commit(save, 4)
    assert mlm.read_tracker_iteration(save) == 2
    assert {n: _tree(os.path.join(save, n)) for n in before} == before  # both put back
    assert leftovers.containers(save) == []
    assert staging.is_validated(root) and _who(os.path.join(root, "iter_0000004")) == "dying"
    command = staging.publish_command(save, 4)
    assert command in caplog.text
    assert "publish it with" in dying.discard(save, 4) and os.path.isdir(root)  # the exit handler keeps it

    monkeypatch.setattr(mlm, "write_tracker", real_write_tracker)
    r = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    assert mlm.read_tracker_iteration(save) == 4
    assert _who(os.path.join(save, "iter_0000004")) == "dying"
    assert not os.path.exists(root)
    assert sorted(_moved(save)) == ["iter_0000004", "iter_0000006"]  # aside, kept


def test_a_commit_that_fails_validation_leaves_staging_for_discard(tmp_path):
    save = str(tmp_path)
    mlm.write_tracker(save, 2)
    root = _staged(save, 4)
    os.remove(os.path.join(root, "iter_0000004", "mp_rank_00", MODEL))
    os.makedirs(os.path.join(root, "iter_0000004", "mp_rank_00", "x"))
    with pytest.raises(CheckpointError):
        dying.commit(save, 4)
    assert not staging.is_validated(root)
    assert dying.discard(save, 4).startswith("removed")
    assert sorted(os.listdir(save)) == [TRACKER]
    assert publish.main([save, "4"]) == 2  # nothing validated to publish


# ---- nothing from a file in --save is run -------------------------------------------------
CALLED = []


def _payload():
    CALLED.append(True)
    return "ran"


class Payload:
    def __reduce__(self):
        return (_payload, ())


def test_validation_runs_nothing_from_the_files(tmp_path):
    CALLED.clear()
    ckpt = tmp_path / "iter_0000004"
    d = ckpt / "mp_rank_00"
    os.makedirs(d)
    torch.save({"args": _args(payload=Payload()), "iteration": 4, "x": Payload()}, str(d / MODEL))
    assert mlm.validate_checkpoint_dir(str(ckpt), 4) == ["mp_rank_00/" + MODEL]
    save = str(tmp_path / "save")
    os.makedirs(save)
    mlm.write_tracker(save, 2)
    os.rename(str(ckpt), os.path.join(save, "iter_0000004"))
    _staged(save, 4)
    dying.commit(save, 4)  # the untracked iter_4 is validated (and published)
    dist = tmp_path / "dist"
    os.makedirs(dist)
    (dist / td.CONFIG_FILE).write_text(json.dumps({"sharded_backend": "torch_dist"}))
    import pickle

    (dist / td.METADATA_FILE).write_bytes(pickle.dumps(Payload()))
    torch.save({"iteration": 4, "x": Payload()}, str(dist / td.COMMON_FILE))
    with pytest.raises(CheckpointError, match="not DCP Metadata"):
        td.validate_checkpoint_dir(str(dist), 4)
    assert CALLED == []
    assert safe_load.loads(pickle.dumps(Payload())).global_name == (__name__, "_payload")


def test_a_truncated_or_short_record_does_not_validate(tmp_path):
    path = tmp_path / MODEL
    torch.save({"args": _args(), "iteration": 1, "w": torch.ones(1000)}, str(path))
    data = path.read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="not a complete"):
        safe_load.read_torch_file(str(tmp_path / "cut.pt"))
    assert safe_load.read_torch_file(str(path))["iteration"] == 1


# ---- expert parallelism ------------------------------------------------------------------
def test_an_expert_parallel_save_validates(tmp_path):
    _regular(str(tmp_path), 6, ep=2)
    assert formats.validate_checkpoint_dir(str(tmp_path / "iter_0000006"), 6) == [
        "mp_rank_00_000/" + MODEL, "mp_rank_00_001/" + MODEL]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_expert_parallelism_is_refused_at_start_up(fmt):
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 2"):
        formats.check_args(argparse.Namespace(ckpt_format=fmt, expert_model_parallel_size=2))


# ---- start-up: stale staging of killed saves -----------------------------------------------
def test_start_up_sweeps_what_killed_saves_left(tmp_path, caplog):
    save = str(tmp_path)
    mlm.write_tracker(save, 4)
    killed = staging.create(save, 6)  # ours, never validated: removed
    os.makedirs(os.path.join(killed, "ranges"))
    kept = _staged(save, 8)  # ours, validated: kept, its command logged
    staging.mark_validated(kept, 8)
    trash = _staged(save, 2)  # a published save's staging whose removal was killed
    staging.mark_validated(trash, 2)
    os.rename(trash, trash + ".discard.123.abc")
    foreign = os.path.join(save, staging.PREFIX + "0000010")  # our name, no marker: moved aside
    os.makedirs(foreign)
    with open(os.path.join(foreign, "f"), "w") as f:
        f.write("x")
    _regular(save, 12)
    unpublished = leftovers.move_aside(save, os.path.join(save, "iter_0000012"), 10, "test")  # commit of 10 died
    _regular(save, 3)
    published = leftovers.move_aside(save, os.path.join(save, "iter_0000003"), 4, "test")  # commit of 4 published
    with caplog.at_level(logging.WARNING):
        lines = leftovers.at_start_up(save)
    assert len(lines) == 6, lines
    assert not os.path.exists(killed) and not os.path.exists(trash + ".discard.123.abc")
    assert staging.is_validated(kept) and staging.publish_command(save, 8) in caplog.text
    unknown = [n for n in os.listdir(save) if n.startswith(staging.UNKNOWN_PREFIX)]
    assert len(unknown) == 1 and _tree(os.path.join(save, unknown[0])) == {"f": b"x"}
    assert _who(os.path.join(save, "iter_0000012")) == "regular" and not os.path.exists(unpublished.container)
    assert os.path.isdir(published.path)
    assert leftovers.at_start_up(save)[-1].endswith("kept (remove it by hand)")  # idempotent


def test_set_aside_containers_are_never_reused(tmp_path):
    save = str(tmp_path)
    paths = []
    for who in ("first", "second"):
        _regular(save, 6, who=who)
        paths.append(leftovers.move_aside(save, os.path.join(save, "iter_0000006"), 4, "test").path)
    assert paths[0] != paths[1]
    assert [_who(p) for p in paths] == ["first", "second"]


# ---- files: Megatron's modes, never through a link ------------------------------------------
@pytest.mark.parametrize("umask", [0o002, 0o022])
def test_files_get_megatrons_mode(tmp_path, umask):
    old = os.umask(umask)
    try:
        mlm.write_tracker(str(tmp_path), 4)
        atomic_torch_save({"w": torch.ones(2)}, str(tmp_path / "a" / MODEL))
        root = staging.create(str(tmp_path), 4)
    finally:
        os.umask(old)
    for path, mode in ((tmp_path / TRACKER, 0o666), (tmp_path / "a" / MODEL, 0o666), (root, 0o777)):
        assert stat.S_IMODE(os.stat(path).st_mode) == mode & ~umask, path
    assert sorted(os.listdir(tmp_path)) == sorted([TRACKER, "a", os.path.basename(root)])  # no temp left


def test_temp_files_never_follow_links(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    path = str(tmp_path / MODEL)
    os.symlink(target, f"{path}.tmp.{os.getpid()}")  # the name the save used before
    atomic_torch_save({"w": torch.ones(2)}, path)
    os.symlink(target, str(tmp_path / f".{TRACKER}.link"))
    mlm.write_tracker(str(tmp_path), 3)
    with pytest.raises(FileExistsError):
        files.create_new(f"{path}.tmp.{os.getpid()}")
    ranges = str(tmp_path / "ranges" / "tp00_pp000_s0000.json")
    os.makedirs(os.path.dirname(ranges))
    os.symlink(target, f"{ranges}.tmp.{os.getpid()}")
    dp_zero._write_json(ranges, {"a": 1})
    assert target.read_bytes() == b"keep"
    assert torch.load(path, weights_only=True)["w"].tolist() == [1.0, 1.0]
