"""mindspeed_ha.phases: the phase tables the demo and the benchmarks print (pure, no processes)."""

import json

import pytest

from mindspeed_ha import phases

REC = {"evidence_wall": 100.5, "abort_wall": 100.75, "retry_wall": 101.0,
       "ranks": {"0": {"clean": 0.25, "rebuild": 0.5, "repair": 0.125},
                 "1": {"clean": 0.5, "rebuild": 0.25, "rollback": 0.0625},
                 "2": "not a dict: a rank's error text"}}


def test_in_place_table_keys_and_numbers():
    ps = phases.in_place_phases({"recoveries": [REC]}, 100.0, 103.0)
    assert list(ps) == ["detect", "stop", "clean", "rebuild", "repair", "rollback", "first_iteration_after", "total"]
    assert ps == {"detect": 0.5, "stop": 0.5, "clean": 0.5, "rebuild": 0.5, "repair": 0.125, "rollback": 0.0625,
                  "first_iteration_after": 2.0, "total": 3.0}


def test_in_place_split_stop_replaces_stop_in_place():
    ps = phases.in_place_phases({"recoveries": [REC]}, 100.0, 103.0, split_stop=True)
    assert list(ps)[:3] == ["detect", "freeze", "abort+park+plan"] and "stop" not in ps
    assert ps["freeze"] == 0.25 and ps["abort+park+plan"] == 0.25


def test_missing_inputs_give_none_not_errors():
    assert set(phases.in_place_phases(None, None, None).values()) == {None}
    ps = phases.reboot_phases({}, 1.0, 2.5)
    assert ps.pop("total") == 1.5 and set(ps.values()) == {None}  # the logs alone give the total
    assert set(phases.dying_checkpoint_phases(None, 1.0).values()) == {None}
    ps = phases.in_place_phases({"recoveries": [{"ranks": {}}]}, 1.0, None)
    assert ps["clean"] is None and ps["total"] is None


def test_reboot_table():
    report = {"recoveries": [REC], "restarts": [{"rank": 1, "t_wall": 100.625}]}
    ps = phases.reboot_phases(report, 100.0, 103.0)
    assert list(ps) == ["detect", "restart_process", "rendezvous", "rebuild_groups", "repair", "rollback",
                        "first_iteration_after", "total"]
    assert ps == {"detect": 0.5, "restart_process": 0.125, "rendezvous": 0.375, "rebuild_groups": 0.5,
                  "repair": 0.125, "rollback": 0.0625, "first_iteration_after": 2.0, "total": 3.0}
    # the agent saw the death first: restart_process is 0 and rendezvous runs from the evidence
    early = phases.reboot_phases(dict(report, restarts=[{"t_wall": 100.25}]), 100.0, 103.0)
    assert early["restart_process"] == 0.0 and early["rendezvous"] == 0.5


def test_dying_checkpoint_table():
    report = {"phase_seconds": {"detect": 0.25, "decide": 0.5, "save": 1.0}, "fault_wall": 100.5, "exit_wall": 102.5}
    assert phases.dying_checkpoint_phases(report, 100.0) == {"detect": 0.5, "decide": 0.75, "save": 1.0,
                                                             "total": 2.5}


def test_run_logs_read(tmp_path):
    report, fired, after = tmp_path / "r.json", tmp_path / "f.jsonl", tmp_path / "a.jsonl"
    report.write_text(json.dumps({"recoveries": [REC], "restarts": []}))
    fired.write_text(json.dumps({"wall": 100.0, "pid": 42}) + "\n\n")
    after.write_text("".join(json.dumps({"rank": r, "pid": 40 + r, "iteration": 4, "wall": 102.0 + r}) + "\n"
                             for r in range(3)))
    logs = phases.RunLogs.read(str(report), str(fired), str(after), nproc=4)
    assert logs.fault_wall == 100.0 and logs.fault_pid == 42 and logs.recoveries == [REC]
    assert logs.first_after_wall is None  # 3 of 4 ranks logged
    assert phases.RunLogs.read(str(report), str(fired), str(after)).first_after_wall == 104.0
    assert logs.pids_after == {0: 40, 1: 41, 2: 42}
    empty = phases.RunLogs.read(str(tmp_path / "none.json"), str(tmp_path / "none.jsonl"))
    assert empty.report == {} and empty.fault_wall is None and empty.first_after_wall is None
    (tmp_path / "bad.jsonl").write_text("{torn")
    with pytest.raises(ValueError):
        phases.read_jsonl(str(tmp_path / "bad.jsonl"))
