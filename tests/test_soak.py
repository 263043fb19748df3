"""Recovery that lasts: a hundred faults of mixed kinds in one 4-rank job.

The soak test (``mindspeed-ha soak``, :mod:`mindspeed_ha.testing.soak`): one job of real
megatron-core on 4 gloo ranks through ``mindspeed-ha-run`` meets 100 faults, one per
iteration, drawn with a fixed seed (UCE, network error, SIGKILL, SIGSTOP, on random ranks
and points). Every one must be recovered in the running job (in place; a killed or hung
process restarted alone, ARF), the job exits 0, its losses equal the uninterrupted run's
bit for bit; every process's RSS stays within 5 % over the second half of its recoveries,
and its fds and threads within 2 % of their value after its first recovery, with no
allowance (rebuilt groups take pooled gloo devices: mindspeed_ha/recovery/gloo_devices.py).
The units below pin the schedule and the resource check, so that the long run asserts what
it says.
"""

import pytest

from mindspeed_ha.testing import schedule, soak


def test_schedule_is_seeded_and_targets_the_process_each_fault_is_meant_for():
    a = schedule.random_schedule(5, 40, 4, pp=2, weights=soak.DEFAULT_WEIGHTS)
    assert a == schedule.random_schedule(5, 40, 4, pp=2, weights=soak.DEFAULT_WEIGHTS)
    assert [s.iteration for s in a] == list(range(2, 42))
    assert all(s.point != "tp" for s in a)  # TP1: no TP group to break
    seen = {}
    for s in a:  # a rank killed or hung before is restarted: its next spec is for the new process
        assert s.incarnation == seen.get(s.rank, 0), s
        if s.fault in ("kill", "stop"):
            seen[s.rank] = s.incarnation + 1
    parsed = [schedule.FaultSpec.parse(t) for t in schedule.inject_value(a).split(";")]
    assert parsed == a
    with pytest.raises(ValueError, match="unknown kind"):
        schedule.random_schedule(1, 3, 4, weights={"meteor": 1})
    with pytest.raises(ValueError, match="--kinds"):
        soak.parse_weights("uce=x")


def _rec(rank, pid, it, fds=140, threads=80, rss=400 << 20):
    return {"rank": rank, "pid": pid, "iteration": it, "fds": fds, "threads": threads, "rss": rss}


def test_growth_is_split_by_the_kind_of_recovery():
    recs = [_rec(0, 10, 2), _rec(0, 10, 3, fds=144, threads=82), _rec(0, 10, 4, fds=148, threads=83),
            _rec(0, 10, 5, fds=148, threads=83)]
    rows = soak.growth_by_kind(recs, {2: "uce", 3: "network", 4: "kill", 5: "hang"})
    assert rows == [{"rank": 0, "pid": 10, "in_place": {"fds": 4, "threads": 2, "count": 1},
                     "restart": {"fds": 4, "threads": 1, "count": 2}}]


def test_resource_check_sees_a_leak_and_one_retained_device():
    # flat fds, a helper thread that comes and goes, RSS settling: flat
    flat = [_rec(0, 10, it, threads=80 + it % 2, rss=(400 + min(it, 5)) << 20) for it in range(2, 22)]
    drift = soak.resource_drift(flat)
    assert len(drift) == 1 and drift[0]["fds"] == [140, 140, 140] and not soak.over_limits(drift)
    # one gloo device kept by one recovery (+4 fds, +1 thread), what the soak saw before the pool
    kept = [_rec(0, 10, it, fds=140 + 4 * (it >= 15), threads=80 + (it >= 15)) for it in range(2, 22)]
    assert [line.split(": ")[1].split()[0] for line in soak.over_limits(soak.resource_drift(kept))] == ["fds"]
    # one fd and one thread per recovery, RSS 2 MiB per recovery: leaks
    leak = [_rec(0, 10, it, fds=140 + it, threads=80 + it, rss=(400 + 2 * it) << 20) for it in range(2, 40)]
    lines = soak.over_limits(soak.resource_drift(leak))
    assert {line.split(": ")[1].split()[0] for line in lines} == {"fds", "threads", "rss"}, lines
    # a restarted process: its rejoin record (lower RSS, no iteration trained yet) is left out
    restarted = [_rec(1, 20, 2)] + [_rec(1, 21, 5, rss=300 << 20)] + [_rec(1, 21, it) for it in range(6, 12)]
    rows = {row["pid"]: row for row in soak.resource_drift(restarted)}
    assert rows[21]["first_iteration"] == 6 and not soak.over_limits(rows.values())


#: the test's mix: 1 fault in 10 restarts a process (9 with seed 2026: 5 kills, 4 hangs;
#: the CLI's default, 1 in 5, gave 20), each restart a new interpreter importing torch and
#: megatron-core (~6 CPU-seconds); the long-lived processes then see more of the 100
#: recoveries, which the resource check measures
WEIGHTS = {"uce": 9, "network": 9, "kill": 1, "hang": 1}


@pytest.mark.timeout(2400)
def test_a_hundred_mixed_faults_in_one_run(tmp_path, as_users_run):
    """The soak run's workers run as users' jobs do (workers and restarts started by
    torchrun, no fork server): the resources measured are the default path's (the
    uninterrupted run, which only gives the losses, forks its workers). Kept as the
    failing input: CI saw a restarted rank at fds 130/130/138 within 4 recoveries (two
    gloo devices of replaced groups kept alive from C++), before rebuilt groups took
    pooled devices."""
    report = soak.run_soak(100, seed=2026, weights=WEIGHTS, workdir=str(tmp_path))
    log = (tmp_path / "soak_run.log").read_text()[-8000:] if (tmp_path / "soak_run.log").exists() else ""
    assert not report["timed_out"], log
    assert report["baseline_exit"] == 0
    assert report["exit"] == 0, log
    assert set(report["by_kind"]) == {"uce", "network", "kill", "hang"}, report["by_kind"]
    # one recovery per fault, of every mode: rollback, roll forward (inside the update), rejoin (ARF)
    assert report["recoveries"] == 100, (report["recoveries"], report["recoveries_by_mode"], log)
    assert {"rollback", "forward", "rejoin"} <= set(report["recoveries_by_mode"]), report["recoveries_by_mode"]
    assert report["restarts"] == report["by_kind"]["kill"] + report["by_kind"]["hang"]
    assert report["loss_match"] == "bitwise", report["losses_differ_at"]
    # the resource check covered long-lived processes, and found them flat
    assert max(row["recoveries"] for row in report["resources"]) >= 20, report["resources"]
    assert not report["over_limits"], (report["over_limits"], report["growth"])
