"""The Megatron-LM-shaped trainer on real megatron-core, gloo, 4 real ranks.

Runs are few and shared: per layout the uninterrupted run is the session's shared one (the
``uninterrupted`` fixture, tests/conftest.py: HA on, which trains bit for bit like HA off),
and this module adds one run that saves and exits half-way (its first iterations are the
same-seed determinism check: another launch, HA off) and one resumed run. Jobs start
through ``mindspeed-ha-run`` with its fork server (half the CPU of torchrun's fresh
workers); plain torchrun jobs are tests/test_dying_checkpoint.py's
``test_plain_torchrun_rank0_killed`` and the as-users-run tests (tests/conftest.py).
"""

import math
import os

import pytest
import torch

from mindspeed_ha.testing.harness import launch, launcher_command, tiny_gpt_args

ITERS = 6  # as tests/test_dying_checkpoint.py: its uninterrupted runs are shared (conftest)
HALF = 2
TIMEOUT = 180


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def run_env(workdir):
    return {"MINDSPEED_HA_CACHE": str(workdir / "cache"), "OMP_NUM_THREADS": "1"}


def _run(workdir, run_env, name, **kw):
    res = launch(4, tiny_gpt_args(**kw), launcher=launcher_command(4), env=run_env, timeout_s=TIMEOUT,
                 loss_log=str(workdir / f"{name}.jsonl"))
    assert res.returncode == 0, f"{name} failed:\n{res.stderr[-4000:]}"
    return res


_cache = {}


def _layout_runs(workdir, run_env, uninterrupted, tp, pp):
    """(losses of the uninterrupted run, the run that exits at HALF, the resumed run, its --save)."""
    key = (tp, pp)
    if key not in _cache:
        tag = f"tp{tp}pp{pp}"
        full, _ = uninterrupted(tp, pp, ITERS)
        ckpt = str(workdir / f"{tag}-ckpt")
        first = _run(workdir, run_env, f"{tag}-first", tp=tp, pp=pp, train_iters=ITERS, save=ckpt,
                     save_interval=1000, exit_interval=HALF)
        resumed = _run(workdir, run_env, f"{tag}-resumed", tp=tp, pp=pp, train_iters=ITERS, load=ckpt,
                       save=ckpt)
        _cache[key] = (full, first, resumed, ckpt)
    return _cache[key]


def _floats(losses):
    return [float.fromhex(losses[i]) for i in sorted(losses)]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_train_deterministic_and_resume_bitwise(workdir, run_env, uninterrupted, tp, pp):
    full, first, resumed, ckpt = _layout_runs(workdir, run_env, uninterrupted, tp, pp)
    assert sorted(full) == list(range(1, ITERS + 1))
    vals = _floats(full)
    assert all(math.isfinite(v) for v in vals)
    assert vals[-1] < vals[0], vals
    # same seed, same first iterations: bitwise
    assert first.losses == {i: full[i] for i in range(1, HALF + 1)}
    # resume from iteration HALF: bitwise equal to the uninterrupted run (dropout on)
    assert resumed.losses == {i: full[i] for i in range(HALF + 1, ITERS + 1)}
    assert "successfully loaded checkpoint" in resumed.stdout
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(ITERS)  # the resumed run saved at the end
    assert not [d for d in os.listdir(ckpt) if d.endswith(".tmp")]


def test_checkpoint_is_megatron_lm_layout(workdir, run_env, uninterrupted):
    _, _, _, ckpt = _layout_runs(workdir, run_env, uninterrupted, 1, 2)
    d = os.path.join(ckpt, f"iter_{HALF:07d}")
    assert sorted(os.listdir(d)) == ["mp_rank_00_000", "mp_rank_00_001"]
    sd = torch.load(os.path.join(d, "mp_rank_00_001", "model_optim_rng.pt"), weights_only=False)
    for key in ("args", "checkpoint_version", "iteration", "model", "optimizer",
                "opt_param_scheduler", "rng_state", "num_floating_point_operations_so_far"):
        assert key in sd, key
    assert sd["checkpoint_version"] == 3.0 and sd["iteration"] == HALF
    rng = sd["rng_state"][0]
    assert set(rng) == {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state",
                        "rng_tracker_states"}
    assert os.path.isfile(os.path.join(d, "mp_rank_00_001", "distrib_optim.pt"))
    assert sd["args"].consumed_train_samples == HALF * 8


def test_dp4_fp32_deterministic(workdir, run_env):
    a = _run(workdir, run_env, "dp4-a", train_iters=3, use_distributed_optimizer=False)
    b = _run(workdir, run_env, "dp4-b", train_iters=3, use_distributed_optimizer=False)
    assert len(a.losses) == 3 and a.losses == b.losses
    vals = _floats(a.losses)
    assert all(math.isfinite(v) for v in vals) and vals[-1] < vals[0]
    assert " iteration        3/       3 |" in a.stdout and "lm loss:" in a.stdout


def test_bf16_tp2_pp2(workdir, run_env, uninterrupted):
    r = _run(workdir, run_env, "bf16", tp=2, pp=2, train_iters=3, bf16=True)
    vals = _floats(r.losses)
    assert len(vals) == 3 and all(math.isfinite(v) for v in vals)
    # bf16 and fp32 runs of the same model differ (the flag really changes the dtype)
    full, _ = uninterrupted(2, 1, ITERS)
    assert r.losses[1] != full[1]


def test_unwritable_save_fails_before_training(workdir, run_env, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = launch(1, tiny_gpt_args(train_iters=2, save=str(blocker / "sub")), env=run_env,
               timeout_s=TIMEOUT, loss_log=str(tmp_path / "l.jsonl"))
    assert r.returncode != 0
    assert "--save" in r.stderr
    assert r.losses == {}


# ---- unit tests (in process) ------------------------------------------------------


def test_indexed_dataset_round_trip(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from mindspeed_ha.testing.trainer.data import EOD_ID, build_indexed_dataset, split_documents

    docs = split_documents("hello world\n\nsecond paragraph\nwith two lines\n\n\n  \n\nwörld")
    assert docs == ["hello world", "second paragraph\nwith two lines", "wörld"]
    prefix = build_indexed_dataset(docs, str(tmp_path / "corpus"))
    ds = IndexedDataset(prefix)
    assert len(ds) == 3
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == list(doc.encode("utf-8")) + [EOD_ID]
    assert sorted(os.listdir(tmp_path)) == ["corpus.bin", "corpus.idx"]  # no temp leftovers


def test_preprocess_cli(tmp_path):
    from mindspeed_ha.testing.trainer import data

    src = tmp_path / "in.txt"
    src.write_text("line one\nline two\n", encoding="utf-8")
    assert data.main(["--input", str(src), "--output-prefix", str(tmp_path / "p"), "--split-lines"]) == 0
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    assert len(IndexedDataset(str(tmp_path / "p"))) == 2


def test_unwritable_save_message(tmp_path):
    from mindspeed_ha.testing.trainer.checkpointing import CheckpointError, check_save_dir_writable

    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(CheckpointError, match="--save"):
        check_save_dir_writable(str(f / "x"))


@pytest.mark.parametrize("argv,flag", [
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),
    (["--ckpt-format", "torch_dist"], "--ckpt-format"),
    (["--fp16"], "--fp16"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout"),
    (["--seed", "0"], "--seed"),
    (["--global-batch-size", "3"], "--global-batch-size"),
])
def test_validate_args_names_flag(argv, flag, monkeypatch):
    from mindspeed_ha.testing.trainer.arguments import ArgumentError, parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", "4")
    base = tiny_gpt_args(train_iters=2)
    args = parse_args(args=base + argv)
    with pytest.raises(ArgumentError, match=flag):
        validate_args(args)


def test_validate_args_megatron_semantics(monkeypatch):
    from mindspeed_ha.testing.trainer.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", "4")
    args = validate_args(parse_args(args=tiny_gpt_args(tp=2, train_iters=2)))
    assert args.data_parallel_size == 2
    assert args.padded_vocab_size == 512  # 257 padded to a multiple of 128 * TP
    assert args.num_distributed_optimizer_instances == 1
    assert args.no_load_rng is False and args.data_parallel_random_init is False
