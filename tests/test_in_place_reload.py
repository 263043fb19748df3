"""In-place reload without replicas: real megatron-core on 4 gloo ranks, no process restart.

TP1 PP2 DP2 with the distributed optimizer and ``--distributed-optimizer-no-replica``: each
optimizer shard has one copy, so a UCE (the injector overwrites a parameter, then raises
CUDA's "uncorrectable ECC error") cannot be repaired from a replica. With a periodic
checkpoint of iteration C on disk and the fault in iteration K > C+1 (in its forward, or
inside its optimizer update), every rank reloads C in place, re-runs C+1 .. K-1 silently,
then K. Standard of proof: exit 0, the faulty rank kept its PID, the per-iteration losses
equal the uninterrupted run's bit for bit, each iteration logged once; the same on
Megatron-LM's own pretrain_gpt.py with the ``torch_dist`` format (grad norms too).
Without a periodic checkpoint yet, the reload is refused before any state is touched and
the job ends as the dying-checkpoint path does without replicas (76, no complete data),
writing nothing.
"""

import json
import os

import pytest

from mindspeed_ha import faults
from mindspeed_ha.testing.harness import launch, launcher_command, read_jsonl, tiny_gpt_args

ITERS = 8
SAVE_INTERVAL = 4
K = 7  # the fault: forward of iteration K on rank 1 (C = 4 saved, 5 and 6 re-run silently)


def _args(save):
    return tiny_gpt_args(tp=1, pp=2, train_iters=ITERS) + [
        "--enable-high-availability", "--enable-hbmfault-repair", "--distributed-optimizer-no-replica",
        "--ha-controller-port", "0", "--save", save, "--save-interval", str(SAVE_INTERVAL)]


def _run(args, env=None):
    r = launch(4, args, launcher=launcher_command(4), env=env, timeout_s=240)
    assert not r.timed_out, (r.stdout + r.stderr)[-6000:]
    return r




def _faulty(tmp_path, k, point="forward", what="param"):
    fired, after, report = (str(tmp_path / n) for n in ("fired.jsonl", "after.jsonl", "report.json"))
    env = {"MINDSPEED_HA_INJECT": f"rank=1,iteration={k},point={point},fault=uce,what={what}",
           "MINDSPEED_HA_INJECT_LOG": fired, "MINDSPEED_HA_RECOVERY_LOG": after, "MINDSPEED_HA_REPORT": report}
    save = str(tmp_path / "ckpt")
    r = _run(_args(save), env=env)
    rep = json.load(open(report)) if os.path.exists(report) else {}
    return r, read_jsonl(fired), read_jsonl(after), rep, save


@pytest.fixture(scope="module")
def baseline(uninterrupted):
    """Losses of the uninterrupted TP1 PP2 run (the session's shared one, tests/conftest.py:
    with optimizer replicas, which train bit for bit like none)."""
    return uninterrupted(1, 2, ITERS, save=False)[0]


# (point, what): before the optimizer update of K (plan from the end of K-1), and inside it
# (every rank stopped inside the update of K: the reload also covers a roll forward without a source)
CASES = [("forward", "param"), ("optimizer", "exp_avg")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("point,what", CASES, ids=[c[0] for c in CASES])
def test_reload_in_place_matches_the_uninterrupted_run(tmp_path, baseline, point, what):
    r, fired, after, rep, _ = _faulty(tmp_path, K, point, what)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-8000:]
    assert len(fired) == 1 and fired[0]["rank"] == 1, fired
    recs = rep.get("recoveries") or []
    assert len(recs) == 1 and recs[0].get("mode") == "reload" and recs[0]["iteration"] == K - 1, rep
    assert f"reloaded the periodic checkpoint of iteration {SAVE_INTERVAL} in place" in log, log[-8000:]
    assert log.count(f"re-ran iterations {SAVE_INTERVAL + 1}..{K - 1} after the reload") == 4, log[-8000:]
    # every rank re-ran iteration K in the process that was running; the faulty one kept its PID
    assert sorted(e["rank"] for e in after) == [0, 1, 2, 3] and {e["iteration"] for e in after} == {K}, after
    assert {e["pid"] for e in after if e["rank"] == 1} == {fired[0]["pid"]}
    # each iteration logged once (the silent re-runs log nothing), losses bit for bit
    assert sorted(rec["iteration"] for rec in r.records()) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
        assert r.losses[it] == baseline[it], \
            f"iteration {it}: {float.fromhex(r.losses[it])} != uninterrupted {float.fromhex(baseline[it])}"


@pytest.mark.timeout(300)
def test_no_periodic_checkpoint_yet_falls_back(tmp_path):
    """Fault in iteration 3, the first save would be at 4: the reload is refused before
    touching any state; without replicas the dying checkpoint has no complete data (76)
    and nothing is written to --save."""
    r, fired, _, rep, save = _faulty(tmp_path, 3)
    log = r.stdout + r.stderr
    assert r.returncode == faults.EXIT_NO_COMPLETE_DATA, log[-8000:]
    assert len(fired) == 1, fired
    assert "no periodic checkpoint yet" in log, log[-8000:]
    assert not os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt"))
    assert (os.listdir(save) if os.path.isdir(save) else []) == []


@pytest.mark.timeout(600)
def test_stock_megatron_lm_torch_dist_reload(tmp_path, megatron_lm_tarball):
    """The same on Megatron-LM's own pretrain_gpt.py (its load_checkpoint, ``torch_dist``
    format): every loss and grad norm bit for bit, the faulty rank's PID unchanged."""
    from mindspeed_ha.testing import megatron_lm as mlm

    root = mlm.unpack(megatron_lm_tarball, str(tmp_path / "megatron_lm"))

    def args(save):
        return mlm.stock_gpt_args(tp=1, pp=2, train_iters=ITERS, ckpt_format="torch_dist",
                                  enable_high_availability=True, ha_controller_port=0, enable_hbmfault_repair=True,
                                  distributed_optimizer_no_replica=True, save=save, save_interval=SAVE_INTERVAL)

    base = mlm.launch_stock(root, args(str(tmp_path / "base_ckpt")))
    assert base.returncode == 0 and sorted(base.losses) == list(range(1, ITERS + 1)), base.stderr[-4000:]
    fired, after = str(tmp_path / "fired.jsonl"), str(tmp_path / "after.jsonl")
    r = mlm.launch_stock(root, args(str(tmp_path / "ckpt")), env={
        "MINDSPEED_HA_INJECT": f"rank=1,iteration={K},point=forward,fault=uce,what=param",
        "MINDSPEED_HA_INJECT_LOG": fired, "MINDSPEED_HA_RECOVERY_LOG": after})
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-8000:]
    assert log.count(f"reloaded the periodic checkpoint of iteration {SAVE_INTERVAL} in place") == 4, log[-8000:]
    shot, again = read_jsonl(fired), read_jsonl(after)
    assert len(shot) == 1 and {e["iteration"] for e in again} == {K}, (shot, again)
    assert {e["pid"] for e in again if e["rank"] == 1} == {shot[0]["pid"]}
    assert r.losses == base.losses
    assert r.grad_norms == base.grad_norms


def test_replay_iterator_keeps_the_items_since_the_last_save():
    """Keep mode, in one process: marks record where iterations end, a save forgets the
    items up to it, ``rewind_to`` serves the items after a kept iteration again, and the
    one-step ``rewind`` of a rollback still serves only the step in progress."""
    from mindspeed_ha.recovery.rollback import ReplayIterator

    r = ReplayIterator(iter(range(100)))
    r.keep_since(0)
    for it in range(1, 6):  # two items per iteration
        next(r), next(r)
        r.mark(it)
    assert r.recorded == 10
    assert r.forget_through(2) == 4 and r.recorded == 6 and not r.can_rewind_to(1)
    assert next(r) == 10  # iteration 6 starts, then is aborted
    assert r.rewind() == 1 and next(r) == 10
    assert r.rewind_to(2) == 7
    assert [next(r) for _ in range(8)] == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError):
        r.rewind_to(1)
    plain = ReplayIterator(iter(range(10)))  # keep mode off: one step, as before
    next(plain), next(plain)
    plain.mark(1)
    assert plain.recorded == 0 and not plain.can_rewind_to(1) and plain.forget_through(1) == 0
