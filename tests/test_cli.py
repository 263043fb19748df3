"""The command-line front end: patch listing, demo argument checks, the demo of a worker restart in place."""

import json
import subprocess
import sys

import pytest


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mindspeed_ha.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_patches_lists_every_patch_with_its_state():
    r = _cli("patches", "--json", "--import-megatron")
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["replica.grad_sync"]["status"] == "applied"
    assert rows["replica.grad_sync"]["active"] is False  # HA flags off: nothing active
    assert rows["ha.train_step.trainer"]["active"] is False
    assert rows["cpu.causal_mask"]["active"] is True  # no CUDA here: CPU backend on
    # Megatron-LM's own modules are not installed: those patches wait for their import.
    assert rows["ha.train_step.megatron"]["status"] == "pending import"


def test_demo_rejects_out_of_range_options():
    r = _cli("demo", "--kill-iteration", "50", "--train-iters", "10")
    assert r.returncode == 2 and "--kill-iteration" in r.stderr
    r = _cli("demo", "--kill-rank", "9")
    assert r.returncode == 2 and "--kill-rank" in r.stderr


def test_demo_reboot_needs_fault_kill():
    r = _cli("demo", "--fault", "uce", "--reboot")
    assert r.returncode == 2 and "--reboot" in r.stderr and "--fault kill" in r.stderr


@pytest.mark.timeout(300)
def test_demo_kill_reboot_restarts_the_rank_alone_and_reports_phases(tmp_path):
    """``demo --fault kill --reboot``: baseline + one faulty run (~35 s on 2 idle cores). The
    killed rank is the only one restarted, the survivors keep their PIDs, no dying
    checkpoint, losses bitwise, and every phase of the report is there in order."""
    report = tmp_path / "demo.json"
    r = subprocess.run([sys.executable, "-m", "mindspeed_ha.cli", "demo", "--fault", "kill", "--reboot",
                        "--train-iters", "4", "--kill-iteration", "2", "--kill-rank", "1",
                        "--report", str(report)], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    s = json.loads(report.read_text())
    assert s["restarted_ranks"] == [1] and s["restarts"] == 1
    assert s["recovered_in_process"] is True and s["survivor_pids_unchanged"] is True
    assert s["loss_match"] == "bitwise" and s["steps_lost"] == 0
    ps = s["phase_seconds"]
    assert list(ps) == ["detect", "restart_process", "rendezvous", "rebuild_groups", "repair", "rollback",
                        "first_iteration_after", "total"]
    assert all(v is not None and v >= 0 for v in ps.values()), ps
    # the stages run inside first_iteration_after, which ends the recovery
    assert ps["rebuild_groups"] <= ps["first_iteration_after"] <= ps["total"]
    assert "restarted ranks [1]" in r.stdout and "bitwise" in r.stdout
