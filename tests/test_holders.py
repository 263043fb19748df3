"""The parts' holder table kept at registration (control/holders.py) and the dying
checkpoint's selection reading it: the same savers as the selection that groups every
rank again (``select_by_scan``, kept as the reference), on random layouts and deaths, and
after a rank's new process (rejoin) or a hot switch's new process takes its place."""

import dataclasses
import random

import pytest

from mindspeed_ha.control.holders import HolderTable, RankTable
from mindspeed_ha.control.integrity import IntegrityReport
from mindspeed_ha.control.policy.dying import DumpPlan, select_by_scan, select_dying_checkpoint
from mindspeed_ha.control.state import ClusterState, Layout, OptimizerStatus, RankInfo
from mindspeed_ha.faults import FaultKind

STATUSES = (OptimizerStatus.UPDATED,) * 6 + (OptimizerStatus.UPDATING, OptimizerStatus.UNKNOWN)


def layout_of(r, tp, pp, dp, replicas):
    """Megatron order (tp fastest, then dp, then pp); ``replicas`` optimizer instances."""
    t, d, p = r % tp, (r // tp) % dp, r // (tp * dp)
    per = dp // replicas
    return Layout(tp_rank=t, pp_rank=p, dp_rank=d, tp_size=tp, pp_size=pp, dp_size=dp, replica_count=replicas,
                  instance_id=d // per, shard_id=d % per)


#: how far a rank's iteration is from the job's: one pattern per job (all alike, some ahead, some behind)
SPREADS = ((0,), (0, 0, 0, 1), (0, 0, 0, -1), (0, 1, -1), (0, 0, 0, 0, 1, 2))


def random_info(rng, r, lay, it, spread=(0, 0, 0, 0, 1, 2)):
    info = RankInfo(rank=r, layout=lay, stopped=rng.random() < 0.95, status=rng.choice(STATUSES),
                    iteration=it - rng.choice(spread))
    if rng.random() < 0.1:
        info.alive, info.dead_reason = False, "killed"
    if rng.random() < 0.05:
        info.fault = FaultKind.UCE
    if rng.random() < 0.5:  # some ranks verify (the integrity rule, verified=True)
        info.verifies = True
        if rng.random() < 0.9:
            bad = rng.random() < 0.05
            info.integrity = IntegrityReport(info.iteration, not bad, f"s{lay.shard_key}{rng.random() < 0.05}",
                                             True, f"m{lay.model_key}")
    return info


def random_job(rng):
    tp, pp = rng.choice((1, 2, 3)), rng.choice((1, 2))
    replicas = rng.choice((1, 2, 3))
    dp = replicas * rng.choice((1, 2, 4))
    world = tp * pp * dp
    it, spread = rng.randrange(2, 20), rng.choice(SPREADS)
    return {r: random_info(rng, r, layout_of(r, tp, pp, dp, replicas), it, spread) for r in range(world)}


def table_of(rng, infos):
    """A RankTable filled in a random order, as registrations arrive."""
    order = list(infos)
    rng.shuffle(order)
    table = RankTable()
    for r in order:
        table[r] = infos[r]
    return table


def test_same_savers_as_the_scan_on_random_layouts_and_deaths():
    rng = random.Random(19)
    plans = 0
    for _ in range(300):
        infos = random_job(rng)
        table = table_of(rng, infos)
        unavailable = {r: "silent" for r in infos if rng.random() < 0.05}
        for verified in (False, True):
            got = select_dying_checkpoint(table, unavailable, verified=verified)
            assert got == select_by_scan(dict(infos), unavailable, verified=verified)
            plans += isinstance(got, DumpPlan)
    assert plans > 100  # most cases have a plan: the table's own path is what is compared


def test_same_savers_after_rejoin_and_switch():
    """A rank's new process (worker restart, rejoin) or a hot switch's new process is a new
    RankInfo assigned to its rank: the table holds it, not the old process's."""
    rng = random.Random(7)
    for _ in range(200):
        infos = random_job(rng)
        table = table_of(rng, infos)
        select_dying_checkpoint(table, {})  # the grouping made once, then changed under it
        for r in rng.sample(sorted(infos), k=max(1, len(infos) // 4)):
            old = table[r]
            new = dataclasses.replace(old, alive=True, status=OptimizerStatus.UPDATED, iteration=old.iteration + 1,
                                      fault=None, stopped=True)
            table[r] = new
            old.alive = False  # the old process's exit is seen after the new one took the rank
            infos[r] = new
        for r in rng.sample(sorted(infos), k=len(infos) // 5):  # deaths: a field of the RankInfo held
            table[r].alive = False
        for verified in (False, True):
            assert select_dying_checkpoint(table, {}, verified=verified) == select_by_scan(dict(infos), {},
                                                                                          verified=verified)


def test_a_rejoined_rank_is_its_new_process():
    lay = [layout_of(r, 1, 1, 2, 2) for r in range(2)]
    table = RankTable({r: RankInfo(rank=r, layout=lay[r], stopped=True, status=OptimizerStatus.UPDATED,
                                   iteration=5) for r in range(2)})
    assert select_dying_checkpoint(table, {}).shard_savers == {(0, 0, 0): 0}
    table[0].alive = False
    assert select_dying_checkpoint(table, {}).shard_savers == {(0, 0, 0): 1}
    table[0] = RankInfo(rank=0, layout=lay[0], stopped=True, status=OptimizerStatus.UPDATED, iteration=5)
    assert select_dying_checkpoint(table, {}).shard_savers == {(0, 0, 0): 0}
    assert table.holders.grouped()[0] == {(0, 0, 0): [table[0], table[1]]}


def test_inconsistent_layouts_fall_back_to_the_scan_and_name_the_rank():
    lay = [layout_of(r, 2, 1, 2, 2) for r in range(4)]
    table = RankTable({r: RankInfo(rank=r, layout=lay[r], stopped=True, status=OptimizerStatus.UPDATED,
                                   iteration=3) for r in range(4)})
    assert isinstance(select_dying_checkpoint(table, {}), DumpPlan)
    table[3] = RankInfo(rank=3, layout=dataclasses.replace(lay[3], tp_size=4), stopped=True)
    assert "inconsistent layouts" in select_dying_checkpoint(table, {}).reason
    table[3] = RankInfo(rank=3, layout=dataclasses.replace(lay[3], shard_id=5), stopped=True)
    assert select_dying_checkpoint(table, {}).reason == "rank 3 reports shard (1, 0, 5) outside the layout"
    del table[3]
    assert table.holders.grouped()[0][(1, 0, 0)] == [table[1]]
    assert select_dying_checkpoint(table, {}) == select_by_scan(dict(table), {})
    assert select_dying_checkpoint(RankTable(), {}).reason == "no rank registered"


@pytest.mark.parametrize("op", ["pop", "popitem", "clear", "update", "setdefault"])
def test_every_dict_change_reaches_the_table(op):
    lay = [layout_of(r, 1, 1, 4, 2) for r in range(4)]
    table = RankTable({r: RankInfo(rank=r, layout=lay[r]) for r in range(3)})
    new = RankInfo(rank=3, layout=lay[3])
    {"pop": lambda: table.pop(1), "popitem": table.popitem, "clear": table.clear,
     "update": lambda: table.update({3: new}), "setdefault": lambda: table.setdefault(3, new)}[op]()
    rebuilt = HolderTable()
    for info in table.values():
        rebuilt.put(info)
    assert table.holders.grouped() == rebuilt.grouped()
    assert len(table.holders) == len(table)


def test_the_controller_state_keeps_a_table():
    assert isinstance(ClusterState(world_size=4).ranks, RankTable)
