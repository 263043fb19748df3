"""integrations.megatron_lm: Megatron-LM core_v0.12.1's names, state dict, args, atomic commit."""

import argparse
import os
import sys
import types

import pytest
import torch

from mindspeed_ha.integrations import megatron_lm as mlm


def test_names_are_megatron_lms():
    name = mlm.get_checkpoint_name("/s", 5, pipeline_parallel=False, tensor_rank=1, pipeline_rank=0,
                                   expert_parallel=False, expert_rank=0)
    assert name == "/s/iter_0000005/mp_rank_01/model_optim_rng.pt"
    name = mlm.get_checkpoint_name("/s", 1234567, pipeline_parallel=True, tensor_rank=0, pipeline_rank=3,
                                   expert_parallel=True, expert_rank=2)
    assert name == "/s/iter_1234567/mp_rank_00_003_002/model_optim_rng.pt"
    assert mlm.get_checkpoint_name("/s", 7, return_base_dir=True) == "/s/iter_0000007"
    assert mlm.get_checkpoint_name("/s", 7, release=True, return_base_dir=True) == "/s/release"
    assert mlm.get_distributed_optimizer_checkpoint_name(name) == "/s/iter_1234567/mp_rank_00_003_002/distrib_optim.pt"
    assert mlm.get_checkpoint_tracker_filename("/s") == "/s/latest_checkpointed_iteration.txt"


def test_expected_files():
    args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                              use_distributed_optimizer=True, no_save_optim=False)
    assert mlm.expected_files(args) == [
        "mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_000/distrib_optim.pt",
        "mp_rank_00_001/model_optim_rng.pt", "mp_rank_00_001/distrib_optim.pt",
        "mp_rank_01_000/model_optim_rng.pt", "mp_rank_01_000/distrib_optim.pt",
        "mp_rank_01_001/model_optim_rng.pt", "mp_rank_01_001/distrib_optim.pt"]
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              use_distributed_optimizer=False, no_save_optim=False)
    assert mlm.expected_files(args) == ["mp_rank_00/model_optim_rng.pt"]


class _Chunk:
    def __init__(self, tag):
        self.tag = tag

    def state_dict_for_save_checkpoint(self):
        return {"w": self.tag}


class _StateDict:
    def __init__(self, sd):
        self.sd = sd

    def state_dict(self):
        return self.sd


def test_generate_state_dict_keys():
    args = argparse.Namespace(no_save_optim=False, no_save_rng=False)
    sd = mlm.generate_state_dict(args, [_Chunk(1)], _StateDict({"o": 1}), _StateDict({"num_steps": 8}),
                                 ["rng"], iteration=4, num_floating_point_operations_so_far=12.0)
    assert sd == {"args": args, "checkpoint_version": 3.0, "iteration": 4, "model": {"w": 1},
                  "optimizer": {"o": 1}, "opt_param_scheduler": {"num_steps": 8},
                  "rerun_state_machine": None, "rng_state": ["rng"],
                  "num_floating_point_operations_so_far": 12.0}
    args = argparse.Namespace(no_save_optim=True, no_save_rng=True)
    sd = mlm.generate_state_dict(args, [_Chunk(1), _Chunk(2)], _StateDict({}), _StateDict({}), ["rng"])
    assert sorted(sd) == ["args", "checkpoint_version", "model0", "model1", "rerun_state_machine"]


def test_unwrap_model():
    inner = object()
    wrapped = types.SimpleNamespace(module=types.SimpleNamespace(module=inner))
    assert mlm.unwrap_model(wrapped) is inner
    assert mlm.unwrap_model([wrapped, inner]) == [inner, inner]


def test_current_args(monkeypatch):
    monkeypatch.delitem(sys.modules, "megatron.training.global_vars", raising=False)
    assert mlm.current_args() is None  # megatron.training not in use
    gv = types.ModuleType("megatron.training.global_vars")
    state = {"args": None}

    def get_args():
        assert state["args"] is not None, "args is not initialized."
        return state["args"]

    gv.get_args = get_args
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)
    assert mlm.current_args() is None  # imported, not set up yet
    state["args"] = argparse.Namespace(save="/s")
    assert mlm.current_args() is state["args"]


def _fake_ckpt(root, iteration, with_optim=True, corrupt=False):
    d = root / "mp_rank_00"
    d.mkdir(parents=True)
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              use_distributed_optimizer=True, no_save_optim=False)
    torch.save({"args": args, "iteration": iteration, "model": {}}, d / "model_optim_rng.pt")
    if with_optim:
        if corrupt:
            (d / "distrib_optim.pt").write_bytes(b"not a torch file")
        else:
            torch.save({"param": torch.zeros(2)}, d / "distrib_optim.pt")


def test_tracker(tmp_path):
    assert mlm.read_tracker_iteration(str(tmp_path)) is None
    mlm.write_tracker(str(tmp_path), 12)
    assert mlm.read_tracker_iteration(str(tmp_path)) == 12
    assert os.listdir(tmp_path) == ["latest_checkpointed_iteration.txt"]  # no temp file left
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    assert mlm.read_tracker_iteration(str(tmp_path)) is None


def test_commit_refuses_invalid_and_keeps_tracker(tmp_path):
    save = tmp_path / "save"
    save.mkdir()
    mlm.write_tracker(str(save), 3)
    for name, kw in (("missing", dict(with_optim=False)), ("corrupt", dict(corrupt=True))):
        tmp = save / f"{name}.tmp"
        _fake_ckpt(tmp, 5, **kw)
        with pytest.raises(mlm.CheckpointError):
            mlm.commit_checkpoint(str(tmp), str(save), 5)
        assert (save / "latest_checkpointed_iteration.txt").read_text() == "3"
        assert not (save / "iter_0000005").exists()
    wrong = save / "wrong.tmp"
    _fake_ckpt(wrong, 4)
    with pytest.raises(mlm.CheckpointError, match="iteration"):
        mlm.commit_checkpoint(str(wrong), str(save), 5)


def test_commit_publishes_atomically(tmp_path):
    save = tmp_path / "save"
    tmp = save / "x.tmp"
    _fake_ckpt(tmp, 7)
    final = mlm.commit_checkpoint(str(tmp), str(save), 7)
    assert final == str(save / "iter_0000007") and not tmp.exists()
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert sorted(os.listdir(save)) == ["iter_0000007", "latest_checkpointed_iteration.txt"]
    assert mlm.validate_checkpoint_dir(final, 7) == ["mp_rank_00/model_optim_rng.pt", "mp_rank_00/distrib_optim.pt"]
    again = save / "y.tmp"
    _fake_ckpt(again, 7)
    with pytest.raises(FileExistsError):
        mlm.commit_checkpoint(str(again), str(save), 7)
    mlm.commit_checkpoint(str(again), str(save), 7, overwrite=True)
    assert sorted(os.listdir(save)) == ["iter_0000007", "latest_checkpointed_iteration.txt"]


def test_runtime_and_dying_checkpoint_do_not_import_the_trainer():
    """The runtime reaches Megatron-LM through the integration only (fresh interpreter)."""
    import subprocess

    code = ("import sys, mindspeed_ha.runtime, mindspeed_ha.checkpoint.dying; "
            "print(sorted(m for m in sys.modules if m.startswith('mindspeed_ha.testing')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
