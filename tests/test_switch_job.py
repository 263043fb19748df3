"""Hot switch on a real 4-rank job (the built-in trainer, ``mindspeed-ha-run``, gloo, TP1 PP1 DP4,
``--enable-worker-reboot``, ``MINDSPEED_HA_WARM_SPARES=1``, ``--distributed-optimizer-no-replica``:
each optimizer shard exists on its own rank only, so the new process's state can come from
nowhere but the outgoing process; with replicas the path is the same), one job meeting a schedule of
switches through the operator channel (mindspeed_ha/testing/switch_job.py):

1. ``switch --ranks 1``: the new process starts while training goes on, replays the
   start-up and parks; the job pauses at K, every group is rebuilt with it in rank 1's place,
   rank 1's old process hands over its own state (no replica involved) and exits 0;
2. ``switch --ranks 0``: the same for rank 0 (the loss-logging rank: its losses after K come
   from the new process);
3. ``switch --ranks 2`` whose new process is SIGKILLed before the commit point: abandoned
   (code 1, the reason), training goes on on the old ranks.

The job ends with exit 0; only ranks 1 and 0 changed PIDs; the per-iteration losses and grad
norms are bitwise equal to an uninterrupted run of the same seed.
"""

import pytest

from mindspeed_ha.testing import switch_job
from mindspeed_ha.testing.harness import read_loss_log

pytestmark = pytest.mark.timeout(900)
NO_REPLICA = ["--distributed-optimizer-no-replica"]


def test_switch_rank_1_then_rank_0_then_a_spare_killed_before_the_commit_point(tmp_path):
    run = switch_job.run(str(tmp_path), ["1", "0", "kill:2"], extra_args=NO_REPLICA)
    assert run.returncode == 0, run.output[-6000:]
    first, second, third = run.replies
    assert first["code"] == 0 and first["result"]["phase"] == "done", first
    assert second["code"] == 0 and second["result"]["phase"] == "done", second
    assert third["code"] == 1 and "before the commit point" in third["detail"], third
    for done in (first, second):
        seconds = done["result"]["phase_seconds"]
        assert {"spare_ready", "pause", "rebuild", "transfer", "pause_window"} <= set(seconds), seconds
    changed = [r for r, (a, b) in enumerate(zip(run.pids_before, run.pids_after)) if a != b]
    assert changed == [0, 1], (run.pids_before, run.pids_after)
    assert run.pids_after[1] == int(first["result"]["spares"]["1"])
    assert run.pids_after[0] == int(second["result"]["spares"]["0"])
    assert "switched out with exit 0" in run.output and "restarted alone as pid" not in run.output
    switch_events = [e["type"] for e in run.events if e["type"].startswith("Switch")]
    assert switch_events == ["SwitchRequested", "SwitchReady", "SwitchFinished"] * 2 + \
        ["SwitchRequested", "SwitchAborted"], switch_events
    finished = [e for e in run.events if e["type"] == "SwitchFinished"]
    assert [e["ranks"] for e in finished] == [[1], [0]] and all("pause_window" in e["phase_seconds"] for e in finished)
    assert not [e for e in run.events if e["type"] in ("WorkerRestarted", "FaultDetected", "RecoveryStarted")]

    base = switch_job.baseline(str(tmp_path), extra_args=NO_REPLICA)
    assert base.returncode == 0, base.stderr[-4000:]
    assert sorted(run.losses) == list(range(1, switch_job.TRAIN_ITERS + 1))
    assert run.losses == base.losses
    base_norms = {int(r["iteration"]): r["grad_norm"] for r in read_loss_log(base.loss_log_path)}
    assert run.grad_norms == base_norms and len(base_norms) == switch_job.TRAIN_ITERS
