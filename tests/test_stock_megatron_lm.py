"""Megatron-LM's own pretrain_gpt.py (core_v0.12.1, unmodified) on 4 CPU/gloo ranks.

The tree is unpacked from ../shared/third_party into a temporary directory and run as
users run it, through ``mindspeed-ha-run``; its file hashes are compared before and after
the whole module (nothing of ours ever writes into it).

Standard of proof for each fault: the launcher exits 75, the dying checkpoint holds the
last completed iteration (0 steps lost) in the run's ``--ckpt-format``, Megatron-LM's own
``--load`` resumes from it, and every per-iteration loss (exact, from the
``testing.loss_log`` patch) and grad norm equals the uninterrupted run's bit for bit, dropout on.
"""

import glob
import json
import os
import shutil

import pytest

from mindspeed_ha import faults
from mindspeed_ha.testing import megatron_lm as mlm
from mindspeed_ha.testing.harness import read_patch_reports

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERS = 8
KILL_AT = 6
LAYOUTS = {"pp2": (1, 2), "tp2": (2, 1)}  # (TP, PP) on 4 ranks: DP 2, 2 optimizer replicas

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def tree(tmp_path_factory, megatron_lm_tarball):
    root = mlm.unpack(megatron_lm_tarball, str(tmp_path_factory.mktemp("megatron_lm")))
    return {"root": root, "digest": mlm.tree_digest(root)}


@pytest.fixture(scope="module")
def real_data(tree, tmp_path_factory, corpus_text_file):
    """A real indexed dataset, made by the stock tools/preprocess_data.py."""
    return mlm.build_indexed_dataset(tree["root"], corpus_text_file, str(tmp_path_factory.mktemp("indexed")))


def _args(layout, fmt="torch", data=None, ha=True, iters=ITERS, **overrides):
    tp, pp = LAYOUTS[layout]
    extra = dict(data or {})
    if ha:
        overrides.update(enable_high_availability=True, ha_controller_port=0)
    return mlm.stock_gpt_args(tp=tp, pp=pp, train_iters=iters, ckpt_format=fmt, **extra, **overrides)


def _run(tree, args, env=None):
    r = mlm.launch_stock(tree["root"], args, env=env)
    assert not r.timed_out, r.stderr[-4000:]
    return r




#: Megatron-LM's own periodic checkpoint in each baseline (HA off), in that layout's format:
#: the regular-save test resumes from the one of iteration SAVE_AT
SAVE_AT = 4
BASE_FORMAT = {"pp2": "torch_dist", "tp2": "torch"}


@pytest.fixture(scope="module")
def baselines(tree, real_data, tmp_path_factory):
    """Uninterrupted runs, every HA flag off (the launcher and the package still in place):
    TP1 PP2 on the real dataset (every PP2 test of the module but the fp16 one runs on it), TP2
    on mock data. Each also writes Megatron-LM's own periodic checkpoints (``--save-interval
    SAVE_AT``, its format in BASE_FORMAT): one job per layout for both (CI time)."""
    out = {}
    for layout, data in (("pp2", real_data), ("tp2", None)):
        tmp = tmp_path_factory.mktemp(f"baseline_{layout}")
        report, save = str(tmp / "patches"), str(tmp / "ckpt")
        args = _args(layout, BASE_FORMAT[layout], data, ha=False, save=save, save_interval=SAVE_AT)
        r = _run(tree, args, env={"MINDSPEED_HA_PATCH_REPORT": report})
        assert r.returncode == 0, r.stderr[-4000:]
        assert sorted(r.losses) == list(range(1, ITERS + 1))
        assert sorted(r.grad_norms) == list(range(1, ITERS + 1))
        out[layout] = {"losses": r.losses, "grad_norms": r.grad_norms, "report": read_patch_reports(report),
                       "save": save}
    return out


def test_flags_off_no_ha_patch_active(baselines):
    """HA off: no HA patch active, no runtime (so no processor, no controller port). That HA
    on without a fault gives the flags-off losses bit for bit: ``test_recovered_in_place``
    (HA on as users run it; no fault before its iteration KILL_AT - 2, bitwise equal after
    each recovery too) and every faulty job of the module before its first fault."""
    off = baselines["pp2"]["report"]
    assert sorted(off) == [0, 1, 2, 3]
    for rank, row in off.items():
        assert not row["runtime"], rank
        assert not [p for p in row["active"] if not p.startswith(("cpu.", "fix.", "compat.", "arguments.", "testing."))], row
        assert not set(row["features"]) & {"ha", "replica", "hbm_repair", "worker_reboot"}, row


#: (name, layout, data, kills): each kill is (format, killed rank, iteration) of one job, the
#: next job resumes from its dying checkpoint with Megatron-LM's own --load (which reads either
#: format), the last dying checkpoint is resumed to ITERS. Megatron's rank order is tp-dp-pp:
#: PP2: stage 0 = ranks {0, 1}, stage 1 (PP-last) = {2, 3}; TP2 (PP1): every rank is PP-last.
#: Each format with rank 0 killed and torch_dist with the PP-last rank killed on the real
#: dataset, TP2 once (torch_dist): the built-in trainer's matrix (test_dying_checkpoint) covers
#: the other layout x rank pairs.
CHAINS = [
    ("pp2_real_torch_rank0_then_dist_pplast", "pp2", "real", [("torch", 0, KILL_AT - 2), ("torch_dist", 2, KILL_AT)]),
    ("tp2_dist_rank3", "tp2", None, [("torch_dist", 3, KILL_AT)]),
]


@pytest.mark.parametrize("layout,data,kills", [c[1:] for c in CHAINS], ids=[c[0] for c in CHAINS])
def test_kill_dying_checkpoint_resume(tree, baselines, real_data, tmp_path, layout, data, kills):
    data_args = real_data if data == "real" else None
    base, base_gn = baselines[layout]["losses"], baselines[layout]["grad_norms"]
    save = str(tmp_path / "ckpt")
    first = 1
    for fmt, rank, kill_at in kills:
        args = _args(layout, fmt, data_args, save=save, load=save, save_interval=1000)
        r = _run(tree, args, env={"MINDSPEED_HA_INJECT": f"rank={rank},iteration={kill_at},point=backward"})
        assert r.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, (fmt, rank, r.stderr[-6000:])
        with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
            assert int(f.read()) == kill_at - 1  # every completed iteration kept: 0 steps lost
        it_dir = os.path.join(save, f"iter_{kill_at - 1:07d}")
        if fmt == "torch_dist":
            assert os.path.exists(os.path.join(it_dir, "metadata.json")), os.listdir(it_dir)
        else:
            assert glob.glob(os.path.join(it_dir, "mp_rank_*", "model_optim_rng.pt")), os.listdir(it_dir)
        assert not [n for n in os.listdir(save) if n.startswith(".")], os.listdir(save)  # no staging left
        assert min(r.losses) == first, (fmt, rank, sorted(r.losses))  # resumed from the one before
        for k in range(first, kill_at):
            assert (r.losses[k], r.grad_norms[k]) == (base[k], base_gn[k]), (fmt, rank, k)
        first = kill_at

    resumed = _run(tree, args)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert sorted(resumed.losses) == list(range(first, ITERS + 1))
    for k in range(first, ITERS + 1):
        assert (resumed.losses[k], resumed.grad_norms[k]) == (base[k], base_gn[k]), k


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_regular_save_resumes_bitwise_and_the_subtle_patches_are_needed(tree, baselines, real_data, tmp_path, fmt):
    """Megatron-LM's own periodic save (the baseline's of SAVE_AT: torch on TP2, torch_dist on
    PP2) and --load, HA off: the resumed losses equal the uninterrupted run's. Resumed with
    one patch disabled (torch_dist), they do not: ``cpu.dataloader_rng`` (iterator creation
    consumes the dropout generator) and ``fix.dist_opt_param_groups_by_key`` (weight decay on
    the wrong params)."""
    layout = next(k for k, v in BASE_FORMAT.items() if v == fmt)
    data = real_data if layout == "pp2" else None
    baseline = baselines[layout]
    base = {k: (baseline["losses"][k], baseline["grad_norms"][k]) for k in range(1, ITERS + 1)}
    # the load directory as Megatron-LM leaves it after a run that stopped at SAVE_AT: its
    # periodic checkpoint of SAVE_AT (copied) and the tracker naming it
    load = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(baseline["save"], f"iter_{SAVE_AT:07d}"), os.path.join(load, f"iter_{SAVE_AT:07d}"))
    with open(os.path.join(load, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(SAVE_AT))
    # cpu.dataloader_rng does not depend on the format: shown needed once, with torch_dist
    needed = ["cpu.dataloader_rng", "fix.dist_opt_param_groups_by_key"] if fmt == "torch_dist" else []
    for disabled in [None] + needed:
        out = str(tmp_path / f"resumed_{disabled}")
        env = {"MINDSPEED_HA_DISABLE_PATCHES": disabled} if disabled else None
        r = _run(tree, _args(layout, fmt, data, ha=False, load=load, save=out, save_interval=1000), env=env)
        assert r.returncode == 0, r.stderr[-4000:]
        assert sorted(r.losses) == list(range(SAVE_AT + 1, ITERS + 1)), (disabled, sorted(r.losses))
        resumed = {k: (r.losses[k], r.grad_norms[k]) for k in range(SAVE_AT + 1, ITERS + 1)}
        if disabled is None:
            assert resumed == {k: base[k] for k in range(SAVE_AT + 1, ITERS + 1)}
        else:
            assert resumed != {k: base[k] for k in range(SAVE_AT + 1, ITERS + 1)}, disabled


#: CPU-backend patches of megatron/training and what breaks without each (the dataset-helper
#: and fused-kernel patches are proven by the tree-hash test: without them Megatron builds
#: inside the tree; cpu.dataloader_rng by the resume test above), with the world size where
#: it breaks: one rank for all but the dependency build (a 1-rank job trains without it)
NEEDED_AT_START = [("cpu.mlm_initialize", 1), ("cpu.mlm_init_distributed", 1), ("cpu.torch_device_count", 1),
                   ("cpu.mlm_set_random_seed", 1), ("cpu.torch_set_device", 1), ("cpu.mlm_pretrain", 1),
                   ("cpu.mlm_compile_dependencies", 4)]


@pytest.mark.parametrize("patch,nproc", [("none", 1)] + NEEDED_AT_START, ids=["none"] + [p for p, _ in NEEDED_AT_START])
def test_each_cpu_training_patch_is_needed(tree, patch, nproc):
    """Without the patch, stock pretrain_gpt.py cannot train two iterations on CPU (control:
    with every patch it does, with the same arguments; on 4 ranks every other test of this
    module shows it)."""
    layout = {1: dict(tp=1, pp=1), 4: dict(tp=1, pp=2)}[nproc]
    args = mlm.stock_gpt_args(train_iters=2, ckpt_format="torch", lr_warmup_iters=0, **layout)
    r = mlm.launch_stock(tree["root"], args, nproc=nproc,
                         env={"MINDSPEED_HA_DISABLE_PATCHES": "" if patch == "none" else patch})  # unknown names are refused
    assert not r.timed_out, r.stderr[-4000:]
    if patch == "none":
        assert r.returncode == 0 and 2 in r.losses, r.stderr[-4000:]
    else:
        assert r.returncode != 0 and 2 not in r.losses, (patch, r.losses)


def test_nccl_on_cpu_is_refused_naming_the_flag(tree):
    r = _run(tree, _args("pp2", ha=False, iters=2, lr_warmup_iters=0, distributed_backend="nccl"))
    assert r.returncode != 0
    assert "--distributed-backend nccl" in r.stderr + r.stdout


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_llama2_tiny_example_survives_a_kill(tree, tmp_path):
    """scripts/pretrain_llama2_7b_ptd.sh (TINY=1: the llama2 architecture at CPU size, with
    replicas and worker reboot) survives a SIGKILL of a PP-last rank in the running job; the
    losses equal the uninterrupted run's bit for bit."""
    import subprocess
    import sys

    script = os.path.join(REPO, "scripts", "pretrain_llama2_7b_ptd.sh")

    def run(ckpt, inject=None):
        loss_log = str(tmp_path / f"loss_{os.path.basename(ckpt)}")
        env = dict(os.environ, **mlm.stock_env(), TINY="1", NO_REPLICA="0", MEGATRON_LM=tree["root"],
                   CKPT_DIR=ckpt, LOG_DIR=str(tmp_path / "logs"), MASTER_PORT=str(_free_port()),
                   LAUNCHER=f"{sys.executable} -m mindspeed_ha.launcher --standalone",
                   MINDSPEED_HA_LOSS_LOG=loss_log)
        if inject:
            env["MINDSPEED_HA_INJECT"] = inject
        proc = subprocess.run(["bash", script, "--ha-controller-port", "0"], env=env, cwd=str(tmp_path),
                              capture_output=True, text=True, timeout=600, start_new_session=True)
        from mindspeed_ha.testing.harness import read_rank_loss_logs

        records = read_rank_loss_logs(loss_log)[0]
        losses = {r["iteration"]: (r["loss"]["lm loss"], r["grad_norm"]) for r in records if r["loss"]}
        for stale in glob.glob(glob.escape(loss_log) + ".rank*"):
            os.remove(stale)
        return proc, losses

    base, base_losses = run(str(tmp_path / "base"))
    assert base.returncode == 0, base.stdout[-4000:]
    assert sorted(base_losses) == list(range(1, 11))
    ckpt = str(tmp_path / "ckpt")
    # the example runs with --enable-worker-reboot and --load = --save, with a periodic save
    # before the kill: the killed rank is restarted alone and rejoins, the job goes on (before
    # the start-up load was one recorded entry: RejoinMismatch, 3 restarts, exit 75)
    faulty, faulty_losses = run(ckpt, inject=f"rank=3,iteration={KILL_AT},point=backward")
    out = faulty.stdout + faulty.stderr
    assert faulty.returncode == 0, out[-4000:]
    assert "load_checkpoint is not run in a restarted process" in out, out[-4000:]
    assert faulty_losses == base_losses


#: One job meets three faults, one per iteration (each hits a job that already recovered from
#: the ones before): (iteration, rank, spec).
IN_PLACE = [
    (KILL_AT - 2, 3, "point=forward,fault=uce,what=param"),  # UCE on the PP-last stage, before the update
    (KILL_AT - 1, 1, "point=grad_sync,fault=network"),  # a failed link inside DDP's gradient all-reduce
    # inside the optimizer update (roll forward): Megatron-LM's train_step goes on after it with
    # its own frame (its model-parallel all-reduces of update_successful / grad norm included)
    (KILL_AT, 1, "point=optimizer,fault=uce,what=exp_avg"),
]


def test_recovered_in_place(tree, baselines, real_data, tmp_path, as_users_run):
    """UCE (memory really damaged, repaired from the replica; before or inside the optimizer
    update) and a network error inside a real collective, on the stock script, one after the
    other in one job: the job finishes in the same processes (exit 0, each faulty rank's PID
    unchanged, every rank re-ran or finished each faulty iteration after its recovery) and
    every loss and grad norm equals the uninterrupted run's (every HA flag off) bit for bit.
    The job runs as users run it (workers started by torchrun, nvidia-modelopt visible), HA
    on: the HA patches and runtime active on every rank; its iterations before the first
    fault are HA on without a fault (the flags-off baselines ran with both on)."""
    fired, after, report = str(tmp_path / "fired.jsonl"), str(tmp_path / "after.jsonl"), str(tmp_path / "patches")
    args = _args("pp2", data=real_data, enable_hbmfault_repair=True)
    spec = ";".join(f"rank={rank},iteration={k},{what}" for k, rank, what in IN_PLACE)
    r = _run(tree, args, env={"MINDSPEED_HA_INJECT": spec, "MINDSPEED_HA_INJECT_LOG": fired,
                              "MINDSPEED_HA_RECOVERY_LOG": after, "MINDSPEED_HA_PATCH_REPORT": report})
    assert r.returncode == 0, (r.stdout + r.stderr)[-8000:]
    on = read_patch_reports(report)
    assert sorted(on) == [0, 1, 2, 3], on
    assert all(row["runtime"] and "ha.train_step.megatron" in row["active"] for row in on.values()), on
    assert all("replica" in row["features"] for row in on.values()), on
    with open(fired) as f:
        shot = [json.loads(line) for line in f]
    with open(after) as f:
        again = [json.loads(line) for line in f]
    assert [(e["iteration"], e["rank"]) for e in shot] == [(k, rank) for k, rank, _ in IN_PLACE], shot
    for e in shot:
        at_k = [a for a in again if a["iteration"] == e["iteration"]]
        assert sorted(a["rank"] for a in at_k) == [0, 1, 2, 3], (e, again)
        assert {a["pid"] for a in at_k if a["rank"] == e["rank"]} == {e["pid"]}, (e, again)
    assert len(again) == 4 * len(IN_PLACE), again
    base = baselines["pp2"]
    assert r.losses == base["losses"]
    assert r.grad_norms == base["grad_norms"]


#: --fp16 with a loss scale that moves every few steps (2^20 overflows, backs off after
#: --hysteresis 2, grows every 2 clean steps): iterations 1-3, 6 and 7 overflow (skipped), the
#: scale grows at 5; after 6 the grad scaler's hysteresis tracker is 1, not a fresh scaler's 2
FP16 = dict(fp16=True, initial_loss_scale=2 ** 20, loss_scale_window=2)
FP16_KILL_AT = 7


@pytest.fixture(scope="module")
def fp16_baseline(tree):
    """The uninterrupted --fp16 run (HA flags off), made only for the test that needs it."""
    r = _run(tree, _args("pp2", ha=False, **FP16))
    assert r.returncode == 0, r.stderr[-4000:]
    assert sorted(r.losses) == list(range(1, ITERS + 1))
    return {"losses": r.losses, "grad_norms": r.grad_norms}


#: (id, fault schedule: (rank, iteration, point, incarnation) killed, fp16)
ARF_CASES = [
    ("backward-then-optimizer", ((3, KILL_AT, "backward", 0), (3, KILL_AT + 1, "optimizer", 1)), False),
    ("backward-fp16", ((3, FP16_KILL_AT, "backward", 0),), True),
]


@pytest.mark.parametrize("kills,fp16", [c[1:] for c in ARF_CASES], ids=[c[0] for c in ARF_CASES])
def test_worker_restart_rejoins(tree, tmp_path, request, kills, fp16):
    """ARF on the stock script (--enable-worker-reboot): rank 3 (PP-last) SIGKILLed; the
    launcher restarts it alone, its start-up is replayed (the stock start-up's collectives,
    the embedding all-reduce included), it rejoins and receives its state from a replica;
    exit 0, the other PIDs unchanged, losses and grad norms bitwise equal.
    ``backward-then-optimizer``: killed at backward of KILL_AT, then its restarted process
    killed inside the update of KILL_AT + 1 (roll forward with rejoin): the second new
    process catches up that step in the stock train_step and train() (the model-parallel
    all-reduces after optimizer.step(), training_log: rank 3 prints the log line of the step,
    its loss and grad norm those of the holder). This job runs as the example scripts and most
    users do: ``--load`` = ``--save`` (``torch_dist``) with a periodic checkpoint of 4 written
    before the kills: a restarted process's start-up does not load it (the survivors'
    start-up found none), or its collectives would differ from the record
    (``RejoinMismatch``, 3 restarts, exit 76).
    ``backward-fp16``: --fp16 with a moving loss scale, killed in iteration 7: the new process
    also receives the grad scaler's Python-int trackers (without them it backs off its scale a
    step after its peers: the grad norm of 8 differs)."""
    after, report = str(tmp_path / "after.jsonl"), str(tmp_path / "report.json")
    ckpt = str(tmp_path / "ckpt")
    periodic = {} if fp16 else dict(fmt="torch_dist", save=ckpt, load=ckpt, save_interval=4)
    data = None if fp16 else request.getfixturevalue("real_data")  # the data of the baseline compared with
    args = _args("pp2", data=data, enable_worker_reboot=True, **(FP16 if fp16 else {}), **periodic)
    spec = ";".join(f"rank={rank},iteration={k},point={point},fault=kill,incarnation={n}" for rank, k, point, n in kills)
    r = _run(tree, args, env={"MINDSPEED_HA_INJECT": spec, "MINDSPEED_HA_RECOVERY_LOG": after,
                              "MINDSPEED_HA_REPORT": report})
    assert r.returncode == 0, (r.stdout + r.stderr)[-8000:]
    with open(report) as f:
        rep = json.load(f)
    assert [(e["rank"], e["incarnation"]) for e in rep["restarts"]] == [(rank, n + 1) for rank, _, _, n in kills]
    assert [rec["mode"] for rec in rep["recoveries"]] == [
        "forward" if point == "optimizer" else "rejoin" for _, _, point, _ in kills]
    with open(after) as f:
        again = [json.loads(line) for line in f]
    assert sorted((e["iteration"], e["rank"]) for e in again) == sorted(
        (k, rank) for _, k, _, _ in kills for rank in range(4)), again
    for (rank, k, _, _), restart in zip(kills, rep["restarts"]):
        assert {e["pid"] for e in again if e["rank"] == rank and e["iteration"] == k} == {restart["pid"]}
    base = request.getfixturevalue("fp16_baseline") if fp16 else request.getfixturevalue("baselines")["pp2"]
    assert r.losses == base["losses"]
    assert r.grad_norms == base["grad_norms"]
    if periodic:
        assert "load_checkpoint is not run in a restarted process" in r.stdout + r.stderr
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
            assert int(f.read()) == ITERS


def test_zz_megatron_lm_tree_unchanged(tree):
    """Runs last in this module: not one file of the user's Megatron-LM tree was written."""
    assert mlm.tree_digest(tree["root"]) == tree["digest"]
