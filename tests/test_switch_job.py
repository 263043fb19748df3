"""Hot switch on a real 4-rank job (the built-in trainer, ``mindspeed-ha-run``, gloo, TP1 PP1 DP4,
``--enable-worker-reboot``, ``MINDSPEED_HA_WARM_SPARES=1``, ``--distributed-optimizer-no-replica``:
each optimizer shard exists on its own rank only, so the new process's state can come from
nowhere but the outgoing process; with replicas the path is the same), one job meeting a schedule of
switches through the operator channel (mindspeed_ha/testing/switch_job.py), each at a fixed
iteration (:data:`HELD`: rank 0 holds after it, ``fault=hold``, while the new processes start,
released once the job is pausing for the switch), so that the job can end at :data:`END`
whatever the machine's load:

1. ``switch --ranks 1``: the new process starts, replays the start-up and parks; the job
   pauses at K, every group is rebuilt with it in rank 1's place,
   rank 1's old process hands over its own state (no replica involved) and exits 0;
2. ``switch --ranks 0``: the same for rank 0 (the loss-logging rank: its losses after K come
   from the new process);
3. ``switch --ranks 2`` whose new process is SIGKILLed before the commit point: abandoned
   (code 1, the reason), training goes on on the old ranks;
4. ``switch --node HOST`` (the job's one host): all four ranks move in one switch (one
   pause, every group rebuilt once with four new processes, each old one hands over its own
   state): the warm spare starts one new process, the three others start cold.

The job ends with exit 0 (``--exit-interval``); after each switch only the switched ranks' PIDs
changed, to their new processes'; the per-iteration losses and grad norms are bitwise equal to an
uninterrupted run of the same seed.

A second job, with the default distributed optimizer (2 replica instances) and the
sub-health detector on (``--ha-subhealth``, 2 s windows, 3 of them to flag, action
``switch``), meets four switches:

1. the detector's own: rank 3's first process holds after iteration 1 until the driver sees
   a warm spare parked (so that the detector cannot flag before a spare exists), then sleeps
   0.5 s per iteration more than the others; the detector flags it and the controller
   switches it to the spare by itself (no operator request; its new process starts while
   training goes on, until rank 3's first process holds after :data:`DETECTOR_HOLD`, released
   once the job is pausing for the switch); rank 3's new process is not
   slowed more than the others (the flag clears); the driver takes the metrics once that
   switch is done;
2. ``switch --ranks 1`` whose outgoing process is SIGKILLed in the middle of its handoff
   (the injector's ``point=handoff``: its parameters and optimizer shard sent, its progress
   not), after every group was rebuilt with its new process: the replica fallback repairs
   the new process from rank 3, the holder of rank 1's shard (code 0, ``fallback`` {1: 3},
   SwitchFallback; without it: the dying checkpoint, exit 75);
3. ``switch --ranks 0`` (the operator's, with replicas);
4. ``switch --node HOST`` (the operator's, all four ranks, with replicas).

Every process but the last four (those of the whole-node switch) sleeps :data:`PACE` s in
each forward (the injector's ``fault=slow`` per incarnation, the same for all, so nobody is
slower than its peers): rank 0's own logging stays a small part of a step (at full pace,
0.04 s steps at load 20, it made rank 0 1.36x
its peers for 3 windows: the detector flagged rank 0 and switched it by itself, an extra
Subhealth event); the whole node's new processes sleep :data:`PACE_AFTER` s, enough for
that. The operator's three switches come at fixed iterations (:data:`DETECTOR_HELD`: rank 0
holds after each while the new processes start, released once the job is pausing for the
switch: the detector scores no window while the job pauses, and a window without progress
has no value; the window a hold begins in rightly finds rank 0 degraded: the holds are far enough
apart for healthy windows between), and the
last hold keeps the job until the driver saw training after the whole node's switch. The job
ends at :data:`END_DETECTOR` (``--exit-interval``). Exit 0, after each
switch only the switched ranks' PIDs changed, the Subhealth / Switch* events and the metrics
record them, and the losses of 1..END_DETECTOR are bitwise those of the same uninterrupted run
(replicas or none: the same numbers, tests/test_replica_equivalence.py), which both jobs share
(ended at the later of the two ends).
"""

import pytest

from mindspeed_ha.testing import switch_job
from mindspeed_ha.testing.harness import read_loss_log

pytestmark = pytest.mark.timeout(900)
NO_REPLICA = ["--distributed-optimizer-no-replica"]
#: the first job: entry -> the iteration rank 0 holds after for it (``fault=hold``, in each of its
#: incarnations); the pause comes after the next iteration, two more follow: 3 apart. END_HOLD:
#: the job held until the driver saw training after the last switch; it ends at END
HELD = {"1": 2, "0": 5, "kill:2": 8, "node": 11}
END_HOLD = 14
END = END_HOLD + 1
#: the seconds a new process may take to be READY (``--ha-connect-timeout``): the whole node's
#: three cold starts took over the default 60 s at load 60-85 (the job holds meanwhile)
CONNECT_TIMEOUT = ["--ha-connect-timeout", "180"]
#: the detector's job: see the module doc. Incarnations: rank 3's first process (0) is switched
#: by the detector (1), rank 1's by the operator with the replica fallback (1), rank 0's by the
#: operator (1), then the whole node (ranks 0, 1 and 3: 2, rank 2: 1)
PACE, PACE_AFTER = 0.3, 0.1
#: rank 3's first process holds after DETECTOR_HOLD, if still there, until the job is pausing for
#: its switch: the detector flagged it after iteration 8 at load 40-60 (about 1 s per iteration)
DETECTOR_HOLD = 20
#: the operator's switches in the detector's job, at the iteration rank 0 holds after; then the
#: last hold; the job ends at END_DETECTOR (``--exit-interval``). 15 apart: rank 0 is rightly
#: degraded in the window its hold begins in, and 3 such windows without a healthy one between
#: (3 apart, at load 40-50) flagged it; rank 3's new process needs 3 healthy windows to be cleared
DETECTOR_HELD = {"1": 35, "0": 50, "node": 65}
DETECTOR_END_HOLD = 80
END_DETECTOR = DETECTOR_END_HOLD + 1
PACED = {(0, 0): PACE, (1, 0): PACE, (2, 0): PACE, (3, 0): PACE, (3, 1): PACE, (1, 1): PACE, (0, 1): PACE,
         (0, 2): PACE_AFTER, (1, 2): PACE_AFTER, (2, 1): PACE_AFTER, (3, 2): PACE_AFTER}
DETECTOR_INJECT = ";".join(("rank=3,iteration=1,point=between,fault=hold",
                            "rank=3,iteration=1,point=between,fault=slow,sleep=0.5",
                            f"rank=3,iteration={DETECTOR_HOLD},point=between,fault=hold",
                            # the replica fallback: rank 1's first process dies in its (first) handoff
                            "rank=1,iteration=1,point=handoff,fault=kill",
                            switch_job.holds(0, [*DETECTOR_HELD.values(), DETECTOR_END_HOLD]),
                            *(f"rank={r},iteration=1,point=forward,fault=slow,sleep={s},incarnation={n}"
                              for (r, n), s in PACED.items())))
DETECTOR_WINDOWS = 3
#: 2 s windows: a few iterations each at load 40 (1 s windows held about one there: rank 1, not
#: slowed, was 1.57x its peers for 3 of them and flagged); the whole node's three cold starts
#: took over the default 60 s to be READY at load 60-85 (the job trains on meanwhile)
DETECTOR_ARGS = ["--ha-subhealth", "--ha-subhealth-window", "2.0", "--ha-subhealth-windows", str(DETECTOR_WINDOWS),
                 "--ha-subhealth-action", "switch", "--ha-metrics-port", "0", "--ha-connect-timeout", "180"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The uninterrupted run both jobs are compared with (one per module: ``--dist loadfile``),
    to the later of their ends (the same schedule of ``switch_job.TRAIN_ITERS``)."""
    last = max(END, END_DETECTOR)
    base = switch_job.baseline(str(tmp_path_factory.mktemp("baseline")),
                               extra_args=[*NO_REPLICA, "--exit-interval", str(last)])
    assert base.returncode == 0, base.stderr[-4000:]
    norms = {int(r["iteration"]): r["grad_norm"] for r in read_loss_log(base.loss_log_path)}
    assert sorted(base.losses) == list(range(1, last + 1)) and len(norms) == last
    return base.losses, norms


def _changed(before, after):
    return [r for r, (a, b) in enumerate(zip(before, after)) if a != b]


def test_switch_rank_1_then_rank_0_then_a_spare_killed_before_the_commit_point_then_the_whole_node(tmp_path,
                                                                                                  baseline):
    run = switch_job.run(str(tmp_path), [f"{e}@{k}" for e, k in HELD.items()],
                         extra_args=[*NO_REPLICA, *CONNECT_TIMEOUT, "--exit-interval", str(END)],
                         env={"MINDSPEED_HA_INJECT": switch_job.holds(0, [*HELD.values(), END_HOLD])})
    assert run.returncode == 0, run.output[-6000:]
    first, second, third, node = run.replies
    for done in (first, second, node):
        assert done["code"] == 0 and done["result"]["phase"] == "done", done
        seconds = done["result"]["phase_seconds"]
        assert {"spare_ready", "pause", "rebuild", "transfer", "pause_window"} <= set(seconds), seconds
    assert third["code"] == 1 and "before the commit point" in third["detail"], third
    assert node["result"]["ranks"] == [0, 1, 2, 3], node
    before = run.pids_before
    for (entry, moved), after in zip(((first, [1]), (second, [0]), (third, []), (node, [0, 1, 2, 3])),
                                     run.pids_each):
        changed = [r for r, (a, b) in enumerate(zip(before, after)) if a != b]
        assert changed == moved, (entry["entry"], before, after)
        assert all(after[r] == int(entry["result"]["spares"][str(r)]) for r in moved), (entry, after)
        before = after
    assert run.pids_after == run.pids_each[-1]
    assert "switched out with exit 0" in run.output and "restarted alone as pid" not in run.output
    switch_events = [e["type"] for e in run.events if e["type"].startswith("Switch")]
    assert switch_events == ["SwitchRequested", "SwitchReady", "SwitchFinished"] * 2 + \
        ["SwitchRequested", "SwitchAborted"] + ["SwitchRequested", "SwitchReady", "SwitchFinished"], switch_events
    finished = [e for e in run.events if e["type"] == "SwitchFinished"]
    assert [e["ranks"] for e in finished] == [[1], [0], [0, 1, 2, 3]]
    assert all("pause_window" in e["phase_seconds"] for e in finished)
    print("phase seconds", [e["phase_seconds"] for e in finished])
    assert not [e for e in run.events if e["type"] in ("WorkerRestarted", "FaultDetected", "RecoveryStarted")]

    assert not [e for e in run.events if e["type"].startswith("Subhealth")]  # the detector is off here
    assert sorted(run.losses) == list(range(1, END + 1))  # the baseline's schedule, ended by --exit-interval
    assert run.losses == {k: baseline[0][k] for k in range(1, END + 1)}
    assert run.grad_norms == {k: baseline[1][k] for k in range(1, END + 1)}


def test_the_detector_switches_a_slowed_rank_then_rank_1_with_the_replica_fallback_then_rank_0_then_the_node(
        tmp_path, baseline):
    schedule = [f"detector:3@{DETECTOR_HOLD}", *(f"{e}@{k}" for e, k in DETECTOR_HELD.items())]
    run = switch_job.run(str(tmp_path), schedule,
                         extra_args=[*DETECTOR_ARGS, "--exit-interval", str(END_DETECTOR)],
                         env={"MINDSPEED_HA_INJECT": DETECTOR_INJECT})
    assert run.returncode == 0, run.output[-6000:]
    assert len(run.replies) == len(run.pids_each) == 4, run.replies
    before = run.pids_before
    for done, moved, after in zip(run.replies, ([3], [1], [0], [0, 1, 2, 3]), run.pids_each):
        assert done["code"] == 0 and done["result"]["phase"] == "done" and done["result"]["ranks"] == moved, done
        # the fallback's new process is repaired from a replica holder, not by the outgoing's transfer
        need = {"rebuild", "pause_window"} | ({"fallback", "repair"} if moved == [1] else {"spare_ready", "pause",
                                                                                         "transfer"})
        assert need <= set(done["result"]["phase_seconds"]), done
        assert _changed(before, after) == moved, (done["entry"], before, after)
        assert all(after[r] == int(done["result"]["spares"][str(r)]) for r in moved), (done, after)
        before = after
    assert run.pids_after == run.pids_each[-1]
    assert "switched out with exit 0" in run.output and "restarted alone as pid" not in run.output

    sub = [e for e in run.events if e["type"].startswith("Subhealth")]
    flagged = sub[0]["detail"]
    assert sub[0]["type"] == "Subhealth" and sub[0]["ranks"] == [3] and flagged["signal"] == "step", sub
    assert flagged["windows"] == DETECTOR_WINDOWS and flagged["action"] == "switch", flagged
    assert "under way" in flagged["outcome"] or flagged["outcome"].startswith("code 0"), flagged
    # rank 3's new process is not slowed more than its peers: the flag clears; nothing else is flagged
    assert [(e["type"], e["ranks"]) for e in sub] == [("Subhealth", [3]), ("SubhealthCleared", [3])], sub
    switch_events = [e for e in run.events if e["type"].startswith("Switch")]
    assert [e["type"] for e in switch_events] == ["SwitchRequested", "SwitchReady", "SwitchFinished"] + [
        "SwitchRequested", "SwitchReady", "SwitchFallback", "SwitchFinished"] + [
        "SwitchRequested", "SwitchReady", "SwitchFinished"] * 2, switch_events
    by_detector, by_operator = switch_events[0], [switch_events[3], switch_events[7], switch_events[10]]
    assert by_detector["detail"]["request_id"].startswith("internal-"), by_detector
    assert by_detector["reason"].startswith("sub-health: rank 3: step"), by_detector
    assert [e["reason"] for e in by_operator] == ["operator"] * 3, by_operator
    finished = [e for e in switch_events if e["type"] == "SwitchFinished"]
    assert [e["ranks"] for e in finished] == [[3], [1], [0], [0, 1, 2, 3]]
    print("detector: flagged after", flagged["windows"], "windows; phase seconds (detector, rank 1 by the fallback, "
          "rank 0, node)", [e["phase_seconds"] for e in finished])
    # the replica fallback: rank 1's outgoing process died in its handoff, rank 3 repaired its new one
    fallback = run.replies[1]
    assert fallback["result"]["fallback"] == {"1": 3} and "the replica fallback" in fallback["detail"], fallback
    assert {"pause_window", "fallback", "rebuild", "repair"} <= set(fallback["result"]["phase_seconds"]), fallback
    assert switch_events[5]["detail"]["sources"] == {"1": 3}, switch_events
    assert "switched out with exit -9" in run.output and "injector: kill rank 1 at handoff" in run.output
    assert not [e for e in run.events if e["type"] in ("WorkerRestarted", "FaultDetected", "RecoveryStarted")]
    # the metrics, taken once the detector's switch was done (training going on)
    m = run.metrics
    assert m[("mindspeed_ha_subhealth_flagged_total", (("signal", "step"),))] == 1, m
    assert m[("mindspeed_ha_switches_total", (("outcome", "done"),))] == 1, m
    assert m[("mindspeed_ha_events_total", (("type", "Subhealth"),))] == 1, m

    assert sorted(run.losses) == list(range(1, END_DETECTOR + 1))  # ended by --exit-interval
    assert run.losses == {k: baseline[0][k] for k in range(1, END_DETECTOR + 1)}
    assert run.grad_norms == {k: baseline[1][k] for k in range(1, END_DETECTOR + 1)}
