"""The command-line front end: patch listing and demo argument checks."""

import json
import subprocess
import sys


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
