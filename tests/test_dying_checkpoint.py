"""The dying checkpoint end to end: real megatron-core on 4 gloo ranks, a rank SIGKILLed.

Standard of proof, for every (killed rank, kill point) of the matrix: the job exits with
EXIT_DYING_CHECKPOINT_SAVED, every usable copy was verified and none was found corrupt
(healthy replicas agree bit for bit), the checkpoint holds every iteration completed before the
fault (no step lost), and it is bit for bit the checkpoint an uninterrupted run saves at
the same iteration (model, optimizer shards, scheduler, RNG). For one kill point per
target the job is also resumed with ``--load`` and the resumed per-iteration losses must
equal the uninterrupted run's bit for bit (same seed, dropout on). Two of the resumed runs
carry the next kill of the matrix (iteration ``KILL_AT + 2``): bitwise up to it, then its own
dying checkpoint held to the same standard (one job fewer per such pair).
"""

import os

import pytest

from mindspeed_ha import faults
from mindspeed_ha.testing.compare import compare_checkpoint_dirs
from mindspeed_ha.testing.harness import launch, launcher_command, tiny_gpt_args

ITERS = 6
KILL_AT = 3
THEN_AT = KILL_AT + 2  # the kill a resumed run carries (see NEXT)
LAYOUTS = {"pp2": (1, 2), "tp2": (2, 1)}  # (TP, PP) on 4 ranks -> DP 2, 2 optimizer replicas


def _launcher():
    return launcher_command(4)


def _args(layout, *extra):
    tp, pp = LAYOUTS[layout]
    return tiny_gpt_args(tp=tp, pp=pp, train_iters=ITERS) + [
        "--enable-high-availability", "--ha-controller-port", "0", *extra]


def _run(args, env=None):
    r = launch(4, args, launcher=_launcher(), env=env, timeout_s=240)
    assert not r.timed_out, r.stderr[-4000:]
    return r


def _tracker(save):
    path = os.path.join(save, "latest_checkpointed_iteration.txt")
    return int(open(path).read()) if os.path.exists(path) else None


class _Baselines(dict):
    """layout -> (losses, save) of the uninterrupted run saving a normal checkpoint at every
    iteration (the session's shared run, tests/conftest.py ``uninterrupted``: these flags and
    --save-interval 1), fetched on first use."""

    def __init__(self, uninterrupted):
        super().__init__()
        self.uninterrupted = uninterrupted

    def __missing__(self, layout):
        self[layout] = self.uninterrupted(*LAYOUTS[layout], ITERS)
        return self[layout]


@pytest.fixture(scope="module")
def baselines(uninterrupted):
    return _Baselines(uninterrupted)


# (name, layout, killed global rank). Rank order is Megatron's tp-dp-pp:
# PP2: stage 0 = ranks {0, 1}, stage 1 = {2, 3}; TP2: TP groups {0, 1}, {2, 3}.
TARGETS = [("pp_first", "pp2", 1), ("pp_last", "pp2", 3), ("rank0", "pp2", 0), ("tp_peer", "tp2", 1)]
POINTS = ["forward", "backward", "optimizer", "between"]


RESUMED = {("pp_first", "backward"), ("pp_last", "optimizer"), ("rank0", "between"), ("tp_peer", "forward")}
#: (target, point) pairs run: each target and each point at least once with a resume (RESUMED,
#: a Latin square), plus every target killed inside the optimizer update (the commit barrier,
#: where the holders' states differ most). The other 9 pairs of the 4 x 4 matrix repeated these
#: paths at ~10 s of CI each: the point decides the rank's state (a unit matter, test_policy),
#: the target decides the holders (test_replica, test_recovery_policy).
#: A resumed run that carries the next kill (in iteration THEN_AT, same layout): the resume is
#: proven bitwise up to it and by that kill's dying checkpoint, equal to the uninterrupted one.
NEXT = {("pp_last", "optimizer"): ("pp_first", "optimizer"), ("rank0", "between"): ("rank0", "optimizer")}
CASES = sorted(RESUMED | {(t[0], "optimizer") for t in TARGETS} - set(NEXT.values()))
_TARGET = {t[0]: t for t in TARGETS}


#: what a resumed process's checkpoints hold legitimately unlike the uninterrupted run's (besides
#: compare_checkpoint_dirs' default args and FLOP count): the rerun state machine's iteration
#: count, which megatron-core does not load while the machine is disabled (the default;
#: ``RerunStateMachine.load_state_dict``), so it counts from the process's start
RESUMED_IGNORE = ("args", "num_floating_point_operations_so_far", "current_iteration")


def _check_dying_checkpoint(run, save, baselines, layout, point, kill_at, resumed=False):
    """Exit 75, no step lost, no staging left, replicas verified, the losses before the kill and
    the dying checkpoint bit for bit the uninterrupted run's (``resumed``: but RESUMED_IGNORE):
    its iteration."""
    assert run.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, run.stderr[-6000:]
    k = _tracker(save)
    completed = kill_at if point == "between" else kill_at - 1
    assert k is not None and k >= completed, f"steps lost: checkpoint {k}, completed {completed}"
    assert k <= kill_at
    assert not [d for d in os.listdir(save) if d.startswith(".")], "staging left behind"
    log = run.stdout + run.stderr
    assert "integrity at iteration" in log and "CORRUPT" not in log, "replicas verified, none excluded"
    base_losses, base_save = baselines[layout]
    for it, loss in run.losses.items():
        assert loss == base_losses[it], \
            f"iteration {it} before the fault: {float.fromhex(loss)} != {float.fromhex(base_losses[it])}"
    name_k = f"iter_{k:07d}"
    diffs = compare_checkpoint_dirs(os.path.join(save, name_k), os.path.join(base_save, name_k),
                                    **({"ignore": RESUMED_IGNORE} if resumed else {}))
    assert not diffs, "dying checkpoint != uninterrupted checkpoint:\n" + "\n".join(diffs[:20])
    return k


@pytest.mark.parametrize("name,layout,rank,point", [(*_TARGET[n], p) for n, p in CASES],
                         ids=[f"{n}-{p}" for n, p in CASES])
def test_kill_rank_dying_checkpoint(tmp_path, baselines, name, layout, rank, point):
    save = str(tmp_path / "ckpt")
    inject = f"rank={rank},iteration={KILL_AT},point={point},fault=kill"
    faulty = _run(_args(layout, "--save", save), env={"MINDSPEED_HA_INJECT": inject})
    k = _check_dying_checkpoint(faulty, save, baselines, layout, point, KILL_AT)

    if (name, point) not in RESUMED:
        return
    base_losses = baselines[layout][0]
    nxt = NEXT.get((name, point))
    if nxt is None:
        resumed = _run(_args(layout, "--load", save, "--save", save))
        assert resumed.returncode == 0, resumed.stderr[-6000:]
        assert sorted(resumed.losses) == list(range(k + 1, ITERS + 1))
    else:  # the resumed run carries the next kill
        (_, nxt_layout, nxt_rank), nxt_point = _TARGET[nxt[0]], nxt[1]
        assert nxt_layout == layout
        resumed = _run(_args(layout, "--load", save, "--save", save),
                       env={"MINDSPEED_HA_INJECT": f"rank={nxt_rank},iteration={THEN_AT},point={nxt_point},fault=kill"})
        assert sorted(resumed.losses)[:THEN_AT - 1 - k] == list(range(k + 1, THEN_AT)), (k, resumed.losses)
        assert _check_dying_checkpoint(resumed, save, baselines, layout, nxt_point, THEN_AT, resumed=True) > k
    for it, loss in resumed.losses.items():
        assert loss == base_losses[it], \
            f"iteration {it}: resumed {float.fromhex(loss)} != {float.fromhex(base_losses[it])}"


def test_kill_at_grad_sync_detected_then_saved(tmp_path, baselines):
    """Also the recovery timeline's order: death -> evidence at the controller -> EXIT, from
    the injector's wall-clock kill time and the launcher's controller report."""
    import json

    save, report, kills = str(tmp_path / "ckpt"), str(tmp_path / "report.json"), str(tmp_path / "kills.jsonl")
    faulty = _run(_args("pp2", "--save", save), env={
        "MINDSPEED_HA_INJECT": f"rank=2,iteration={KILL_AT},point=grad_sync",
        "MINDSPEED_HA_REPORT": report, "MINDSPEED_HA_INJECT_LOG": kills})
    assert faulty.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, faulty.stderr[-6000:]
    assert _tracker(save) == KILL_AT - 1
    with open(report) as f:
        rep = json.load(f)
    with open(kills) as f:
        killed_at = json.loads(f.readline())["wall"]
    assert rep["fault_rank"] == 2 and rep["iteration"] == KILL_AT - 1
    # Orderings only (latencies belong in benchmarks): detected after the kill, exit after that.
    assert killed_at <= rep["fault_wall"] <= rep["exit_wall"], (killed_at, rep)


def test_saver_killed_during_dying_checkpoint_publishes_nothing(tmp_path):
    """Rank 1 dies; rank 0 (a chosen saver of stage 0) dies while saving: no complete copy of
    stage 0 remains, so nothing may become visible to a loader."""
    save = str(tmp_path / "ckpt")
    inject = f"rank=1,iteration={KILL_AT},point=backward;rank=0,iteration={KILL_AT - 1},point=dying"
    faulty = _run(_args("pp2", "--save", save), env={"MINDSPEED_HA_INJECT": inject})
    assert faulty.returncode not in (0, faults.EXIT_DYING_CHECKPOINT_SAVED), faulty.stderr[-4000:]
    assert _tracker(save) is None
    assert not [d for d in os.listdir(save) if d.startswith("iter_")] if os.path.isdir(save) else True


def test_no_replica_reports_no_complete_data(tmp_path):
    """--distributed-optimizer-no-replica: the dead rank's optimizer shard exists nowhere else."""
    save = str(tmp_path / "ckpt")
    faulty = _run(_args("pp2", "--save", save, "--distributed-optimizer-no-replica"),
                  env={"MINDSPEED_HA_INJECT": f"rank=1,iteration={KILL_AT},point=backward"})
    assert faulty.returncode == faults.EXIT_NO_COMPLETE_DATA, faulty.stderr[-4000:]
    assert _tracker(save) is None
    assert "no complete data" in (faulty.stdout + faulty.stderr).lower()


def test_plain_torchrun_rank0_killed(tmp_path, baselines):
    """No launcher: rank 0 spawned the controller (detached) and then dies; torchrun
    SIGTERMs the survivors, which defer it until the dying checkpoint is written. The
    controller must not outlive the job."""
    import socket

    import psutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    save = str(tmp_path / "ckpt")
    tp, pp = LAYOUTS["pp2"]
    args = tiny_gpt_args(tp=tp, pp=pp, train_iters=ITERS) + [
        "--enable-high-availability", "--ha-controller-port", str(port), "--save", save]
    faulty = launch(4, args, env={"MINDSPEED_HA_INJECT": f"rank=0,iteration={KILL_AT},point=backward"},
                    timeout_s=240)
    assert not faulty.timed_out
    assert faulty.returncode != 0
    assert _tracker(save) == KILL_AT - 1, faulty.stderr[-6000:]
    name_k = f"iter_{KILL_AT - 1:07d}"
    assert not compare_checkpoint_dirs(os.path.join(save, name_k), os.path.join(baselines["pp2"][1], name_k))
    controllers = [p for p in psutil.process_iter(["cmdline"])
                   if "mindspeed_ha.control.controller" in " ".join(p.info["cmdline"] or [])
                   and str(port) in (p.info["cmdline"] or [])]
    gone, alive = psutil.wait_procs(controllers, timeout=30)
    for p in alive:
        p.kill()
    assert not alive, "the controller outlived the job"


def _staged_checkpoint(save, iteration):
    """A complete staged dying checkpoint (one rank, TP1 PP1) under ``save``."""
    import argparse

    import torch

    from mindspeed_ha.checkpoint import dying, staging

    staging.create(save, iteration)
    d = os.path.join(dying.staging_root(save, iteration), f"iter_{iteration:07d}", "mp_rank_00")
    os.makedirs(d)
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              use_distributed_optimizer=False, no_save_optim=False)
    torch.save({"args": args, "iteration": iteration}, os.path.join(d, "model_optim_rng.pt"))
    os.makedirs(os.path.join(dying.staging_root(save, iteration), "shards"))


def test_commit_failure_publishes_nothing_and_discard_cleans_up(tmp_path, monkeypatch):
    """Disk full while writing the tracker, after the rename: the checkpoint goes back to
    the staging dir (a loader never sees it), the tracker is untouched; it validated, so
    the exit handler of a rank that took part keeps it (the publish command is logged:
    tests/test_checkpoint_leftovers.py). A staging dir that never validated is removed."""
    import errno

    from mindspeed_ha.checkpoint import dying, staging
    from mindspeed_ha.integrations import megatron_lm
    from mindspeed_ha.runtime import HARuntime

    save = str(tmp_path)
    megatron_lm.write_tracker(save, 2)
    _staged_checkpoint(save, 4)

    def disk_full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(megatron_lm, "write_tracker", disk_full)
    with pytest.raises(OSError, match="space"):
        dying.commit(save, 4)
    assert _tracker(save) == 2
    assert sorted(os.listdir(save)) == [".mindspeed_ha_dying_iter_0000004", "latest_checkpointed_iteration.txt"]

    exits = []
    monkeypatch.setattr("mindspeed_ha.control.processor.default_exit_handler", lambda c, r: exits.append(c))
    rt = HARuntime(config=None, args=__import__("argparse").Namespace(save=save))
    rt._on_exit(faults.EXIT_FAULT_UNRECOVERABLE, "commit failed")  # never took part: nothing to do
    assert os.path.isdir(dying.staging_root(save, 4))
    rt.staged = 4
    rt._on_exit(faults.EXIT_FAULT_UNRECOVERABLE, "commit failed")
    assert staging.is_validated(dying.staging_root(save, 4)), "a validated checkpoint is kept"
    os.remove(os.path.join(dying.staging_root(save, 4), staging.VALIDATED_FILE))  # as if it never validated
    monkeypatch.setenv(dying.ENV_KEEP_FAILED_STAGING, "1")
    rt._on_exit(faults.EXIT_FAULT_UNRECOVERABLE, "commit failed")
    assert os.path.isdir(dying.staging_root(save, 4)), "kept on request"
    monkeypatch.delenv(dying.ENV_KEEP_FAILED_STAGING)
    rt._on_exit(faults.EXIT_FAULT_UNRECOVERABLE, "commit failed")
    assert os.listdir(save) == ["latest_checkpointed_iteration.txt"] and _tracker(save) == 2
    assert exits == [faults.EXIT_FAULT_UNRECOVERABLE] * 4


def test_failed_save_leaves_no_staging_dir(tmp_path):
    """Rank 1 dies; saver rank 0 fails writing its part (an exception, as a full disk
    raises) while the stage-1 saver writes its files: the job ends with 77, no staging
    dir, no iter_ dir, no tracker."""
    save = str(tmp_path / "ckpt")
    inject = f"rank=1,iteration={KILL_AT},point=backward;rank=0,iteration={KILL_AT - 1},point=dying,fault=raise"
    faulty = _run(_args("pp2", "--save", save), env={"MINDSPEED_HA_INJECT": inject})
    assert faulty.returncode == faults.EXIT_FAULT_UNRECOVERABLE, faulty.stderr[-6000:]
    assert "dumping failed on rank 0" in faulty.stderr
    assert os.listdir(save) == [], f"left behind: {os.listdir(save)}"
