"""In-place recovery end to end: real megatron-core on 4 gloo ranks, no process restart.

A UCE (the injector really overwrites the chosen tensor, then raises CUDA's
"uncorrectable ECC error" text) or a network error (gloo's "Connection reset by peer"
raised on one rank inside a real collective while its peers are blocked in it) hits one
rank in iteration K. Standard of proof, per case: the job exits 0 with every iteration
done, the faulty rank kept its PID (the injector's log and the recovery log name the same
process; the launcher restarts nothing), every rank re-ran iteration K after the
recovery, and the per-iteration losses equal the uninterrupted run's bit for bit (same
seed, dropout on). The same run with the repair skipped (testing knob) gives different
losses: the damage is real and the repair is what undoes it.
"""

import json
import os

import pytest

from mindspeed_ha import faults
from mindspeed_ha.testing.harness import Baselines, four_rank_args, read_jsonl, run_four

ITERS = 5
K = 3


def _args(layout, *extra):
    return four_rank_args(layout, ITERS, "--enable-hbmfault-repair", *extra)


_run = run_four


@pytest.fixture(scope="module")
def baselines():
    return Baselines(_args, ITERS)


def _baseline(baselines, layout):
    return baselines.get(layout)


def _faulty(tmp_path, layout, spec, extra_env=None):
    fired, after, report = (str(tmp_path / n) for n in ("fired.jsonl", "after.jsonl", "report.json"))
    env = {"MINDSPEED_HA_INJECT": spec, "MINDSPEED_HA_INJECT_LOG": fired, "MINDSPEED_HA_RECOVERY_LOG": after,
           "MINDSPEED_HA_REPORT": report, **(extra_env or {})}
    r = _run(_args(layout), env=env)
    rep = json.load(open(report)) if os.path.exists(report) else {}
    return r, read_jsonl(fired), read_jsonl(after), rep


# (layout, rank, point, fault, what, iteration)
CASES = [
    ("tp1pp2", 0, "forward", "uce", "param", K),
    ("tp1pp2", 3, "backward", "uce", "exp_avg", K),
    ("tp2pp1", 1, "backward", "uce", "main_param", K),
    ("dp4", 2, "forward", "uce", "param", K),
    # inside the optimizer update: the other ranks finished it and wait in the commit
    # barrier; the faulty rank receives the finished update and the step goes on (roll forward)
    ("tp1pp2", 1, "optimizer", "uce", "exp_avg", K),
    ("tp1pp2", 3, "optimizer", "uce", "main_param", K),
    ("tp2pp1", 1, "optimizer", "uce", "exp_avg_sq", K),
    # DP4 N=2: rank 1, rank 0's optimizer-instance peer, is stuck in the parameter all-gather
    # (its update cannot finish): both receive the finished update from the other instance
    ("dp4", 0, "optimizer", "uce", "exp_avg", K),
    ("tp1pp2", 1, "grad_sync", "network", "", K),
    ("tp1pp2", 2, "pp", "network", "", K),
    ("tp2pp1", 0, "tp", "network", "", K),
    # found by a new user: early in iteration 2, TP peers still finishing update 1 (the freeze
    # kept them from it; then a rank stopped at the step's entry re-ran with the old RNG)
    ("tp2pp1", 3, "tp", "network", "", 2),
]


@pytest.mark.parametrize("layout,rank,point,fault,what,k", CASES,
                         ids=[f"{c[0]}-{c[3]}-{c[2]}-rank{c[1]}-it{c[5]}" for c in CASES])
def test_recovered_in_place(tmp_path, baselines, layout, rank, point, fault, what, k):
    base = _baseline(baselines, layout)
    spec = f"rank={rank},iteration={k},point={point},fault={fault}" + (f",what={what}" if what else "")
    r, fired, after, rep = _faulty(tmp_path, layout, spec)
    assert r.returncode == 0, (r.stdout + r.stderr)[-8000:]
    assert len(fired) == 1 and fired[0]["rank"] == rank, fired
    recs = rep.get("recoveries") or []
    forward = point == "optimizer"
    assert len(recs) == 1 and recs[0]["iteration"] == (k if forward else k - 1), rep
    assert recs[0]["kind"] == fault and recs[0].get("mode") == ("forward" if forward else "rollback"), recs[0]
    if fault == "uce" and layout == "dp4" and forward:
        assert [int(d) for d, _ in recs[0]["repairs"]] == [0, 1], recs[0]
    elif fault == "uce":
        assert [int(d) for d, _ in recs[0]["repairs"]] == [rank], recs[0]
    # every rank re-ran (or, forward, finished) iteration K in the same process; the faulty
    # rank is the process that faulted
    assert sorted(e["rank"] for e in after) == [0, 1, 2, 3] and {e["iteration"] for e in after} == {k}
    assert {e["pid"] for e in after if e["rank"] == rank} == {fired[0]["pid"]}
    assert sorted(r.losses) == list(range(1, ITERS + 1))
    for it in sorted(base):
        assert r.losses[it] == base[it], \
            f"iteration {it}: {float.fromhex(r.losses[it])} != uninterrupted {float.fromhex(base[it])}"


def test_skipping_the_repair_changes_the_losses(tmp_path, baselines):
    """The UCE damage is real: recovering without the repair (testing knob) trains on garbage."""
    base = _baseline(baselines, "tp1pp2")
    r, fired, after, rep = _faulty(tmp_path, "tp1pp2", f"rank=0,iteration={K},point=forward,fault=uce,what=param",
                                   extra_env={"MINDSPEED_HA_TESTING_SKIP_REPAIR": "1"})
    assert fired and (rep.get("recoveries") or []), (r.stdout + r.stderr)[-4000:]
    later = [it for it in range(K, ITERS + 1) if it in r.losses]
    assert any(r.losses[it] != base[it] for it in later), "same losses without the repair: the damage was not real"


def test_fault_during_recovery_falls_back_to_the_dying_checkpoint(tmp_path):
    """A network fault starts a recovery; rank 2 fails inside it (after the clean-up, before
    the rebuild). Nothing loops: the controller takes the dying-checkpoint path, which the
    processor threads write while the other training threads wait in the rebuild."""
    save = str(tmp_path / "ckpt")
    spec = (f"rank=1,iteration={K},point=grad_sync,fault=network;"
            f"rank=2,iteration={K},point=recover,fault=raise")
    r = _run(_args("tp1pp2", "--save", save), env={"MINDSPEED_HA_INJECT": spec})
    log = r.stdout + r.stderr
    assert r.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, log[-6000:]
    assert "rank 2 failed to recover" in log or "reported a fault during recovery" in log, log[-6000:]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == K - 1
