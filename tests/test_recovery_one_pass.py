"""The in-place plan in one pass (``plan_in_place``: the ranks grouped by the fields the rules
read, the sources from the parts' holder table) gives the same plan, or the same NoRecovery
reason, as the rules applied rank by rank (``plan_in_place_by_rules``, the reference), on
random layouts, fault sets, positions, optimizer states, configurations and histories."""

import collections
import dataclasses
import random

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.holders import RankTable
from mindspeed_ha.control.policy.arf import plan_rejoin
from mindspeed_ha.control.policy.in_place import parked_states, plan_in_place_by_rules
from mindspeed_ha.control.recovery_plan import NoRecovery, RecoveryPlan, plan_recovery
from mindspeed_ha.control.state import OptimizerStatus, RankInfo, summarise_ranks
from mindspeed_ha.faults import FaultKind

from test_holders import layout_of

U, UP = OptimizerStatus.UPDATED, OptimizerStatus.UPDATING
#: faults of a rank's own, most of them recoverable in place
OWN = (FaultKind.UCE,) * 4 + (FaultKind.NETWORK,) * 3 + (FaultKind.UNKNOWN, FaultKind.PROCESS)


def by_rules(ranks, world, fault_rank, config, history):
    """``plan_recovery`` as it was before the one pass (the reference)."""
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        return NoRecovery(f"ranks {summarise_ranks(missing)} never registered")
    rejoining = {r: i for r, i in ranks.items() if i.fault_where == "rejoin"}
    if rejoining:
        return plan_rejoin(ranks, rejoining, fault_rank, config, history)
    return plan_in_place_by_rules(ranks, fault_rank, config, history)


def random_round(rng):
    """A parked job (rollback or roll forward), then a few random departures from it."""
    tp, pp, replicas = rng.choice((1, 2)), rng.choice((1, 2)), rng.choice((1, 2, 3))
    dp = replicas * rng.choice((1, 2, 4))
    world = tp * pp * dp
    k = rng.randrange(-1, 9) if rng.random() < 0.1 else rng.randrange(1, 9)
    forward = rng.random() < 0.3
    infos = {}
    for r in range(world):
        lay = layout_of(r, tp, pp, dp, replicas)
        if forward:
            done = rng.random() < 0.6
            info = RankInfo(rank=r, layout=lay, status=U if done else UP, iteration=k, stopped=True,
                            fault=FaultKind.ABORTED, fault_where="update_done" if done else "update", fault_iteration=k)
        else:
            info = RankInfo(rank=r, layout=lay, status=U, iteration=k, stopped=True, fault=FaultKind.ABORTED,
                            fault_where=rng.choice(("train_step",) * 5 + ("",)), fault_iteration=k + 1)
        infos[r] = info
    for r in rng.sample(range(world), k=min(world, rng.choice((0, 1, 1, 1, 2, 3)))):
        infos[r].fault = rng.choice(OWN)
    for _ in range(rng.choice((0,) * 6 + (1, 2))):  # departures: each makes some rule fail, or not
        info = infos[rng.choice(sorted(infos))]
        what = rng.randrange(11)
        if what == 0:
            info.alive, info.dead_reason = False, "killed"
        elif what == 1:
            info.exit_code = rng.choice((0, 1))
        elif what == 2:
            info.stopped = False
        elif what == 3:
            info.fault = None
        elif what == 4:
            info.fault_where = rng.choice(("save", "train", "update", "update_done", "train_step"))
        elif what == 5:
            info.status = rng.choice((U, UP, OptimizerStatus.UNKNOWN))
        elif what == 6:
            info.iteration += rng.choice((-1, 1))
        elif what == 7:
            info.fault_iteration = rng.choice((-1, info.fault_iteration + 1, info.fault_iteration - 1))
        elif what == 8:
            info.fault_where = "rejoin"
            info.incarnation = 1
        elif what == 9 and len(infos) > 1:
            del infos[rng.choice(sorted(infos))]  # never registered
        else:
            info.fault = FaultKind.UCE  # a second damaged holder: the part may have no source left
    config = HAConfig(enabled=True, distributed_optimizer=True, hbm_repair=rng.random() < 0.85,
                      network_retries=rng.choice((0, 1, 1, 2, 3)), worker_reboot=rng.random() < 0.3)
    history = [{"iteration": rng.choice((k, k, k - 1)), "mode": rng.choice(("rollback", "forward", "switch"))}
               for _ in range(rng.choice((0, 0, 0, 1, 2, 3)))]
    own = [r for r, i in infos.items() if i.fault not in (None, FaultKind.ABORTED)]
    fault_rank = rng.choice(own) if own and rng.random() < 0.9 else rng.randrange(world)
    return infos, world, fault_rank, config, history


def outcome(plan, *args):
    """The plan, or the exception it raised (type and text): neither raises on any round
    (a live rank's own PROCESS fault alone, with --enable-worker-reboot and no restarted
    rank, once reached ``min(named)`` of an empty list in both)."""
    try:
        return plan(*args)
    except ValueError as exc:
        return (type(exc), str(exc))


def table_of(rng, infos):
    order = list(infos)
    rng.shuffle(order)  # as registrations arrive
    table = RankTable()
    for r in order:
        table[r] = infos[r]
    return table


def test_one_pass_plan_equals_the_rules_on_random_rounds():
    rng = random.Random(19)
    outcomes = collections.Counter()
    for _ in range(1500):
        infos, world, fault_rank, config, history = random_round(rng)
        want = outcome(by_rules, dict(infos), world, fault_rank, config, history)
        got = outcome(plan_recovery, table_of(rng, infos), world, fault_rank, config, history)
        assert got == want
        assert outcome(plan_recovery, dict(infos), world, fault_rank, config, history) == want  # no table
        if isinstance(want, tuple):
            outcomes["raises"] += 1
            continue
        outcomes[want.mode.value if isinstance(want, RecoveryPlan) else _rule(want.reason)] += 1
        outcomes["process fault alone"] += isinstance(want, NoRecovery) and "reported a process fault but" in want.reason
    # every outcome is compared, plans of each mode and many reasons
    assert outcomes["rollback"] > 150 and outcomes["forward"] > 50 and outcomes["reload"] > 15, outcomes
    assert len(outcomes) > 12 and outcomes["raises"] == 0, outcomes
    assert outcomes["process fault alone"] > 0, outcomes  # the case that raised


def test_a_live_ranks_process_fault_alone_is_no_recovery_not_an_error():
    """A survivor reports a peer's death (PROCESS) with --enable-worker-reboot, but every rank
    is alive, parked, and none is restarted: NoRecovery naming it (the fall-back saves), from
    the one pass and the rules alike; this raised ValueError (``min([])``) in both."""
    infos = {r: RankInfo(rank=r, layout=layout_of(r, 1, 2, 2, 2), status=U, iteration=7, stopped=True,
                         fault=FaultKind.ABORTED, fault_where="train_step", fault_iteration=8) for r in range(4)}
    infos[2].fault = FaultKind.PROCESS
    config = HAConfig(enabled=True, distributed_optimizer=True, hbm_repair=True, worker_reboot=True)
    for got in (plan_recovery(table_of(random.Random(1), infos), 4, 2, config),
                by_rules(dict(infos), 4, 2, config, [])):
        assert isinstance(got, NoRecovery) and got.reason.startswith("ranks [2] reported a process fault"), got


def _rule(reason):
    """Which rule a NoRecovery reason comes from (its words without the numbers)."""
    return " ".join(w for w in reason.split()[:6] if not any(c.isdigit() for c in w))


def test_many_ranks_repairs_from_the_holder_table():
    """The repairs' sources from the table (the holders of a part by rank), at a size where
    the groups matter: every rank but the damaged ones in one group."""
    tp, pp, replicas, dp = 8, 2, 2, 64
    infos = {r: RankInfo(rank=r, layout=layout_of(r, tp, pp, dp, replicas), status=U, iteration=7, stopped=True,
                         fault=FaultKind.ABORTED, fault_where="train_step", fault_iteration=8)
             for r in range(tp * pp * dp)}
    for r in (5, 517, 600):
        infos[r].fault = FaultKind.UCE
    config = HAConfig(enabled=True, distributed_optimizer=True, hbm_repair=True)
    table = table_of(random.Random(3), infos)
    groups = parked_states(table)
    assert sorted(len(m) for m in groups.values()) == [3, len(infos) - 3]
    got = plan_recovery(table, len(infos), 517, config)
    assert got == by_rules(dict(infos), len(infos), 517, config, [])
    assert isinstance(got, RecoveryPlan) and set(got.repairs) == {5, 517, 600}
    # a change of a rank's process (a new RankInfo) is what the table's sources read
    table[261] = dataclasses.replace(table[261], fault=FaultKind.UCE)
    infos[261] = table[261]
    assert plan_recovery(table, len(infos), 517, config) == by_rules(dict(infos), len(infos), 517, config, [])
