"""Pure policy: dying-checkpoint selection and decide() with a chosen `now`."""

import dataclasses

import pytest

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.policy import (ActionKind, DumpPlan, NoCompleteData, agree_pause, decide,
                                         plan_without_controller, select_dying_checkpoint)
from mindspeed_ha.control.state import ClusterState, Layout, OptimizerStatus, PendingAction, Phase, RankInfo
from mindspeed_ha.faults import (EXIT_CONTROLLER_LOST, EXIT_DYING_CHECKPOINT_SAVED, EXIT_FAULT_UNRECOVERABLE,
                                 EXIT_NO_COMPLETE_DATA, FaultKind)

U, UP = OptimizerStatus.UPDATED, OptimizerStatus.UPDATING


def cluster(tp, pp, dp, n, it=5, distributed=True):
    """RankInfos in Megatron order (tp fastest, then dp, then pp); all stopped, UPDATED at `it`."""
    ranks = {}
    per = dp // n if distributed else 1
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                r = t + tp * (d + dp * p)
                lay = Layout(tp_rank=t, pp_rank=p, dp_rank=d, tp_size=tp, pp_size=pp, dp_size=dp,
                             replica_count=n if distributed else dp,
                             instance_id=d // per if distributed else d, shard_id=d % per if distributed else 0)
                ranks[r] = RankInfo(rank=r, layout=lay, stopped=True, status=U, iteration=it, last_heartbeat=0.0)
    return ranks


def kill(ranks, *rs):
    for r in rs:
        ranks[r].alive = False
        ranks[r].dead_reason = "killed"
    return ranks


def check_plan(plan, ranks):
    assert isinstance(plan, DumpPlan), plan
    for key, r in plan.shard_savers.items():
        info = ranks[r]
        assert info.alive and info.status is U and info.iteration == plan.iteration
        assert info.layout.shard_key == key
    for (t, p), r in plan.model_savers.items():
        assert r == plan.shard_savers[(t, p, 0)]
    assert plan.committer in plan.shard_savers.values()
    return plan


# --------------------------------------------------------------------------- selection table
# (name, (tp, pp, dp, n), ranks killed, expected: iteration or "none")
CASES = [
    ("kill PP-first rank", (1, 2, 4, 2), [0], 5),
    ("kill PP-last rank", (1, 2, 4, 2), [7], 5),
    ("kill a TP peer", (2, 2, 2, 2), [1], 5),
    ("kill rank 0 (tp2 pp2 dp2)", (2, 2, 2, 2), [0], 5),
    ("kill one rank of each instance, different shards", (1, 1, 4, 2), [0, 3], 5),
    ("two failures in one shard", (1, 2, 4, 2), [0, 2], "none"),
    ("N=1 no replica, one rank dies", (1, 2, 4, 1), [5], "none"),
    ("nothing dead", (2, 2, 4, 2), [], 5),
]


@pytest.mark.parametrize("name,shape,killed,expect", CASES, ids=[c[0] for c in CASES])
def test_select_table(name, shape, killed, expect):
    ranks = kill(cluster(*shape), *killed)
    choice = select_dying_checkpoint(ranks)
    if expect == "none":
        assert isinstance(choice, NoCompleteData)
        assert "shard (tp=" in choice.reason
    else:
        plan = check_plan(choice, ranks)
        assert plan.iteration == expect
        assert not set(killed) & set(plan.savers())
        tp, pp, dp, n = shape
        assert len(plan.shard_savers) == tp * pp * (dp // n)
        assert len(plan.model_savers) == len(plan.assemblers) == tp * pp


def test_prefers_one_instance_and_is_deterministic():
    ranks = kill(cluster(1, 2, 4, 2), 0)  # instance 0 of pp0 lost shard 0
    plan = check_plan(select_dying_checkpoint(ranks), ranks)
    assert {ranks[r].layout.instance_id for r in plan.shard_savers.values()} == {1}
    assert len(set(plan.shard_savers.values())) == len(plan.shard_savers)  # one shard per rank
    assert select_dying_checkpoint(ranks) == plan
    assert plan.assemblers[(0, 0)] != plan.model_savers[(0, 0)]  # load spread when >1 shard
    assert DumpPlan.from_params(plan.to_params("/s")) == plan


def test_kill_inside_update_holder_is_dirty():
    ranks = kill(cluster(1, 1, 4, 2), 0)
    ranks[2].status, ranks[2].iteration = UP, 6  # the other holder of shard 0 is mid-update
    choice = select_dying_checkpoint(ranks)
    assert isinstance(choice, NoCompleteData)
    assert "shard=0" in choice.reason and "rank 2 updating@6" in choice.reason and "rank 0 dead" in choice.reason


def test_highest_common_iteration_wins():
    ranks = cluster(1, 1, 4, 2, it=5)
    for r in (0, 1):  # instance 0 finished update 6, instance 1 still at 5
        ranks[r].iteration = 6
    kill(ranks, 3)
    plan = check_plan(select_dying_checkpoint(ranks), ranks)
    assert plan.iteration == 6 and set(plan.savers()) == {0, 1}
    kill(ranks, 1)  # shard 1 now only at iteration 5 (rank 3 dead too) -> nothing common
    assert isinstance(select_dying_checkpoint(ranks), NoCompleteData)


def test_falls_back_to_older_iteration_when_newest_is_incomplete():
    ranks = cluster(1, 1, 4, 2, it=5)
    ranks[0].iteration = 6  # rank 0 ahead alone; others at 5
    plan = check_plan(select_dying_checkpoint(ranks), ranks)
    assert plan.iteration == 5


def test_not_stopped_unavailable_and_uce_are_unusable():
    ranks = cluster(1, 1, 2, 2)
    ranks[0].stopped = False
    plan = check_plan(select_dying_checkpoint(ranks), ranks)
    assert plan.savers() == (1,)
    ranks[1].fault = FaultKind.UCE
    assert isinstance(select_dying_checkpoint(ranks), NoCompleteData)
    ranks[1].fault = None
    assert isinstance(select_dying_checkpoint(ranks, {1: "silent"}), NoCompleteData)


def test_non_distributed_optimizer_same_rule():
    ranks = kill(cluster(1, 2, 4, 0, distributed=False), 0, 1, 2)  # 3 of 4 DP ranks of pp0 dead
    plan = check_plan(select_dying_checkpoint(ranks), ranks)
    assert plan.shard_savers[(0, 0, 0)] == 3 and plan.shards_per_instance == 1


def test_unregistered_shard_is_missing():
    ranks = cluster(1, 1, 4, 2)
    del ranks[0], ranks[2]
    choice = select_dying_checkpoint(ranks)
    assert isinstance(choice, NoCompleteData) and "none registered" in choice.reason


# --------------------------------------------------------------------------- decide
CFG = HAConfig(enabled=True, distributed_optimizer=True, replica_count=2, heartbeat_interval_s=0.1,
               heartbeat_timeout_s=1.0, stop_timeout_s=2.0, action_timeout_s=10.0, save_dir="/save")


def state_of(ranks, world=None):
    st = ClusterState(world_size=world or len(ranks), ranks=ranks)
    for i in ranks.values():
        i.stopped = False
    return st


def apply(st, d, now):
    """What the controller does with a decision (without I/O)."""
    if d.action is ActionKind.STOP_ALL:
        st.record_fault(d.params["at"], d.params["rank"], FaultKind(d.params["kind"]), d.reason)
    elif d.action is not ActionKind.NOOP:
        st.pending = PendingAction(1, d.action.value, d.targets, now, dict(d.params))
        if d.action is ActionKind.DUMP:
            st.plan = DumpPlan.from_params(d.params)
        if d.action is ActionKind.EXIT:
            st.exit_code = d.params["code"]
    if d.next_phase is not None:
        st.set_phase(d.next_phase, now)


def results(st, ok=True, ranks=None):
    for r in ranks or st.pending.targets:
        st.pending.results[r] = (ok, "done" if ok else "disk full")


def run_to_stopping(now=1.5):
    st = state_of(cluster(1, 1, 4, 2))
    for i in st.ranks.values():
        i.last_heartbeat = 0.0
    st.ranks[3].last_heartbeat = -1.0 + 0.4  # silent since t=-0.6
    for r in (0, 1, 2):
        st.ranks[r].last_heartbeat = 1.0
    d = decide(now, st, CFG)
    return st, d


def test_heartbeat_timeout_detection_with_chosen_now():
    st = state_of(cluster(1, 1, 4, 2))
    for i in st.ranks.values():
        i.last_heartbeat = 10.0
    assert decide(10.9, st, CFG).action is ActionKind.NOOP
    st.ranks[2].last_heartbeat = 9.5
    assert decide(10.4, st, CFG).action is ActionKind.NOOP
    d = decide(10.6, st, CFG)
    assert d.action is ActionKind.STOP_ALL and d.next_phase is Phase.STOPPING
    assert "rank 2 missed heartbeats" in d.reason and d.params["at"] == 9.5
    assert d.targets == (0, 1, 3)


def test_full_dying_checkpoint_round():
    st, d = run_to_stopping()
    assert d.action is ActionKind.STOP_ALL and d.targets == (0, 1, 2)
    apply(st, d, 1.5)
    assert decide(1.6, st, CFG).action is ActionKind.NOOP  # waiting for STOPPED
    for r in (0, 1, 2):
        st.ranks[r].stopped = True
    d = decide(1.7, st, CFG)
    assert d.action is ActionKind.DUMP and d.next_phase is Phase.DUMPING
    assert set(d.targets) == {0, 1} and d.params["save_dir"] == "/save" and d.params["iteration"] == 5
    apply(st, d, 1.7)
    assert decide(1.8, st, CFG).action is ActionKind.NOOP
    results(st)
    d = decide(1.9, st, CFG)
    assert d.action is ActionKind.ASSEMBLE and d.targets == (1,)
    apply(st, d, 1.9)
    results(st)
    d = decide(2.0, st, CFG)
    assert d.action is ActionKind.COMMIT and d.targets == (0,)
    apply(st, d, 2.0)
    results(st)
    d = decide(2.1, st, CFG)
    assert d.action is ActionKind.EXIT and d.params["code"] == EXIT_DYING_CHECKPOINT_SAVED
    assert d.targets == (0, 1, 2, 3)  # the silent rank is still told to exit
    apply(st, d, 2.1)
    for r in (0, 1, 2):
        st.ranks[r].last_heartbeat = 2.1
    for r in (0, 1):
        st.ranks[r].exit_code = 75
    assert decide(2.2, st, CFG).next_phase is None  # rank 2 has not exited yet
    st.ranks[2].exit_code = 75  # rank 3 is silent (gone) already
    assert decide(2.3, st, CFG).next_phase is Phase.DONE


def test_stop_timeout_treats_silent_ranks_as_unavailable():
    st, d = run_to_stopping()
    apply(st, d, 1.5)
    st.ranks[0].stopped = st.ranks[1].stopped = True  # rank 2 never answers, heartbeat fresh
    st.ranks[2].last_heartbeat = 3.0
    assert decide(3.0, st, CFG).action is ActionKind.NOOP
    d = decide(3.6, st, CFG)  # 2.1 s > stop_timeout
    assert d.action is ActionKind.EXIT and d.params["code"] == EXIT_NO_COMPLETE_DATA
    assert "did not answer STOP" in d.reason or "no STOPPED" in d.reason


@pytest.mark.parametrize("phase_failure", ["fail", "timeout", "target dies"])
def test_failure_during_dump_exits_without_commit(phase_failure):
    st, d = run_to_stopping()
    apply(st, d, 1.5)
    for r in (0, 1, 2):
        st.ranks[r].stopped = True
    d = decide(1.7, st, CFG)
    apply(st, d, 1.7)
    now = 1.8
    if phase_failure == "fail":
        results(st, ok=False, ranks=[1])
    elif phase_failure == "timeout":
        results(st, ranks=[0])
        now = 1.7 + CFG.action_timeout_s + 0.1
        for i in st.ranks.values():
            i.last_heartbeat = now
    else:
        st.ranks[1].alive = False
    d = decide(now, st, CFG)
    assert d.action is ActionKind.EXIT and d.params["code"] == EXIT_FAULT_UNRECOVERABLE
    assert "nothing committed" in d.reason


def test_no_save_dir_exits_with_reason():
    cfg = dataclasses.replace(CFG, save_dir=None)
    st, d = run_to_stopping()
    apply(st, d, 1.5)
    for r in (0, 1, 2):
        st.ranks[r].stopped = True
    d = decide(1.7, st, cfg)
    assert d.action is ActionKind.EXIT and d.params["code"] == EXIT_FAULT_UNRECOVERABLE and "--save" in d.reason


def test_no_complete_data_exits_76():
    st = state_of(kill(cluster(1, 1, 4, 2), 0, 2))
    for i in st.ranks.values():
        i.last_heartbeat = 0.0
    d = decide(0.1, st, CFG)
    assert d.action is ActionKind.STOP_ALL and d.targets == (1, 3)
    apply(st, d, 0.1)
    st.ranks[1].stopped = st.ranks[3].stopped = True
    d = decide(0.2, st, CFG)
    assert d.action is ActionKind.EXIT and d.params["code"] == EXIT_NO_COMPLETE_DATA
    assert "shard=0" in d.reason and "nothing written" in d.reason


def test_fault_report_and_goodbye():
    st = state_of(cluster(1, 1, 2, 2))
    for i in st.ranks.values():
        i.last_heartbeat = 0.0
        i.exit_code = 0
        i.alive = False
    assert decide(0.1, st, CFG).next_phase is Phase.DONE  # everyone finished normally
    st = state_of(cluster(1, 1, 2, 2))
    for i in st.ranks.values():
        i.last_heartbeat = 0.0
    st.ranks[1].fault, st.ranks[1].fault_message = FaultKind.NETWORK, "Connection closed by peer"
    d = decide(0.1, st, CFG)
    assert d.action is ActionKind.STOP_ALL and d.params["kind"] == "network" and d.targets == (0, 1)


def test_unregistered_death_is_a_fault():
    st = state_of(cluster(1, 1, 2, 2), world=3)
    for i in st.ranks.values():
        i.last_heartbeat = 0.0
    st.mark_dead(2, "exited", -9, at=0.05)
    d = decide(0.1, st, CFG)
    assert d.action is ActionKind.STOP_ALL and "before registering" in d.reason


def test_illegal_phase_move_rejected():
    from mindspeed_ha.faults import IllegalTransition

    st = state_of(cluster(1, 1, 2, 2))
    with pytest.raises(IllegalTransition):
        st.set_phase(Phase.COMMITTING, 0.0)


def test_stop_round_waits_for_a_rank_finishing_its_update():
    """Kill rank 0 inside its update of iteration 6 (PP2 DP2 N2): its replica rank 1 was
    caught by STOP inside the same update. Deciding at once would find no complete copy;
    waiting for rank 1's end_update gives iteration 6 (found by a failing kill-matrix run)."""
    ranks = kill(cluster(1, 2, 2, 2, it=5), 0)
    ranks[1].status, ranks[1].iteration = OptimizerStatus.UPDATING, 6
    ranks[2].iteration = ranks[3].iteration = 6
    st = state_of(ranks)
    for i in st.ranks.values():
        i.stopped, i.last_heartbeat = True, 10.0
    st.set_phase(Phase.STOPPING, 10.0)
    d = decide(10.1, st, CFG)
    assert d.action is ActionKind.NOOP and "finishing the optimizer update" in d.reason
    st.ranks[1].status = OptimizerStatus.UPDATED  # its STATUS message arrives
    d = decide(10.2, st, CFG)
    assert d.action is ActionKind.DUMP and d.params["iteration"] == 6


def test_stop_round_does_not_wait_when_waiting_cannot_help():
    ranks = kill(cluster(1, 1, 4, 2, it=5), 0)  # instance {0,1}, {2,3}
    ranks[1].status, ranks[1].iteration = OptimizerStatus.UPDATING, 6  # stuck with dead rank 0
    st = state_of(ranks)
    for i in st.ranks.values():
        i.stopped, i.last_heartbeat = True, 10.0
    st.set_phase(Phase.STOPPING, 10.0)
    d = decide(10.1, st, CFG)
    assert d.action is ActionKind.DUMP and d.params["iteration"] == 5


def test_settle_wait_is_bounded():
    ranks = kill(cluster(1, 2, 2, 2, it=5), 0)
    ranks[1].status, ranks[1].iteration = OptimizerStatus.UPDATING, 6
    st = state_of(ranks)
    for i in st.ranks.values():
        i.stopped, i.last_heartbeat = True, 10.0
    st.set_phase(Phase.STOPPING, 10.0)
    d = decide(10.0 + min(CFG.stop_timeout_s, CFG.heartbeat_timeout_s) + 0.01, st, CFG)
    assert d.action is ActionKind.EXIT and d.params["code"] == EXIT_NO_COMPLETE_DATA


def test_nothing_to_save_before_the_first_iteration():
    ranks = kill(cluster(1, 2, 2, 2, it=0), 0)
    st = state_of(ranks)
    for i in st.ranks.values():
        i.stopped, i.last_heartbeat = True, 10.0
    st.set_phase(Phase.STOPPING, 10.0)
    d = decide(10.1, st, CFG)
    assert d.action is ActionKind.EXIT and "no iteration has completed" in d.reason


# --------------------------------------------------------------------------- integrity (issue 6.2)
from mindspeed_ha.control.integrity import IntegrityReport, majority  # noqa: E402


def verified(ranks, corrupt=None, missing=()):
    """Every rank verifies; reports at its iteration. ``corrupt``: rank -> (part, "nan"|"flip")."""
    corrupt = corrupt or {}
    for r, info in ranks.items():
        info.verifies = True
        if r in missing:
            continue
        t, p, s = info.layout.shard_key
        k = info.iteration
        parts = {"shard": [True, f"s{t}{p}{s}@{k}"], "model": [True, f"m{t}{p}@{k}"]}
        if r in corrupt:
            part, how = corrupt[r]
            if how == "nan":
                parts[part][0] = False
            else:
                parts[part][1] += "-flipped"
        info.integrity = IntegrityReport(k, parts["shard"][0], parts["shard"][1], parts["model"][0],
                                         parts["model"][1], "" if r not in corrupt else f"{corrupt[r]}")
    return ranks


# (name, (tp, pp, dp, n), killed, corrupted {rank: (part, how)}, expected iteration or "none", reason part)
INTEGRITY_CASES = [
    ("NaN shard, good replica left", (1, 2, 4, 2), [7], {0: ("shard", "nan")}, 5, ""),
    ("NaN shard, its replica dead", (1, 2, 4, 2), [2], {0: ("shard", "nan")}, "none", "corrupt shard"),
    ("both holders NaN", (1, 1, 2, 2), [], {0: ("shard", "nan"), 1: ("shard", "nan")}, "none",
     "no finite shard among 2"),
    ("2 finite holders disagree: no trustworthy copy", (1, 1, 2, 2), [], {0: ("shard", "flip")}, "none",
     "disagree with no majority"),
    ("3 holders, one bit-flipped: majority wins", (1, 1, 3, 3), [], {0: ("shard", "flip")}, 5, ""),
    ("3 holders, one flipped, one dead: 1 against 1", (1, 1, 3, 3), [2], {0: ("shard", "flip")}, "none",
     "disagree"),
    ("NaN model parameters, replica good", (1, 1, 2, 2), [], {0: ("model", "nan")}, 5, ""),
    ("model digest in the minority of 4 DP ranks", (1, 1, 4, 2), [], {0: ("model", "flip")}, 5, ""),
    ("model digests split 2 against 2", (1, 1, 4, 2), [], {0: ("model", "flip"), 1: ("model", "flip")},
     "none", "model digests disagree"),
    ("NaN model of the only holder of a shard", (1, 1, 4, 2), [2], {0: ("model", "nan")}, "none", "corrupt model"),
    # a finite flip in the only copy left cannot be seen: trusted alone (documented limit)
    ("single finite copy left is trusted", (1, 1, 4, 2), [2], {0: ("shard", "flip")}, 5, ""),
]


@pytest.mark.parametrize("name,shape,killed,corrupt,expect,why", INTEGRITY_CASES,
                         ids=[c[0] for c in INTEGRITY_CASES])
def test_select_integrity_table(name, shape, killed, corrupt, expect, why):
    ranks = verified(kill(cluster(*shape), *killed), corrupt)
    assert isinstance(select_dying_checkpoint(ranks), DumpPlan)  # unverified selection: blind to corruption
    choice = select_dying_checkpoint(ranks, verified=True)
    if expect == "none":
        assert isinstance(choice, NoCompleteData), choice
        assert choice.reason.startswith("no complete data") and "trustworthy copy" in choice.reason
        assert why in choice.reason, choice.reason
        return
    plan = check_plan(choice, ranks)
    assert plan.iteration == expect
    suspects = {r for r, (part, how) in corrupt.items()
                if how == "nan" or name != "single finite copy left is trusted"}
    assert not (set(killed) | suspects) & set(plan.savers()), plan
    tp, pp, dp, n = shape
    assert set(plan.shard_digests) == set(plan.shard_savers) and set(plan.model_digests) == set(plan.model_savers)
    for key, r in plan.shard_savers.items():
        assert plan.shard_digests[key] == ranks[r].integrity.shard_digest
        assert plan.model_digests[key[:2]] == ranks[r].integrity.model_digest
    assert DumpPlan.from_params(plan.to_params("/s")) == plan


def test_majority_rule():
    assert majority([]) is None and majority(["a"]) == "a"
    assert majority(["a", "b"]) is None and majority(["a", "a", "b"]) == "a"
    assert majority(["a", "a", "b", "c"]) is None  # plurality is not enough


def test_verifier_without_report_is_not_used():
    ranks = verified(cluster(1, 1, 2, 2), missing=(0,))
    plan = check_plan(select_dying_checkpoint(ranks, verified=True), ranks)
    assert plan.savers() == (1,)
    ranks[1].integrity = IntegrityReport(4, True, "s", True, "m")  # a report of another iteration
    choice = select_dying_checkpoint(ranks, verified=True)
    assert isinstance(choice, NoCompleteData) and "no integrity report for iteration 5" in choice.reason


def test_corrupt_newest_copy_falls_back_to_an_older_clean_iteration():
    ranks = cluster(1, 1, 4, 2, it=5)
    for r in (0, 1):  # instance 0 finished update 6; rank 0's copy of it is NaN
        ranks[r].iteration = 6
    verified(ranks, {0: ("shard", "nan")})
    plan = check_plan(select_dying_checkpoint(ranks, verified=True), ranks)
    assert plan.iteration == 5 and set(plan.savers()) == {2, 3}


def _stopped(ranks, now=10.0):
    st = state_of(ranks)
    for i in st.ranks.values():
        i.stopped, i.last_heartbeat = True, now
    st.set_phase(Phase.STOPPING, now)
    return st


def test_decide_verifies_before_dumping():
    ranks = verified(kill(cluster(1, 2, 4, 2), 7), {0: ("shard", "nan")})
    st = _stopped(ranks)
    d = decide(10.1, st, CFG)
    assert d.action is ActionKind.VERIFY and d.next_phase is Phase.VERIFYING
    assert d.targets == (0, 1, 2, 3, 4, 5, 6)  # every usable rank that can verify
    apply(st, d, 10.1)
    results(st, ranks=[0, 1, 2])
    assert decide(10.2, st, CFG).action is ActionKind.NOOP  # waiting for the others
    results(st)
    d = decide(10.3, st, CFG)
    assert d.action is ActionKind.DUMP and d.next_phase is Phase.DUMPING
    plan = DumpPlan.from_params(d.params)
    assert 0 not in d.targets and plan.shard_savers[(0, 0, 0)] == 2
    assert plan.shard_digests[(0, 0, 0)] == "s000@5" and plan.model_digests[(0, 1)] == "m01@5"
    assert "excluded" in d.reason and "rank 0 corrupt shard" in d.reason


def test_decide_no_trustworthy_copy_exits_76():
    ranks = verified(cluster(1, 1, 2, 2), {0: ("shard", "flip")})
    st = _stopped(ranks)
    d = decide(10.1, st, CFG)
    apply(st, d, 10.1)
    results(st)
    d = decide(10.2, st, CFG)
    assert d.action is ActionKind.EXIT and d.params["code"] == EXIT_NO_COMPLETE_DATA
    assert "no trustworthy copy" in d.reason and "nothing written" in d.reason


@pytest.mark.parametrize("how", ["fails", "dies", "silent"])
def test_verify_target_lost_is_not_used_but_not_fatal(how):
    ranks = verified(cluster(1, 1, 4, 2))
    st = _stopped(ranks)
    d = decide(10.1, st, CFG)
    apply(st, d, 10.1)
    now = 10.2
    results(st, ranks=[1, 2, 3])
    if how == "fails":
        results(st, ok=False, ranks=[0])
    elif how == "dies":
        kill(st.ranks, 0)
    else:
        now = 10.1 + CFG.action_timeout_s + 0.1
        for i in st.ranks.values():
            i.last_heartbeat = now
    d = decide(now, st, CFG)
    assert d.action is ActionKind.DUMP
    assert 0 not in d.targets and DumpPlan.from_params(d.params).shard_savers[(0, 0, 0)] == 2


def test_ranks_that_cannot_verify_skip_the_round():
    st = _stopped(cluster(1, 1, 2, 2))  # test doubles: RankInfo.verifies is False
    d = decide(10.1, st, CFG)
    assert d.action is ActionKind.DUMP and not DumpPlan.from_params(d.params).shard_digests


# --------------------------------------------------------------------------- graceful stop (preemption)
PCFG = dataclasses.replace(CFG, preemption_deadline_s=10.0)  # drain budget 5 s, deadline 10 s


def apply_drain(st, d, now):
    """What the controller does with a DRAIN / graceful STOP_ALL (without I/O)."""
    if d.action is ActionKind.DRAIN:
        if d.params["until"] >= 0:
            st.drain_until = d.params["until"]
        for r in d.targets:
            st.ranks[r].stopped = False
            if d.params["until"] < 0:
                st.ranks[r].pause_at = None
        if d.next_phase is not None:
            st.set_phase(d.next_phase, now)
    elif d.action is ActionKind.STOP_ALL and d.params.get("graceful"):
        for r in d.targets:
            st.ranks[r].stopped = False
        st.set_phase(d.next_phase, now)
    else:
        apply(st, d, now)


def running(world_ranks=None, it=5):
    st = state_of(world_ranks or cluster(1, 2, 2, 2, it=it))
    for i in st.ranks.values():
        i.last_heartbeat = 10.0
    return st


# (announced pause points) -> agreed iteration
AGREE = [
    ("all in the same iteration", {0: 6, 1: 6, 2: 6, 3: 6}, 6),
    ("one rank an iteration ahead: everyone finishes its", {0: 6, 1: 7, 2: 6, 3: 6}, 7),
    ("a rank not started yet follows the others", {0: -1, 1: 4, 2: 4, 3: 4}, 4),
    ("nobody started: nothing to save", {0: -1, 1: -1}, None),
    ("a rank paused before its first iteration (announced 0) counts as not started", {0: 0, 1: -1}, None),
]


@pytest.mark.parametrize("name,announced,expect", AGREE, ids=[a[0] for a in AGREE])
def test_agree_pause_table(name, announced, expect):
    assert agree_pause(announced) == expect


def test_graceful_stop_round_trip():
    """SIGTERM: DRAIN(-1) to all, DRAIN(max announced), every rank paused there, VERIFY-less
    test doubles dump at once; the plan uses every rank (no dead one) at the agreed iteration."""
    st = running()
    assert st.request_stop(10.0, -1, "SIGTERM to the launcher")
    assert not st.request_stop(10.1, 2, "SIGTERM to rank 2")  # the first request wins
    d = decide(10.1, st, PCFG)
    assert d.action is ActionKind.DRAIN and d.params == {"until": -1} and d.next_phase is Phase.DRAINING
    assert d.targets == (0, 1, 2, 3)
    apply_drain(st, d, 10.1)
    for r, k in {0: 6, 1: 6, 2: 7, 3: 6}.items():
        st.ranks[r].pause_at = k
        st.ranks[r].last_heartbeat = 10.2
    d = decide(10.2, st, PCFG)
    assert d.action is ActionKind.DRAIN and d.params == {"until": 7} and d.next_phase is None
    apply_drain(st, d, 10.2)
    for r in (0, 1, 2):
        st.ranks[r].stopped, st.ranks[r].iteration = True, 7
    assert decide(10.3, st, PCFG).action is ActionKind.NOOP  # rank 3 is still finishing iteration 7
    st.ranks[3].stopped, st.ranks[3].iteration = True, 7
    d = decide(10.4, st, PCFG)
    assert d.action is ActionKind.DUMP and d.next_phase is Phase.DUMPING and d.params["iteration"] == 7
    assert st.fault is None


def test_graceful_stop_waits_for_registration_then_abandons():
    st = running()
    del st.ranks[3]  # still starting
    st.request_stop(10.0, -1, "SIGTERM")
    apply_drain(st, decide(10.0, st, PCFG), 10.0)
    for r in (0, 1, 2):
        st.ranks[r].pause_at = 6
        st.ranks[r].last_heartbeat = 14.8
    assert decide(14.9, st, PCFG).action is ActionKind.NOOP
    d = decide(15.1, st, PCFG)  # past the drain budget (5 s)
    assert d.action is ActionKind.STOP_ALL and d.params == {"graceful": True} and d.next_phase is Phase.STOPPING
    assert "abandoning" in d.reason


def test_graceful_stop_abandons_an_iteration_that_takes_too_long():
    """Past half the deadline the iteration in progress is abandoned: freeze now and save the
    last iteration every shard holds (a classic stop round), still before the deadline."""
    st = running(it=6)
    st.request_stop(10.0, -1, "SIGTERM")
    apply_drain(st, decide(10.0, st, PCFG), 10.0)
    for r in st.ranks:
        st.ranks[r].pause_at = 7
        st.ranks[r].last_heartbeat = 14.0
    apply_drain(st, decide(10.1, st, PCFG), 10.1)
    st.ranks[0].stopped = True  # the others are still in iteration 7
    d = decide(15.1, st, PCFG)
    assert d.action is ActionKind.STOP_ALL and d.next_phase is Phase.STOPPING
    apply_drain(st, d, 15.1)
    for r in st.ranks:  # frozen now: rank 0 paused after 7, the others at 6 (7 not begun)
        st.ranks[r].stopped, st.ranks[r].last_heartbeat = True, 15.1
    st.ranks[0].iteration = 7
    d = decide(15.2, st, PCFG)
    assert d.action is ActionKind.DUMP and d.params["iteration"] == 6


def test_graceful_stop_past_the_deadline_exits_77_but_not_during_commit():
    st = running()
    st.request_stop(10.0, -1, "SIGTERM")
    apply_drain(st, decide(10.0, st, PCFG), 10.0)
    for r in st.ranks:
        st.ranks[r].pause_at = 6
    apply_drain(st, decide(10.1, st, PCFG), 10.1)
    for r in st.ranks:
        st.ranks[r].stopped, st.ranks[r].iteration, st.ranks[r].last_heartbeat = True, 6, 19.5
    d = decide(10.2, st, PCFG)
    apply(st, d, 10.2)  # DUMP
    assert decide(19.9, st, PCFG).action is ActionKind.NOOP  # still within 10 s
    d = decide(20.1, st, PCFG)
    assert d.action is ActionKind.EXIT and d.params["code"] == EXIT_FAULT_UNRECOVERABLE
    assert "preemption deadline" in d.reason and "--ha-preemption-deadline" in d.reason
    # a commit under way is not cut by the deadline: it may already have published the checkpoint
    st2 = running()
    for i in st2.ranks.values():
        i.last_heartbeat = 20.4
    st2.request_stop(10.0, -1, "SIGTERM")
    st2.phase, st2.plan = Phase.COMMITTING, DumpPlan(6, {}, {}, {}, 0)
    st2.pending = PendingAction(1, "commit", (0,), 19.0, {"save_dir": "/save"})
    assert decide(20.5, st2, PCFG).action is ActionKind.NOOP
    st2.pending.results[0] = (True, "committed")
    d = decide(20.6, st2, PCFG)
    assert d.action is ActionKind.EXIT and d.params["code"] == EXIT_DYING_CHECKPOINT_SAVED


def test_fault_during_graceful_stop_becomes_a_dying_checkpoint():
    st = running()
    st.request_stop(10.0, -1, "SIGTERM")
    apply_drain(st, decide(10.0, st, PCFG), 10.0)
    st.mark_dead(1, "control connection closed", None, 10.3)
    d = decide(10.4, st, PCFG)
    assert d.action is ActionKind.STOP_ALL and d.next_phase is Phase.STOPPING and not d.params.get("graceful")
    assert d.params["rank"] == 1 and d.targets == (0, 2, 3)


def test_training_that_ends_during_the_graceful_stop_is_done():
    st = running()
    st.request_stop(10.0, -1, "SIGTERM")
    apply_drain(st, decide(10.0, st, PCFG), 10.0)
    for i in st.ranks.values():
        i.exit_code = 0
        i.alive = False
    assert decide(10.5, st, PCFG).next_phase is Phase.DONE


def test_graceful_stop_before_any_iteration_exits_76():
    st = running()
    st.request_stop(10.0, -1, "SIGTERM")
    apply_drain(st, decide(10.0, st, PCFG), 10.0)
    for i in st.ranks.values():
        i.pause_at = -1
    d = decide(10.1, st, PCFG)
    assert d.action is ActionKind.EXIT and d.params["code"] == EXIT_NO_COMPLETE_DATA


def test_stop_request_ignored_once_a_fault_round_runs():
    st = running()
    st.phase = Phase.STOPPING
    assert not st.request_stop(10.0, -1, "SIGTERM") and st.stop_request is None


# --------------------------------------------------------------------------- without a controller
# (name, shape, changes to the exchanged records, save_dir, expected: iteration or exit code)
ORPHAN = [
    ("every rank paused at the same iteration", (1, 2, 2, 2), {}, "/save", 5),
    ("a rank missing from the exchange", (1, 2, 2, 2), {"drop": 3}, "/save", EXIT_CONTROLLER_LOST),
    ("no --save", (1, 2, 2, 2), {}, None, EXIT_FAULT_UNRECOVERABLE),
    ("no replica and one holder dirty", (1, 1, 2, 1), {"dirty": 1}, "/save", EXIT_NO_COMPLETE_DATA),
    ("replica covers a dirty holder", (1, 2, 2, 2), {"dirty": 1}, "/save", 5),
    ("nothing completed yet", (1, 1, 2, 2), {"iteration": 0}, "/save", EXIT_NO_COMPLETE_DATA),
]


@pytest.mark.parametrize("name,shape,change,save,expect", ORPHAN, ids=[o[0] for o in ORPHAN])
def test_plan_without_controller_table(name, shape, change, save, expect):
    ranks = cluster(*shape)
    world = len(ranks)
    if "drop" in change:
        del ranks[change["drop"]]
    if "dirty" in change:
        ranks[change["dirty"]].status = UP
    if "iteration" in change:
        for i in ranks.values():
            i.iteration = change["iteration"]
    out = plan_without_controller(ranks, save, world)
    if isinstance(expect, int) and expect >= 70:
        assert isinstance(out, tuple) and out[0] == expect, out
    else:
        plan = check_plan(out, ranks)
        assert plan.iteration == expect
        # every rank computes the same plan from the same records
        assert plan_without_controller(dict(reversed(list(ranks.items()))), save, world) == plan


def test_graceful_stop_while_ranks_are_still_starting_exits_76():
    """Preempted during start-up (a rank not registered, none started an iteration): nothing
    to save; 76, not a stop round that would blame a failure."""
    st = running()
    del st.ranks[3]
    st.request_stop(10.0, -1, "SIGTERM")
    apply_drain(st, decide(10.0, st, PCFG), 10.0)
    for r in (0, 1, 2):
        st.ranks[r].pause_at, st.ranks[r].last_heartbeat = -1, 15.0
    d = decide(15.1, st, PCFG)
    assert d.action is ActionKind.EXIT and d.params["code"] == EXIT_NO_COMPLETE_DATA and "starting" in d.reason
