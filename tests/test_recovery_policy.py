"""Pure policy of the in-place recovery: plan_recovery's table and decide() in RECOVERING."""

import dataclasses

import pytest

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.policy import ActionKind, decide
from mindspeed_ha.control.recovery_plan import NoRecovery, RecoveryPlan, plan_recovery
from mindspeed_ha.control.state import ClusterState, OptimizerStatus, PendingAction, Phase
from mindspeed_ha.faults import FaultKind

from test_policy import cluster, kill

U, UP = OptimizerStatus.UPDATED, OptimizerStatus.UPDATING
A, UCE, NET = FaultKind.ABORTED, FaultKind.UCE, FaultKind.NETWORK
CFG = HAConfig(enabled=True, hbm_repair=True, distributed_optimizer=True)


def parked(ranks, faults, where=None):
    """Every rank parked: the given ones with their own fault, the others ABORTED."""
    for r, info in ranks.items():
        info.fault = faults.get(r, A)
        info.fault_where = (where or {}).get(r, "train_step")
        info.fault_iteration = info.iteration + 1
    return ranks


# (name, (tp, pp, dp, n, distributed), faults, config changes, expected repairs or NoRecovery text)
CASES = [
    ("network, DP4 N=2", (1, 1, 4, 2, True), {1: NET}, {}, {}),
    ("UCE on a DP rank, TP1 PP2 DP2 N=2", (1, 2, 2, 2, True), {0: UCE}, {}, {0: 1}),
    ("UCE on the PP-last rank", (1, 2, 2, 2, True), {3: UCE}, {}, {3: 2}),
    ("UCE on a TP peer, TP2 DP2 N=2", (2, 1, 2, 2, True), {1: UCE}, {}, {1: 3}),
    ("UCE in DP4 N=2: the other instance's holder", (1, 1, 4, 2, True), {2: UCE}, {}, {2: 0}),
    ("UCE + network in one round", (1, 1, 4, 2, True), {0: UCE, 3: NET}, {}, {0: 2}),
    ("two UCEs in different shards", (1, 1, 4, 2, True), {0: UCE, 3: UCE}, {}, {0: 2, 3: 1}),
    ("non-distributed optimizer: any DP peer", (1, 2, 2, 2, False), {2: UCE}, {}, {2: 3}),
    ("UCE without --enable-hbmfault-repair", (1, 1, 4, 2, True), {1: UCE}, {"hbm_repair": False},
     "--enable-hbmfault-repair"),
    ("network with --ha-network-retries 0", (1, 1, 4, 2, True), {1: NET}, {"network_retries": 0},
     "--ha-network-retries 0"),
    ("no replica (N=1): reload", (1, 2, 2, 1, True), {0: UCE}, {}, "reload"),
    ("both holders of a shard damaged: reload", (1, 1, 4, 2, True), {0: UCE, 2: UCE}, {}, "reload"),
    ("an unknown error", (1, 1, 4, 2, True), {1: FaultKind.UNKNOWN}, {}, "not recovered in place"),
    ("a dead process", (1, 1, 4, 2, True), {1: FaultKind.PROCESS}, {}, "needs --enable-worker-reboot"),
]


@pytest.mark.parametrize("name,shape,faults,changes,expect", CASES, ids=[c[0] for c in CASES])
def test_plan_table(name, shape, faults, changes, expect):
    tp, pp, dp, n, dist = shape
    ranks = parked(cluster(tp, pp, dp, n, it=5, distributed=dist), faults)
    cfg = dataclasses.replace(CFG, **changes) if changes else CFG
    plan = plan_recovery(ranks, tp * pp * dp, min(faults), cfg)
    if expect == "reload":
        assert isinstance(plan, RecoveryPlan) and plan.mode == "reload" and plan.iteration == 5, plan
        assert plan.repairs == {} and "periodic checkpoint" in plan.reason
        assert RecoveryPlan.from_params(plan.to_params()) == plan
        return
    if isinstance(expect, str):
        assert isinstance(plan, NoRecovery), plan
        assert expect in plan.reason
        return
    assert isinstance(plan, RecoveryPlan), plan
    assert plan.iteration == 5 and plan.generation == 1 and plan.mode == "rollback"
    assert plan.repairs == expect
    for d, s in plan.repairs.items():
        assert ranks[d].layout.shard_key == ranks[s].layout.shard_key and faults.get(s) is not UCE
    assert plan.kind is (UCE if UCE in faults.values() else NET)
    assert RecoveryPlan.from_params(plan.to_params()) == plan


def _in_update(ranks, unfinished, j=6):
    """Every rank stopped inside the optimizer update of ``j``: ``unfinished`` ranks in it
    (UPDATING), the others in its commit barrier (UPDATED)."""
    for r, info in ranks.items():
        done = r not in unfinished
        info.status, info.iteration = (U if done else UP), j
        info.fault_where, info.fault_iteration = ("update_done" if done else "update"), j
    return ranks


# (name, shape, faults, unfinished ranks, expected repairs or NoRecovery/"reload" text)
FORWARD = [
    ("UCE in the update on a DP rank, TP1 PP2 DP2 N=2", (1, 2, 2, 2, True), {0: UCE}, {0}, {0: 1}),
    ("UCE in the update on the PP-last rank", (1, 2, 2, 2, True), {3: UCE}, {3}, {3: 2}),
    ("UCE in the update on a TP peer, TP2 DP2 N=2", (2, 1, 2, 2, True), {1: UCE}, {1}, {1: 3}),
    ("DP4 N=2: the instance peer blocked in the param all-gather", (1, 1, 4, 2, True), {0: UCE}, {0, 1},
     {0: 2, 1: 3}),
    ("network error in the commit barrier: no repair", (1, 1, 4, 2, True), {1: NET}, set(), {}),
    ("UCE on a rank that finished: repaired too", (1, 1, 4, 2, True), {2: UCE}, set(), {2: 0}),
    ("no replica (N=1): reload", (1, 2, 2, 1, True), {0: UCE}, {0}, "reload"),
    ("network, no finished copy: no reload for a network error", (1, 1, 4, 1, True), {0: NET}, {0, 1},
     "only done for a UCE"),
]


@pytest.mark.parametrize("name,shape,faults,unfinished,expect", FORWARD, ids=[c[0] for c in FORWARD])
def test_fault_inside_the_optimizer_update_rolls_forward(name, shape, faults, unfinished, expect):
    tp, pp, dp, n, dist = shape
    ranks = _in_update(parked(cluster(tp, pp, dp, n, it=5, distributed=dist), faults), unfinished)
    plan = plan_recovery(ranks, tp * pp * dp, min(faults), CFG)
    if expect == "reload":
        assert isinstance(plan, RecoveryPlan) and plan.mode == "reload" and plan.iteration == 5, plan
        return
    if isinstance(expect, str):
        assert isinstance(plan, NoRecovery) and expect in plan.reason, plan
        return
    assert isinstance(plan, RecoveryPlan) and plan.mode == "forward", plan
    assert plan.iteration == 6 and plan.repairs == expect
    for d, s in plan.repairs.items():
        assert ranks[s].fault_where == "update_done" and ranks[d].layout.shard_key == ranks[s].layout.shard_key
    assert RecoveryPlan.from_params(plan.to_params()) == plan


def test_fault_inside_the_update_with_a_rank_outside_it_falls_back():
    ranks = _in_update(parked(cluster(1, 2, 2, 2, it=5), {0: UCE}), {0})
    ranks[3].fault_where, ranks[3].fault_iteration = "train_step", 7  # a rank past the barrier (impossible
    plan = plan_recovery(ranks, 4, 0, CFG)                            # with it; e.g. the flag was off)
    assert isinstance(plan, NoRecovery) and "rank 3 was" in plan.reason
    ranks = _in_update(parked(cluster(1, 2, 2, 2, it=5), {0: UCE}), {0})
    ranks[2].status = UP  # says UPDATING while in the commit barrier: inconsistent
    plan = plan_recovery(ranks, 4, 0, CFG)
    assert isinstance(plan, NoRecovery) and "rank 2 reports" in plan.reason


def test_fault_inside_the_optimizer_update_with_others_before_it_falls_back():
    ranks = parked(cluster(1, 2, 2, 2), {0: UCE})
    ranks[0].status, ranks[0].iteration = UP, 6  # raised inside update 6 but reported from train_step
    plan = plan_recovery(ranks, 4, 0, CFG)
    assert isinstance(plan, NoRecovery) and "optimizer update of iteration 6" in plan.reason


def test_ranks_at_different_iterations_fall_back():
    ranks = parked(cluster(1, 1, 4, 2), {1: NET})
    ranks[3].iteration = 6
    assert isinstance(plan_recovery(ranks, 4, 1, CFG), NoRecovery)


def test_fault_outside_train_step_falls_back():
    ranks = parked(cluster(1, 1, 4, 2), {1: NET}, where={1: "save"})
    plan = plan_recovery(ranks, 4, 1, CFG)
    assert isinstance(plan, NoRecovery) and "outside train_step (save)" in plan.reason


def test_rank_stopped_after_its_update_falls_back():
    ranks = parked(cluster(1, 2, 2, 2), {0: NET})
    ranks[3].fault_iteration = 5  # aborted in the tail of step 5, after update 5
    plan = plan_recovery(ranks, 4, 0, CFG)
    assert isinstance(plan, NoRecovery) and "rank 3 was stopped in train_step of iteration 5" in plan.reason


def test_dead_or_unparked_rank_falls_back():
    ranks = kill(parked(cluster(1, 1, 4, 2), {1: NET}), 2)
    assert "gone" in plan_recovery(ranks, 4, 1, CFG).reason
    ranks = parked(cluster(1, 1, 4, 2), {1: NET})
    ranks[3].fault = None
    assert "did not leave their step" in plan_recovery(ranks, 4, 1, CFG).reason


def test_retries_are_bounded_per_iteration():
    ranks = parked(cluster(1, 1, 4, 2), {1: NET})
    cfg = dataclasses.replace(CFG, network_retries=2)
    history = [{"iteration": 3}, {"iteration": 5}]
    plan = plan_recovery(ranks, 4, 1, cfg, history)
    assert isinstance(plan, RecoveryPlan) and plan.generation == 3
    history.append({"iteration": 5})
    plan = plan_recovery(ranks, 4, 1, cfg, history)
    assert isinstance(plan, NoRecovery) and "recovered 2 times in a row" in plan.reason


# --------------------------------------------------------------------------- decide()
def _state(ranks, phase=Phase.RUNNING):
    st = ClusterState(world_size=len(ranks), ranks=ranks, phase=phase, phase_since=0.0)
    return st


def test_decide_runs_the_recovery_round():
    ranks = cluster(1, 1, 4, 2)
    for info in ranks.values():
        info.stopped = False
    ranks[1].fault, ranks[1].fault_where, ranks[1].failed_at = NET, "train_step", 0.5
    st = _state(ranks)
    d = decide(1.0, st, CFG)
    assert d.action is ActionKind.STOP_ALL and d.next_phase is Phase.RECOVERING and d.params["in_place"]
    assert not d.params.get("recover")  # round 1 freezes only
    st.phase, st.phase_since = Phase.RECOVERING, 1.0
    st.record_fault(0.5, 1, NET, "net")
    assert decide(1.1, st, CFG).action is ActionKind.NOOP  # nobody STOPPED yet
    for info in ranks.values():
        info.stopped = True
    ranks[2].status, ranks[2].iteration = UP, 6  # inside its update: it finishes first
    assert decide(1.15, st, CFG).action is ActionKind.NOOP
    ranks[2].status, ranks[2].iteration = U, 5
    ranks[3].step = 5  # still in the tail of step 5 (after its update): not yet
    assert decide(1.155, st, CFG).action is ActionKind.NOOP
    ranks[3].step = 6
    d = decide(1.16, st, CFG)
    assert d.action is ActionKind.STOP_ALL and d.params["recover"] and d.next_phase is None
    st.abort_sent_at = 1.16
    for info in ranks.values():
        info.stopped = False
    assert decide(1.17, st, CFG).action is ActionKind.NOOP  # nobody parked yet
    parked(ranks, {1: NET})
    for info in ranks.values():
        info.stopped = True
    d = decide(1.2, st, CFG)
    assert d.action is ActionKind.RETRY and d.targets == (0, 1, 2, 3) and d.params["iteration"] == 5
    st.pending = PendingAction(1, "retry", d.targets, 1.2, dict(d.params))
    assert decide(1.3, st, CFG).action is ActionKind.NOOP
    for r in (0, 1, 2, 3):
        st.pending.results[r] = (True, "{}")
    d = decide(1.4, st, CFG)
    assert d.action is ActionKind.RESUME and d.next_phase is Phase.RUNNING


@pytest.mark.parametrize("what", ["failure", "new fault", "timeout", "death", "no plan", "not parked"])
def test_decide_falls_back_to_the_dying_checkpoint(what):
    ranks = parked(cluster(1, 1, 4, 2), {1: NET})
    st = _state(ranks, Phase.RECOVERING)
    st.abort_sent_at = 0.1
    cfg = CFG
    now = 1.0
    if what == "no plan":
        cfg = dataclasses.replace(CFG, network_retries=1)
        st.recoveries.append({"iteration": 5})
    elif what == "not parked":
        ranks[2].fault = None
        now = CFG.stop_timeout_s + 1
    elif what == "death":
        kill(ranks, 3)
    else:
        st.pending = PendingAction(1, "retry", (0, 1, 2, 3), 0.5, {"iteration": 5})
        if what == "failure":
            st.pending.results[2] = (False, "recv failed")
        elif what == "new fault":
            ranks[0].fault_at, ranks[0].fault_message = 0.8, "again"
        else:
            now = 0.5 + CFG.action_timeout_s + 1
    d = decide(now, st, cfg)
    assert d.action is ActionKind.STOP_ALL and d.next_phase is Phase.STOPPING, d
    assert d.params["recover"] and "in-place recovery not possible" in d.reason


def test_a_rank_inside_its_ordered_recovery_is_judged_by_the_action_timeout_not_by_silence():
    """Rank 2 rebuilds its groups for the RETRY it was sent, connected but silent past the
    heartbeat timeout (its training thread held the GIL, its process starved of CPU: the
    failover job's exit 77 at load 30-50, rank 2 silent 10 s in the rejoin rebuild). The
    controller waits for its result (before: "rank 2 is gone (no heartbeat ...)", the
    dying checkpoint); its death closes its connection (gone at once); a hung one is
    judged at the action's deadline, then its silence counts again."""
    from mindspeed_ha.control.policy import gone_ranks

    ranks = parked(cluster(1, 1, 4, 2), {1: NET})
    st = _state(ranks, Phase.RECOVERING)
    st.abort_sent_at, sent = 0.1, 0.5
    st.record_fault(0.05, 1, NET, "net")
    st.pending = PendingAction(1, "retry", (0, 1, 2, 3), sent, {"iteration": 5})
    now = sent + 3 * CFG.heartbeat_timeout_s
    for r in (0, 1, 3):
        st.pending.results[r] = (True, "{}")
        ranks[r].last_heartbeat = now
    assert now - ranks[2].last_heartbeat > CFG.heartbeat_timeout_s < CFG.action_timeout_s
    assert gone_ranks(now, st, CFG) == {}
    d = decide(now, st, CFG)
    assert d.action is ActionKind.NOOP and "waiting for ranks [2]" in d.reason, d
    late = sent + CFG.action_timeout_s + 1
    assert "no heartbeat" in gone_ranks(late, st, CFG)[2]
    d = decide(late, st, CFG)
    assert d.action is ActionKind.STOP_ALL and d.next_phase is Phase.STOPPING, d
    st.pending.results[2] = (True, "{}")  # answered: judged by its heartbeats as any rank
    assert 2 in gone_ranks(now, st, CFG)
    del st.pending.results[2]
    kill(ranks, 2)  # its process died: the connection closed
    assert gone_ranks(now, st, CFG) == {2: "killed"}
    assert decide(now, st, CFG).next_phase is Phase.STOPPING


def test_uce_without_repair_flag_goes_straight_to_the_dying_checkpoint():
    ranks = cluster(1, 1, 4, 2)
    ranks[1].fault, ranks[1].failed_at = UCE, 0.5
    d = decide(1.0, _state(ranks), dataclasses.replace(CFG, hbm_repair=False))
    assert d.action is ActionKind.STOP_ALL and d.next_phase is Phase.STOPPING and not d.params.get("recover")


def test_decide_rolls_forward_a_fault_inside_the_update():
    """Round 1 ends once every rank is inside the update of 6 and the only one still
    UPDATING is the faulty one; a non-faulty rank still UPDATING is waited for."""
    ranks = cluster(1, 2, 2, 2, it=6)
    st = _state(ranks, Phase.RECOVERING)
    st.phase_since = 1.0
    st.record_fault(0.5, 0, UCE, "uce")
    for r, info in ranks.items():
        info.stopped, info.step = True, 6
    ranks[0].status, ranks[0].fault, ranks[0].fault_where = UP, UCE, "update"
    ranks[2].status = UP  # still computing its update (no fault): wait for it
    assert decide(1.1, st, CFG).action is ActionKind.NOOP
    ranks[2].status = U
    d = decide(1.2, st, CFG)
    assert d.action is ActionKind.STOP_ALL and d.params["recover"], d
    st.abort_sent_at = 1.2
    for r, info in ranks.items():
        info.fault = info.fault or A
        info.fault_where = "update" if r == 0 else "update_done"
        info.fault_iteration = 6
    d = decide(1.3, st, CFG)
    assert d.action is ActionKind.RETRY and d.params["mode"] == "forward" and d.params["iteration"] == 6, d
    assert d.params["repairs"] == [[0, 1]]
    st.pending = PendingAction(1, "retry", d.targets, 1.3, dict(d.params))
    for r in ranks:
        st.pending.results[r] = (True, "{}")
    d = decide(1.4, st, CFG)
    assert d.action is ActionKind.RESUME and "goes on with iteration 6 after its optimizer update" in d.reason


# --------------------------------------------------------------------------- ARF rejoin
def _restarted(ranks, r, incarnation=1):
    info = ranks[r]
    info.fault, info.fault_where, info.incarnation = FaultKind.PROCESS, "rejoin", incarnation
    info.status, info.iteration, info.fault_iteration = OptimizerStatus.UNKNOWN, -1, -1
    return ranks


@pytest.mark.parametrize("shape,dead,source", [((1, 2, 2, 2, True), 0, 1), ((1, 2, 2, 2, True), 3, 2),
                                               ((2, 1, 2, 2, True), 1, 3)], ids=["rank0", "pp_last", "tp_peer"])
def test_restarted_rank_rejoins_from_a_replica(shape, dead, source):
    tp, pp, dp, n, dist = shape
    ranks = _restarted(parked(cluster(tp, pp, dp, n, it=5, distributed=dist), {}), dead)
    plan = plan_recovery(ranks, tp * pp * dp, dead, dataclasses.replace(CFG, worker_reboot=True))
    assert isinstance(plan, RecoveryPlan) and plan.mode == "rejoin", plan
    assert plan.iteration == 5 and plan.rejoin == (dead,) and plan.repairs == {dead: source}
    assert RecoveryPlan.from_params(plan.to_params()) == plan


def test_rejoin_refused_without_the_flag_a_replica_or_survivors_in_step():
    ranks = _restarted(parked(cluster(1, 2, 2, 2, it=5), {}), 0)
    assert "--enable-worker-reboot" in plan_recovery(ranks, 4, 0, CFG).reason
    cfg = dataclasses.replace(CFG, worker_reboot=True)
    ranks = _restarted(parked(cluster(1, 2, 2, 1, it=5), {}), 0)  # no replica: every rank reloads
    plan = plan_recovery(ranks, 4, 0, cfg)
    assert (plan.mode, plan.iteration, plan.rejoin, plan.repairs) == ("reload", 5, (0,), {0: 1}), plan
    assert "no survivor with its state" in plan.reason and "periodic checkpoint" in plan.reason
    ranks = _restarted(parked(cluster(1, 2, 2, 2, it=5), {}), 0)
    ranks[2].fault_where = "update_done"  # one survivor inside the update, the others not: no situation
    assert "inside the optimizer update but rank 1 was not" in plan_recovery(ranks, 4, 0, cfg).reason
    ranks = _restarted(parked(cluster(1, 2, 2, 2, it=5), {}), 0)
    ranks[2].fault_where = "save"  # outside train_step
    assert "rejoins only a step" in plan_recovery(ranks, 4, 0, cfg).reason
    ranks = _restarted(parked(cluster(1, 2, 2, 2, it=5), {}), 0, incarnation=0)
    assert "never restarted" in plan_recovery(ranks, 4, 0, cfg).reason


def test_a_survivor_still_damaged_by_a_uce_is_never_a_rejoin_source():
    """Issue 21 item 8, the controller successor's view: TP2 DP2 N=2, node 0 (ranks 0, 1)
    lost while rank 2's UCE was being repaired from rank 0; rank 2 reports the damage still
    there (UCE), rank 3 the failed rebuild (network). Ranks 0 and 1 restarted: rank 1 gets
    its state from rank 3, but rank 0's only holder is rank 2, damaged: no rejoin copies it
    (the plan reloads the periodic checkpoint instead; before, the UCE was reported as a
    network fault and rank 0 received rank 2's damaged parameters)."""
    cfg = dataclasses.replace(CFG, worker_reboot=True)
    ranks = _restarted(_restarted(parked(cluster(2, 1, 2, 2, it=5), {2: UCE, 3: NET}), 0), 1)
    plan = plan_recovery(ranks, 4, 0, cfg)
    assert plan.mode == "reload" and "rank 0 has no survivor with its state" in plan.reason, plan
    ranks = _restarted(_restarted(parked(cluster(2, 1, 2, 2, it=5), {2: NET, 3: NET}), 0), 1)
    plan = plan_recovery(ranks, 4, 0, cfg)  # the failed rebuild alone: rank 2's state is whole
    assert plan.mode == "rejoin" and plan.repairs == {0: 2, 1: 3}, plan


# (name, shape, dead rank, survivors whose update did not finish, expected repairs or NoRecovery text)
REJOIN_FORWARD = [
    ("rank 0, TP1 PP2 DP2 N=2", (1, 2, 2, 2, True), 0, set(), {0: 1}),
    ("a TP peer, TP2 PP1 DP2 N=2", (2, 1, 2, 2, True), 1, set(), {1: 3}),
    ("DP4 N=2: its instance peer blocked in the param all-gather", (1, 1, 4, 2, True), 2, {3}, {2: 0, 3: 1}),
    ("DP4 N=2: no replica of its shard finished: reload", (1, 1, 4, 2, True), 2, {0, 3}, "reload"),
    ("no replica (N=1): reload", (1, 2, 2, 1, True), 0, {1}, "reload"),
]


@pytest.mark.parametrize("name,shape,dead,unfinished,expect", REJOIN_FORWARD, ids=[c[0] for c in REJOIN_FORWARD])
def test_restarted_inside_the_update_rolls_forward(name, shape, dead, unfinished, expect):
    """ARF, a death inside the optimizer update of j=6: every survivor is held inside it
    (commit barrier), some finished it. A survivor's pre-update state is gone once its
    update ran, so the plan rolls forward: the restarted rank (and each survivor whose update
    did not finish) gets the finished state of 6 from a survivor of its shard that finished."""
    tp, pp, dp, n, dist = shape
    ranks = _restarted(_in_update(parked(cluster(tp, pp, dp, n, it=5, distributed=dist), {}), unfinished), dead)
    plan = plan_recovery(ranks, tp * pp * dp, dead, dataclasses.replace(CFG, worker_reboot=True, hbm_repair=False))
    if expect == "reload":  # the last iteration every survivor completed: 5; 6 re-runs after the reload
        assert isinstance(plan, RecoveryPlan) and (plan.mode, plan.iteration) == ("reload", 5), plan
        assert plan.rejoin == (dead,) and plan.repairs == {dead: min(set(ranks) - {dead})}
        assert RecoveryPlan.from_params(plan.to_params()) == plan
        return
    if isinstance(expect, str):
        assert isinstance(plan, NoRecovery) and expect in plan.reason, plan
        return
    assert isinstance(plan, RecoveryPlan) and plan.mode == "forward" and plan.kind is FaultKind.PROCESS, plan
    assert plan.iteration == 6 and plan.rejoin == (dead,) and plan.repairs == expect
    for d, s in plan.repairs.items():
        assert ranks[s].fault_where == "update_done" and ranks[d].layout.shard_key == ranks[s].layout.shard_key
    assert RecoveryPlan.from_params(plan.to_params()) == plan


def test_decide_round_one_ends_at_once_when_survivors_wait_in_the_commit_barrier():
    """ARF, a death inside the update of 6: the survivors finished it (UPDATED 6, still in
    step 6: the commit barrier holds them) or wait for the dead rank in their instance's
    parameter all-gather (UPDATING 6): round 1 ends at once (no update_settle_s wait)."""
    cfg = dataclasses.replace(CFG, worker_reboot=True)
    ranks = cluster(1, 1, 4, 2, it=6)
    st = _state(ranks, Phase.RECOVERING)
    st.phase_since = 1.0
    st.record_fault(0.5, 2, FaultKind.PROCESS, "died")
    st.rejoin_wait[2] = 0.5
    for info in ranks.values():
        info.stopped, info.step = True, 6
    ranks[2].status = ranks[3].status = UP  # rank 3: the dead rank's instance peer
    d = decide(1.1, st, cfg)
    assert d.action is ActionKind.STOP_ALL and d.params["recover"] and d.targets == (0, 1, 3), d
    ranks[3].layout = ranks[1].layout  # UPDATING without a dead peer: may still finish, waited for
    assert decide(1.1, st, cfg).action is ActionKind.NOOP


def test_decide_waits_for_a_restarted_rank_then_rejoins_it():
    """ARF: a dead rank the agent restarts (rejoin_wait) starts RECOVERING, not the dying
    checkpoint; the survivors go through the usual rounds; the plan waits until the new
    process (incarnation 1) is parked at its rejoin point; a restart that never comes (the
    deadline) or that the agent abandoned falls back."""
    cfg = dataclasses.replace(CFG, worker_reboot=True)
    ranks = cluster(1, 2, 2, 2)
    for info in ranks.values():
        info.stopped = False
    kill(ranks, 1)
    st = _state(ranks)
    st.rejoin_wait[1] = 0.5
    d = decide(1.0, st, cfg)
    assert d.action is ActionKind.STOP_ALL and d.next_phase is Phase.RECOVERING and 1 not in d.targets, d
    st.phase, st.phase_since = Phase.RECOVERING, 1.0
    st.record_fault(0.5, 1, FaultKind.PROCESS, "died")
    for r in (0, 2, 3):
        ranks[r].stopped, ranks[r].step = True, 6
    d = decide(1.1, st, cfg)
    assert d.action is ActionKind.STOP_ALL and d.params["recover"] and d.targets == (0, 2, 3), d
    st.abort_sent_at = 1.1
    parked({r: ranks[r] for r in (0, 2, 3)}, {})
    for r in (0, 2, 3):
        ranks[r].stopped = True
    assert "restarted ranks [1]" in decide(1.2, st, cfg).reason  # not registered again yet
    for r in (0, 2, 3):  # the survivors keep their heartbeats
        ranks[r].last_heartbeat = 1.0 + cfg.action_timeout_s
    late = decide(1.0 + cfg.action_timeout_s, st, cfg)
    assert late.next_phase is Phase.STOPPING and "did not rejoin" in late.reason
    ranks[1] = type(ranks[0])(rank=1, layout=ranks[0].layout.__class__(**{**ranks[0].layout.__dict__, "dp_rank": 1,
                                                                         "instance_id": 1}),
                              last_heartbeat=1.25, incarnation=1, rejoins=True)
    _restarted(ranks, 1)
    ranks[1].stopped = True
    d = decide(1.3, st, cfg)
    assert d.action is ActionKind.RETRY and d.params["mode"] == "rejoin" and d.targets == (0, 1, 2, 3), d
    assert d.params["rejoin"] == [1] and d.params["repairs"] == [[1, 0]]
    st.rejoin_wait.clear()  # the agent abandoned it before it came back: no waiting
    kill(ranks, 1)
    assert decide(1.4, st, cfg).next_phase is Phase.STOPPING


def test_round_one_does_not_wait_for_an_instance_peer_blocked_in_the_all_gather():
    """DP4 with 2 replicas: rank 0 faults inside its update; rank 1, its optimizer-instance
    peer, waits for it in the parameter all-gather for good (UPDATING, no fault of its own):
    round 1 ends at once. A non-faulty rank of the other instance still UPDATING (computing)
    is waited for."""
    ranks = cluster(1, 1, 4, 2, it=6)
    st = _state(ranks, Phase.RECOVERING)
    st.phase_since = 1.0
    st.record_fault(0.5, 0, UCE, "uce")
    for info in ranks.values():
        info.stopped, info.step = True, 6
    ranks[0].status, ranks[0].fault, ranks[0].fault_where = UP, UCE, "update"
    ranks[1].status = UP
    ranks[2].status = UP  # other instance, still computing
    assert decide(1.1, st, CFG).action is ActionKind.NOOP
    ranks[2].status = U
    d = decide(1.1, st, CFG)
    assert d.action is ActionKind.STOP_ALL and d.params["recover"], d


def test_reason_names_a_rank_with_the_plan_kind():
    """A network error on rank 0 first, a UCE on rank 1: the plan is a UCE repair and says
    so of rank 1 (found by a fresh-eyes test: it named rank 0's as the UCE)."""
    ranks = parked(cluster(1, 1, 4, 2), {0: NET, 1: UCE})
    plan = plan_recovery(ranks, 4, 0, CFG)
    assert isinstance(plan, RecoveryPlan) and plan.kind is UCE and plan.fault_rank == 1, plan
    assert plan.reason.startswith("uce fault on rank 1")


def test_decide_waits_when_every_rank_is_being_restarted():
    """ARF: every rank died at once and is being restarted (found with the node relay's
    first version: both nodes' workers failed at start-up): round 1 has no survivor to
    observe; the decision waits (it raised StopIteration in every turn before)."""
    cfg = dataclasses.replace(CFG, worker_reboot=True)
    ranks = cluster(1, 1, 4, 2)
    st = _state(ranks, Phase.RECOVERING)
    st.phase_since = 1.0
    st.record_fault(0.5, 0, FaultKind.PROCESS, "died")
    for r in ranks:
        kill(ranks, r)
        st.rejoin_wait[r] = 0.5
    d = decide(1.1, st, cfg)
    assert d.action is ActionKind.NOOP and "no survivor" in d.reason, d
