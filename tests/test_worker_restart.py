"""Worker restart in place (ARF, ``--enable-worker-reboot``) end to end: real megatron-core on 4 gloo
ranks through ``mindspeed-ha-run``.

One rank is SIGKILLed in iteration K (injector ``fault=kill``; one job per layout meets several
kills in turn, each restarted process rejoining before the next). Standard of proof, per kill: the
launcher restarts that process alone (the controller's report lists exactly one restart, of that
rank); the survivors keep their PIDs (the PIDs that registered at start-up are the ones that
finish iteration K after the recovery); the new process replays its start-up, rejoins the
survivors' new process-group generation and receives its parameters, optimizer shard, counters,
scheduler and RNG from a replica; every rank re-runs iteration K; after its group rebuild
every rank (the new one included) finds no object still holding a replaced group (the
reference's known misses: TP-DP / TP-CP groups, timers' barrier groups); the job exits 0 and
the per-iteration losses equal the uninterrupted run's bit for bit.

A kill inside the optimizer update (the survivors wait in its commit barrier, some finished
it) is rolled forward (plan mode ``forward`` with the restarted rank): the new process gets
the finished update from a replica that finished it and runs a catch-up step with the
survivors, 0 steps lost. Without a replica (``--distributed-optimizer-no-replica``) every
rank reloads the latest periodic checkpoint (mode ``reload``; the new process at its rejoin
point) and re-runs the iterations after it silently; no checkpoint yet: exit 76.
"""

import json
import os
import re

import pytest

from mindspeed_ha import faults
from mindspeed_ha.testing.harness import Baselines, four_rank_args, launch, launcher_command, read_jsonl, run_four

pytestmark = pytest.mark.timeout(600)

ITERS = 5
K = 3


def _args(layout, *extra):
    return four_rank_args(layout, ITERS, "--enable-worker-reboot", *extra)


_run = run_four


#: the uninterrupted TP1 PP2 run also saves every 2 iterations: its checkpoints are the ones
#: test_second_restart_and_checkpoints_equal_the_uninterrupted_run compares with (a save
#: changes no loss: that test compares the losses of runs with saves with these too)
SAVE_EVERY = ("--save-interval", "2")


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("baseline_ckpt"))

    def args(layout):
        return _args(layout, "--save", save, *SAVE_EVERY) if layout == "tp1pp2" else _args(layout)

    out = Baselines(args, ITERS)
    out.save = save  # TP1 PP2's checkpoints
    return out


def _baseline(baselines, layout):
    return baselines.get(layout)


def _first_pids(log: str):
    """rank -> the PID it first registered with (the controller's log line)."""
    out = {}
    for rank, pid in re.findall(r"rank (\d+) registered \(pid (\d+)", log):
        out.setdefault(int(rank), int(pid))
    return out


# One job per layout meets its kills in turn, one per iteration from 2 (each restarted
# process rejoins before the next kill): (killed rank, point). Rank 0, the PP-last rank, a TP
# peer, a DP rank of DP4 N=2; and SIGKILLs inside the optimizer update (roll forward with
# rejoin): rank 0 of TP1 PP2, a TP peer of TP2 PP1, a DP4 rank whose optimizer-instance peer
# is blocked inside its update
SCHEDULES = {"tp1pp2": [(0, "forward"), (3, "backward"), (0, "optimizer")],
             "tp2pp1": [(1, "forward"), (1, "optimizer")],
             "dp4": [(2, "backward"), (2, "optimizer")]}


@pytest.mark.parametrize("layout", sorted(SCHEDULES))
def test_killed_rank_restarts_alone_and_rejoins(tmp_path, baselines, layout):
    """Per kill in iteration k: a kill before the update: mode ``rejoin``, the state of k-1
    and every rank re-runs k. A kill inside the update of k (the survivors wait in its
    commit barrier, some finished it): mode ``forward``, the new process receives the
    finished state of k from a replica that finished it, runs a catch-up step k with the
    survivors (their rest of step k), and the job goes on with 0 steps lost. Each time only
    the killed rank changes process."""
    base = _baseline(baselines, layout)
    kills = {k: case for k, case in enumerate(SCHEDULES[layout], start=2)}
    born = {}  # rank -> times restarted so far: the spec of its next kill is for that process
    specs = []
    for k, (rank, point) in kills.items():
        specs.append(f"rank={rank},iteration={k},point={point},fault=kill,incarnation={born.get(rank, 0)}")
        born[rank] = born.get(rank, 0) + 1
    after, report = str(tmp_path / "after.jsonl"), str(tmp_path / "report.json")
    r = _run(_args(layout), env={"MINDSPEED_HA_INJECT": ";".join(specs), "MINDSPEED_HA_RECOVERY_LOG": after,
                                 "MINDSPEED_HA_REPORT": report, "MINDSPEED_HA_TESTING_CHECK_HOLDERS": "1"})
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-8000:]
    # every rank, each new process included, checked after each rebuild that no object still
    # holds a replaced group (TP-DP / TP-CP groups, DDP buckets, optimizer, timers' barrier group)
    assert len(re.findall(r"no holder of a replaced process group is left", log)) == 4 * len(kills), log[-8000:]
    rep = json.load(open(report))
    restarts, recs = rep["restarts"], rep.get("recoveries") or []
    assert len(restarts) == len(recs) == len(kills), (restarts, recs)
    pids = _first_pids(log)  # rank -> its current process
    records = read_jsonl(after)
    for (k, (rank, point)), restart, rec in zip(kills.items(), restarts, recs):
        case = f"iteration {k}: rank {rank} killed at {point}"
        assert restart["rank"] == rank, (case, restart)
        want = ("forward", k) if point == "optimizer" else ("rejoin", k - 1)
        assert (rec["mode"], rec["iteration"]) == want, (case, rec)
        done = {e["rank"]: e["pid"] for e in records if e["iteration"] == k}
        assert sorted(done) == [0, 1, 2, 3], (case, done)
        for survivor in set(range(4)) - {rank}:
            assert done[survivor] == pids[survivor], f"{case}: rank {survivor} changed process"
        assert done[rank] == restart["pid"] != pids[rank], case
        pids[rank] = restart["pid"]
        if point == "optimizer":
            assert f"rank {rank}: catch-up step {k}" in log, (case, log[-8000:])
    assert sorted(r.losses) == list(range(1, ITERS + 1))
    for it in sorted(base):
        assert r.losses[it] == base[it], \
            f"iteration {it}: {float.fromhex(r.losses[it])} != uninterrupted {float.fromhex(base[it])}"


def test_second_restart_and_checkpoints_equal_the_uninterrupted_run(tmp_path, baselines):
    """Two ranks killed in different iterations (the second rejoin happens after a first
    rebuild: every generation rendezvouses in the first generation's store, or the new
    process and the survivors never meet) with periodic saves: exit 0, two restarts, losses
    bitwise, and the checkpoints written after the restarts equal an uninterrupted run's key
    by key (the restarted process's rerun-state-machine count included)."""
    from mindspeed_ha.testing.compare import compare_checkpoint_dirs

    base = _baseline(baselines, "tp1pp2")  # saved every 2 iterations into baselines.save
    save, report = str(tmp_path / "ckpt"), str(tmp_path / "report.json")
    r = _run(_args("tp1pp2", "--save", save, *SAVE_EVERY),
             env={"MINDSPEED_HA_INJECT": "rank=0,iteration=2,point=forward,fault=kill;"
                                         "rank=2,iteration=4,point=backward,fault=kill",
                  "MINDSPEED_HA_REPORT": report})
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-8000:]
    rep = json.load(open(report))
    assert [(e["rank"], e["incarnation"]) for e in rep["restarts"]] == [(0, 1), (2, 1)], rep["restarts"]
    assert [rec["mode"] for rec in rep["recoveries"]] == ["rejoin", "rejoin"]
    assert r.losses == base
    for it in (2, 4):
        name = f"iter_{it:07d}"
        diffs = compare_checkpoint_dirs(os.path.join(save, name), os.path.join(baselines.save, name))
        assert not diffs, f"{name}:\n" + "\n".join(diffs[:20])


def test_restart_budget_spent_takes_the_dying_checkpoint_at_once(tmp_path):
    """--max-restarts 1 and rank 1 killed twice: the agent gives up on the second death and
    says so; the controller stops waiting for that rank (its exit report, which comes after,
    does not re-arm the wait) and the job takes the dying checkpoint well before the
    rejoin deadline (--ha-action-timeout, 600 s: this test's own limit is 300 s)."""
    save = str(tmp_path / "ckpt")
    args = _args("tp1pp2", "--save", save)
    r = launch(4, args, launcher=launcher_command(4) + ["--max-restarts", "1"], timeout_s=300,
               env={"MINDSPEED_HA_INJECT": "rank=1,iteration=2,point=forward,fault=kill;"
                                           "rank=1,iteration=4,point=forward,fault=kill,incarnation=1"})
    assert not r.timed_out, (r.stdout + r.stderr)[-6000:]
    log = r.stdout + r.stderr
    assert r.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, log[-8000:]
    assert "did not rejoin within" not in log
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == 3


@pytest.fixture(scope="module")
def no_replica_base(tmp_path_factory):
    """Losses of the uninterrupted no-replica run with periodic saves."""
    base = _run(_args("tp1pp2", "--distributed-optimizer-no-replica", "--save",
                      str(tmp_path_factory.mktemp("base")), "--save-interval", "2"))
    assert base.returncode == 0, base.stderr[-4000:]
    return base.losses


@pytest.mark.parametrize("point", ["backward", "optimizer"])
def test_no_replica_every_rank_reloads_the_periodic_checkpoint(tmp_path, no_replica_base, point):
    """--distributed-optimizer-no-replica: the killed rank's optimizer shard exists nowhere in
    memory. Rank 1 is SIGKILLed in iteration 4 after the periodic save of 2 (at backward, or
    inside the optimizer update: its DP peer, rank 0, waits for it in the parameter
    all-gather, its pre-update state gone): every survivor reloads checkpoint 2 in place,
    the restarted process loads it at its rejoin point (after the group rebuild, with them),
    everyone re-runs 3 silently, then 4; exit 0, one restart, the survivors keep their
    PIDs, and the losses equal an uninterrupted run's bit for bit (each iteration logged once)."""
    save = str(tmp_path / "ckpt")
    report, after = str(tmp_path / "report.json"), str(tmp_path / "after.jsonl")
    r = _run(_args("tp1pp2", "--distributed-optimizer-no-replica", "--save", save, "--save-interval", "2"),
             env={"MINDSPEED_HA_INJECT": f"rank=1,iteration=4,point={point},fault=kill",
                  "MINDSPEED_HA_REPORT": report, "MINDSPEED_HA_RECOVERY_LOG": after})
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-8000:]
    rep = json.load(open(report))
    assert [(e["rank"], e["incarnation"]) for e in rep["restarts"]] == [(1, 1)], rep["restarts"]
    assert [(rec["mode"], rec["iteration"]) for rec in rep["recoveries"]] == [("reload", 3)], rep["recoveries"]
    assert "rank 1: restarted: loaded the periodic checkpoint of iteration 2" in log, log[-8000:]
    assert len(re.findall(r"re-ran iterations 3\.\.3 after the reload", log)) == 4, log[-8000:]
    first = _first_pids(log)
    done = {e["rank"]: e["pid"] for e in read_jsonl(after)}
    assert sorted(done) == [0, 1, 2, 3] and {e["iteration"] for e in read_jsonl(after)} == {4}
    for survivor in (0, 2, 3):
        assert done[survivor] == first[survivor], f"rank {survivor} changed process"
    assert r.losses == no_replica_base and sorted(r.losses) == list(range(1, ITERS + 1))
    assert len(re.findall(r"iteration\s+3/", r.stdout)) == 1, "iteration 3 logged again by a re-run"


def test_no_replica_without_a_periodic_checkpoint_takes_the_dying_checkpoint(tmp_path):
    """No replica and no periodic checkpoint yet (kill in iteration 2, --save-interval 4):
    the ranks find no checkpoint before touching their state; the job ends as it did
    before worker restart without a replica (no hang, no wrong loss)."""
    save = str(tmp_path / "ckpt")
    r = _run(_args("tp1pp2", "--distributed-optimizer-no-replica", "--save", save, "--save-interval", "4"),
             env={"MINDSPEED_HA_INJECT": "rank=1,iteration=2,point=backward,fault=kill"})
    log = r.stdout + r.stderr
    assert r.returncode == faults.EXIT_NO_COMPLETE_DATA, log[-8000:]  # rank 1's shard is nowhere
    assert "no periodic checkpoint yet" in log, log[-8000:]


def test_no_replica_stock_megatron_lm_torch_dist(tmp_path, megatron_lm_tarball):
    """The same on Megatron-LM's own pretrain_gpt.py (its load_checkpoint, ``torch_dist``:
    a collective load, which the restarted process runs at its rejoin point with the
    survivors' loads in place): rank 1 SIGKILLed inside the optimizer update of 7 (its DP
    peer blocks in the parameter all-gather) after the save of 4; every rank loads 4, re-runs
    5 and 6 silently, then 7; exit 0, losses and grad norms bit for bit."""
    from mindspeed_ha.testing import megatron_lm as mlm

    root = mlm.unpack(megatron_lm_tarball, str(tmp_path / "megatron_lm"))

    def args(save):
        return mlm.stock_gpt_args(tp=1, pp=2, train_iters=8, ckpt_format="torch_dist",
                                  enable_high_availability=True, ha_controller_port=0, enable_worker_reboot=True,
                                  distributed_optimizer_no_replica=True, save=save, save_interval=4)

    base = mlm.launch_stock(root, args(str(tmp_path / "base_ckpt")))
    assert base.returncode == 0 and sorted(base.losses) == list(range(1, 9)), base.stderr[-4000:]
    report = str(tmp_path / "report.json")
    r = mlm.launch_stock(root, args(str(tmp_path / "ckpt")), env={
        "MINDSPEED_HA_INJECT": "rank=1,iteration=7,point=optimizer,fault=kill", "MINDSPEED_HA_REPORT": report})
    log = r.stdout + r.stderr
    assert not r.timed_out and r.returncode == 0, log[-8000:]
    rep = json.load(open(report))
    assert [(e["rank"], e["incarnation"]) for e in rep["restarts"]] == [(1, 1)], rep["restarts"]
    assert [(rec["mode"], rec["iteration"]) for rec in rep["recoveries"]] == [("reload", 6)], rep["recoveries"]
    assert "rank 1: restarted: loaded the periodic checkpoint of iteration 4" in log, log[-8000:]
    assert r.losses == base.losses
    assert r.grad_norms == base.grad_norms
