"""The dying checkpoint holds Megatron-LM's own counters and state (issue 7, items 4 and 5).

Stock Megatron-LM core_v0.12.1 ``pretrain_gpt.py`` on 4 CPU/gloo ranks. For each flag set
a regular ``--save-interval`` save of iteration ``K`` (HA off) and the dying checkpoint of
``K`` (HA on, a rank killed in iteration ``K+1``) are compared key by key and tensor by
tensor, every file of ``iter_XXXXXXX``: args, iteration, model, optimizer, scheduler,
rerun state, RNG (one state per DP rank with ``--data-parallel-random-init``) and the
FLOP count. The args entries that legitimately differ are listed in :data:`RUN_ARGS` and
:data:`SAVER_ARGS`, each with why.

Flag sets, combined into as few runs as the proof allows:

* PP2 + bf16 + ``--rampup-batch-size`` (sample-based: the global batch grows from 4 to 8
  after 16 samples, so the consumed samples are not iteration x batch size) +
  ``--iterations-to-skip 2`` (iteration 3 is skipped: its samples are consumed and counted
  as skipped, the scheduler does not step, the checkpoints keep Megatron-LM's numbering);
* TP2 + ``--data-parallel-random-init`` + a global batch size changed on resume (8 for
  iterations 1-4, then 16: Megatron-LM counts 32 + 2 x 16 = 64 samples at iteration 6,
  iteration x batch size would say 96). The run resumed from that dying checkpoint
  matches the uninterrupted one: losses bit for bit, learning rates, and the final
  checkpoint tensor by tensor.

Item 5: a resume that fails while loading the checkpoint (here a checkpoint with one RNG
state resumed with ``--data-parallel-random-init``: Megatron-LM's IndexError on DP rank 1)
ends with :data:`mindspeed_ha.faults.EXIT_FAILED_BEFORE_TRAINING` (79) and says so, not "no complete data".
"""

import argparse
import glob
import os
import re
import shutil

import numpy as np
import pytest
import torch

from mindspeed_ha import faults
from mindspeed_ha.testing import megatron_lm as mlm

pytestmark = pytest.mark.timeout(1200)


#: Args that differ between the two runs by construction, and why.
RUN_ARGS = {
    "save": "each run writes its own directory",
    "load": "the runs resume from different copies of the same checkpoint",
    "save_interval": "the regular save of K needs --save-interval K; the HA run must not save K itself",
    "exit_interval": "the HA-off run stops after its save of K",
    "enable_high_availability": "HA off for the regular save, on for the dying checkpoint",
    "ha_controller_port": "an HA flag (0: the launcher picks the port)",
    "num_distributed_optimizer_instances": "HA on keeps a second optimizer replica (feature replica); "
                                           "the DP-zero optimizer file does not depend on it",
}
#: Args that differ because another rank writes the file: the dying checkpoint's model
#: saver of a (TP, PP) position can be any DP replica of it, Megatron-LM's is DP rank 0.
SAVER_ARGS = {"rank", "local_rank"}

K = 6


@pytest.fixture(scope="module")
def tree(tmp_path_factory, megatron_lm_tarball):
    return mlm.unpack(megatron_lm_tarball, str(tmp_path_factory.mktemp("megatron_lm")))


def _argv(tp=1, pp=1, ha=False, rampup=None, override_scheduler=False, **flags):
    if ha:
        flags.update(enable_high_availability=True, ha_controller_port=0)
    argv = mlm.stock_gpt_args(tp=tp, pp=pp, **flags)
    if rampup:  # a flag with three values
        argv += ["--rampup-batch-size", *rampup.split()]
    if override_scheduler:  # spelled with an underscore by Megatron-LM
        argv.append("--override-opt_param-scheduler")
    return argv


def _run(tree, argv, env=None):
    r = mlm.launch_stock(tree, argv, env=env)
    assert not r.timed_out, r.stderr[-4000:]
    return r


def _iter_dir(save, k):
    return os.path.join(save, f"iter_{k:07d}")


def _tracker(save):
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read())


# ---- key-by-key comparison ---------------------------------------------------------------
def _diff(a, b, path, out, ignore_args):
    if isinstance(a, argparse.Namespace) and isinstance(b, argparse.Namespace):
        va, vb = vars(a), vars(b)
        for key in sorted(set(va) | set(vb)):
            if key in ignore_args:
                continue
            if key not in va or key not in vb:
                out.append(f"{path}.{key}: only in {'regular' if key in va else 'dying'}")
            else:
                _diff(va[key], vb[key], f"{path}.{key}", out, ignore_args)
    elif type(a) is not type(b) and not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        out.append(f"{path}: type {type(a).__name__} != {type(b).__name__}")
    elif isinstance(a, dict):
        if set(a) != set(b):
            out.append(f"{path}: keys {sorted(map(repr, set(a) ^ set(b)))} in one only")
        for key in a:
            if key in b:
                _diff(a[key], b[key], f"{path}[{key!r}]", out, ignore_args)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out, ignore_args)
    elif isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a,
                             b.reshape(-1).view(torch.uint8) if b.numel() else b):
            out.append(f"{path}: tensor values differ")
    elif isinstance(a, np.ndarray):
        if a.dtype != b.dtype or not np.array_equal(a, b):
            out.append(f"{path}: array differs")
    elif isinstance(a, float) and isinstance(b, float):
        if a.hex() != b.hex():
            out.append(f"{path}: {a!r} != {b!r}")
    elif a != b:
        out.append(f"{path}: {a!r} != {b!r}")


def compare_checkpoints(regular: str, dying: str, ignore_args=frozenset(RUN_ARGS) | SAVER_ARGS):
    """Differences between two ``iter_XXXXXXX`` dirs, every file, key by key, tensor by tensor."""
    files = sorted(os.path.relpath(p, regular) for p in glob.glob(os.path.join(regular, "**", "*.pt"), recursive=True))
    other = sorted(os.path.relpath(p, dying) for p in glob.glob(os.path.join(dying, "**", "*.pt"), recursive=True))
    assert files and files == other, (files, other)
    out = []
    for rel in files:
        a = torch.load(os.path.join(regular, rel), map_location="cpu", weights_only=False)
        b = torch.load(os.path.join(dying, rel), map_location="cpu", weights_only=False)
        _diff(a, b, rel, out, ignore_args)
    return out


def _model_files(iter_dir):
    return [torch.load(p, map_location="cpu", weights_only=False)
            for p in sorted(glob.glob(os.path.join(iter_dir, "mp_rank_*", "model_optim_rng.pt")))]


# ---- PP2 + bf16 + batch-size ramp-up ---------------------------------------------------------
def test_rampup_pp2_bf16_dying_checkpoint_equals_regular_save(tree, tmp_path):
    """Global batch 4 for 16 samples, then 8: at iteration 6 Megatron-LM counts 4 x 4 + 2 x 8 = 32
    samples (6 x 8 = 48 recomputed), 4 of them skipped (iteration 3), the scheduler 28 in.
    Also saved by Megatron-LM at the ramp-up step (4)."""
    flags = dict(pp=2, bf16=True, rampup="4 4 16", train_iters=None, lr_warmup_iters=None,
                 train_samples=48, lr_warmup_samples=8, iterations_to_skip=2)
    regular = str(tmp_path / "regular")
    r = _run(tree, _argv(save=regular, save_interval=K, exit_interval=K, **flags))
    assert r.returncode == 0, r.stderr[-4000:]
    dying = str(tmp_path / "dying")
    r = _run(tree, _argv(ha=True, save=dying, save_interval=1000, **flags),
             env={"MINDSPEED_HA_INJECT": f"rank=3,iteration={K + 1},point=backward"})
    assert r.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, r.stderr[-6000:]
    assert _tracker(dying) == K
    for sd in _model_files(_iter_dir(dying, K)):
        assert sd["args"].consumed_train_samples == 4 * 4 + 2 * 8
        assert sd["args"].skipped_train_samples == 4
        assert sd["opt_param_scheduler"]["num_steps"] == 4 * 4 + 2 * 8 - 4
    assert compare_checkpoints(_iter_dir(regular, K), _iter_dir(dying, K)) == []

    # The fault right after train_step of K returned, before Megatron-LM's loop counted K
    # (consumed samples, FLOPs): the raising rank (rank 0, the model saver of stage 0 here)
    # does that count on a copy with Megatron-LM's functions when it saves.
    raised = str(tmp_path / "raised")
    r = _run(tree, _argv(ha=True, save=raised, save_interval=1000, **flags),
             env={"MINDSPEED_HA_INJECT": f"rank=0,iteration={K},point=between,fault=raise"})
    assert r.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, r.stderr[-6000:]
    assert _tracker(raised) == K
    assert compare_checkpoints(_iter_dir(regular, K), _iter_dir(raised, K)) == []


# ---- TP2 + --data-parallel-random-init + batch size changed on resume ----------------------
TP2 = dict(tp=2, data_parallel_random_init=True, train_iters=8)


@pytest.fixture(scope="module")
def first_half(tree, tmp_path_factory):
    """Iterations 1-4 at global batch 8, saved at 4 (HA off)."""
    save = str(tmp_path_factory.mktemp("first_half") / "ckpt")
    r = _run(tree, _argv(save=save, save_interval=4, exit_interval=4, **TP2))
    assert r.returncode == 0, r.stderr[-4000:]
    assert _tracker(save) == 4
    return save


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _learning_rates(stdout):
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?learning rate: ([0-9.E+-]+)", stdout)}


def test_batch_size_change_dp_random_init_tp2(tree, first_half, tmp_path):
    """Resumed at global batch 16: the dying checkpoint of 6 equals Megatron-LM's save of 6
    (64 consumed samples, the scheduler 64 samples in, one RNG state per DP rank), and the
    run resumed from it equals the uninterrupted one: losses bit for bit, learning rates,
    and the final checkpoint of 8 tensor by tensor."""
    # --override-opt_param-scheduler: the warm-up and decay lengths in samples change with the
    # batch size; the scheduler's position (num_steps) still comes from the checkpoint.
    flags = dict(global_batch_size=16, override_scheduler=True, **TP2)
    regular = str(tmp_path / "regular")
    base = _run(tree, _argv(load=first_half, save=regular, save_interval=K, **flags))
    assert base.returncode == 0, base.stderr[-4000:]
    assert sorted(base.losses) == list(range(5, 9))

    dying = _copy(first_half, str(tmp_path / "dying"))
    r = _run(tree, _argv(ha=True, load=dying, save=dying, save_interval=1000, **flags),
             env={"MINDSPEED_HA_INJECT": f"rank=3,iteration={K + 1},point=backward"})
    assert r.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, r.stderr[-6000:]
    assert _tracker(dying) == K
    for sd in _model_files(_iter_dir(dying, K)):
        assert sd["args"].consumed_train_samples == 4 * 8 + 2 * 16
        assert sd["opt_param_scheduler"]["num_steps"] == 4 * 8 + 2 * 16
        assert len(sd["rng_state"]) == 2  # DP 2
    assert compare_checkpoints(_iter_dir(regular, K), _iter_dir(dying, K)) == []

    resumed = _run(tree, _argv(ha=True, load=dying, save=dying, save_interval=1000, **flags))
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert sorted(resumed.losses) == [7, 8]
    assert {k: resumed.losses[k] for k in (7, 8)} == {k: base.losses[k] for k in (7, 8)}
    assert {k: resumed.grad_norms[k] for k in (7, 8)} == {k: base.grad_norms[k] for k in (7, 8)}
    lr_base, lr_resumed = _learning_rates(base.stdout), _learning_rates(resumed.stdout)
    assert [lr_resumed.get(k) for k in (7, 8)] == [lr_base.get(k) for k in (7, 8)] != [None, None]
    # Megatron-LM's args keep the iteration and FLOP count the run started from (4 and 6).
    started = {"iteration", "num_floating_point_operations_so_far"}
    assert compare_checkpoints(_iter_dir(regular, 8), _iter_dir(dying, 8),
                               frozenset(RUN_ARGS) | SAVER_ARGS | started) == []


def test_resume_failure_is_reported_as_such(tree, first_half, tmp_path):
    """Item 5: a checkpoint with one RNG state (what the dying checkpoint used to write)
    resumed with --data-parallel-random-init: Megatron-LM's load fails on DP rank 1
    (IndexError). The job ends 79 (EXIT_FAILED_BEFORE_TRAINING) and says the resume failed, not
    'no complete data'."""
    bad = _copy(first_half, str(tmp_path / "one_rng_state"))
    for path in glob.glob(os.path.join(_iter_dir(bad, 4), "mp_rank_*", "model_optim_rng.pt")):
        sd = torch.load(path, map_location="cpu", weights_only=False)
        sd["rng_state"] = sd["rng_state"][:1]
        torch.save(sd, path)
    r = _run(tree, _argv(ha=True, load=bad, save=bad, save_interval=1000, **TP2))
    text = r.stdout + r.stderr
    assert r.returncode == faults.EXIT_FAILED_BEFORE_TRAINING, text[-6000:]
    assert "IndexError" in text
    assert "no complete data" not in text
    assert "before training started (start-up, or resuming from --load)" in text, text[-4000:]
    assert _tracker(bad) == 4  # the checkpoint is untouched


@pytest.mark.timeout(30)
@pytest.mark.parametrize("started", [False, True])
def test_policy_start_up_failure_is_not_no_complete_data(started):
    """The rule behind item 5, on the pure policy: a rank dies while no rank has reported an
    optimizer status (none reached train_step: start-up or --load failed) -> EXIT 79 with
    a reason saying so; once every rank reached its first train_step (UPDATED at the loaded
    iteration 4) the same death is a training fault (dying checkpoint of 4: DUMP/VERIFY)."""
    from mindspeed_ha.config import HAConfig
    from mindspeed_ha.control.policy import ActionKind, decide
    from mindspeed_ha.control.state import ClusterState, FaultKind, Layout, OptimizerStatus, Phase, RankInfo

    ranks = {}
    for r in range(4):  # TP1 PP1 DP4, two optimizer instances of two shards
        lay = Layout(tp_rank=0, pp_rank=0, dp_rank=r, tp_size=1, pp_size=1, dp_size=4, replica_count=2,
                     instance_id=r // 2, shard_id=r % 2)
        ranks[r] = RankInfo(rank=r, layout=lay, last_heartbeat=0.0, save_dir="/save",
                            **({"status": OptimizerStatus.UPDATED, "iteration": 4} if started else {}))
    st = ClusterState(world_size=4, ranks=ranks)
    ranks[2].alive, ranks[2].exit_code, ranks[2].dead_reason = False, 1, "said goodbye (exit code 1)"
    cfg = HAConfig(enabled=True, distributed_optimizer=True, replica_count=2, heartbeat_interval_s=0.1,
                   heartbeat_timeout_s=1.0, stop_timeout_s=2.0, action_timeout_s=10.0, save_dir="/save")
    d = decide(0.5, st, cfg)
    assert d.action is ActionKind.STOP_ALL, d
    st.record_fault(d.params["at"], d.params["rank"], FaultKind(d.params["kind"]), d.reason)
    st.set_phase(Phase.STOPPING, 0.5)
    for r in (0, 1, 3):
        ranks[r].stopped = True
    d = decide(0.6, st, cfg)
    if started:
        assert d.action in (ActionKind.VERIFY, ActionKind.DUMP), d
    else:
        assert d.action is ActionKind.EXIT and d.params["code"] == faults.EXIT_FAILED_BEFORE_TRAINING, d
        assert "before training started" in d.reason and "no complete data" not in d.reason, d.reason
