"""The operator channel and the graceful pause, with an in-process controller and 4 processors.

``mindspeed-ha status | pause | resume | stop`` reach the controller over the job's CURVE
channel (a wrong key: exit 6; nobody listening: exit 5); a repeated request id answers
the first reply and acts once; the pause holds every rank after one iteration until
``resume`` or ``--max``; a pause is refused (4) outside RUNNING; a stop or a fault during
a pause ends in the checkpoint of the iteration held at (exit 75).
"""

import json
import socket
import threading

import pytest

from mindspeed_ha import cli
from mindspeed_ha.control import operator, wire
from mindspeed_ha.control.operator_desk import REFUSED
from mindspeed_ha.control.policy import ActionKind
from mindspeed_ha.control.state import OptimizerStatus, Phase
from mindspeed_ha.errors import ProcessorExited
from mindspeed_ha.faults import EXIT_DYING_CHECKPOINT_SAVED

from test_control import KEY, WORLD, _wait_for, closing, job, no_leaks  # noqa: F401 (fixtures)


def _ask(j, verb, key=KEY, **kw):
    kw.setdefault("timeout_s", 20.0)
    return operator.request(verb, key=key, target=operator.Target("127.0.0.1", j.ctl.port), env={}, **kw)


def _running(j, closing):
    """Every rank trains until the test ends (pause point, update, a short step time)."""
    end = threading.Event()

    def train(p):
        k = 0
        try:
            while not end.is_set():
                p.pause_point(k)
                k += 1
                p.begin_update(k)
                p.end_update(k)
                end.wait(0.005)  # a step takes time (the loop is not a synchronisation)
        except ProcessorExited:
            pass

    for p in j.procs:
        t = threading.Thread(target=train, args=(p,), daemon=True)
        t.start()
        closing.callback(t.join, 10)
    closing.callback(end.set)


def test_pause_holds_every_rank_at_one_iteration_and_resume_is_idempotent(job, closing):
    j = job()
    _running(j, closing)
    _wait_for(lambda: all(i.iteration >= 3 for i in j.ctl.state.ranks.values()), what="iteration 3")
    reply = _ask(j, "pause", request_id="p1")
    assert reply.code == 0, reply
    k = reply.result["iteration"]
    st = _ask(j, "status").result
    assert st["phase"] == "paused" and st["pause"]["iteration"] == k
    assert {r["iteration"] for r in st["ranks"]} == {k} and {r["optimizer"] for r in st["ranks"]} == {"updated"}
    assert st["by_state"]["healthy"] == list(range(WORLD))
    for p in j.procs:
        assert p.status() == (OptimizerStatus.UPDATED, k)
    assert _ask(j, "pause", request_id="p1") == reply  # a repeat: the first reply, no second pause
    assert _ask(j, "pause").code == REFUSED  # a new pause while paused
    first = _ask(j, "resume", request_id="r1")
    assert first.code == 0
    _wait_for(lambda: j.ctl.phase is Phase.RUNNING, what="RUNNING")
    assert _ask(j, "resume", request_id="r1") == first  # repeated: same answer, acted once
    assert [e.action for e in j.ctl.events].count(ActionKind.RELEASE) == 1
    again = _ask(j, "resume")
    assert again.code == REFUSED and "not paused" in again.detail
    typed = [e for e in j.ctl.recorder.events() if e.name in ("PauseRequested", "Paused", "Resumed")]
    assert [e.name for e in typed] == ["PauseRequested", "Paused", "Resumed"], typed  # the events file's types
    assert typed[1].iteration == k and typed[2].detail["phase_seconds"]["pause"] > 0
    _wait_for(lambda: all(i.iteration > k for i in j.ctl.state.ranks.values()), what="training after resume")


def test_pause_max_resumes_by_itself(job, closing):
    j = job()
    _running(j, closing)
    reply = _ask(j, "pause", max_s=0.2)
    assert reply.code == 0
    _wait_for(lambda: j.ctl.phase is Phase.RUNNING, what="auto resume")
    pauses = _ask(j, "status").result["pauses"]
    assert pauses[-1]["iteration"] == reply.result["iteration"] and pauses[-1]["held_seconds"] >= 0.2
    k = reply.result["iteration"]
    _wait_for(lambda: all(i.iteration > k for i in j.ctl.state.ranks.values()), what="training after --max")


def test_stop_while_paused_saves_the_iteration_held_at(job, closing):
    j = job()
    _running(j, closing)
    k = _ask(j, "pause").result["iteration"]
    assert _ask(j, "stop").code == 0
    out = j.ctl.wait_done(20)
    assert out is not None and out.exit_code == EXIT_DYING_CHECKPOINT_SAVED and out.iteration == k, out


def test_pause_max_then_stop_saves_the_iteration_held_at(job, closing):
    j = job()
    _running(j, closing)
    k = _ask(j, "pause", max_s=0.2, then_stop=True).result["iteration"]
    out = j.ctl.wait_done(20)
    assert out is not None and out.exit_code == EXIT_DYING_CHECKPOINT_SAVED and out.iteration == k, out


def test_a_fault_during_a_pause_is_handled(job, closing):
    """A rank's process vanishes while every rank holds at K: the dying checkpoint of K (75)."""
    j = job()
    _running(j, closing)
    k = _ask(j, "pause").result["iteration"]
    j.procs[1].close(None)  # no GOODBYE: the connection closes, as when the process is killed
    closing.callback(j.procs[1]._proto.on_release, wire.Release("test over"))  # its paused thread ends
    out = j.ctl.wait_done(20)
    assert out is not None and out.exit_code == EXIT_DYING_CHECKPOINT_SAVED, out
    assert out.iteration == k and out.fault_rank == 1


def test_refusals_and_failures_have_their_codes(job, closing):
    j = job()
    _running(j, closing)
    with j.ctl._lock:  # a recovery under way (the phase is all the verbs read)
        j.ctl.state.phase = Phase.RECOVERING
    try:
        r = _ask(j, "pause")
        assert r.code == REFUSED and "recovering" in r.detail
    finally:
        with j.ctl._lock:
            j.ctl.state.phase = Phase.RUNNING
    assert _ask(j, "frobnicate").code == REFUSED
    with pytest.raises(operator.OperatorError) as exc:
        _ask(j, "status", key=b"w" * 32, timeout_s=10.0)
    assert exc.value.code == operator.EXIT_AUTH
    assert j.ctl.phase is Phase.RUNNING and not j.ctl.state.fault  # the job did not notice
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    with pytest.raises(operator.OperatorError) as exc:
        operator.request("status", key=KEY, target=operator.Target("127.0.0.1", dead_port), timeout_s=0.3, env={})
    assert exc.value.code == operator.EXIT_UNREACHABLE


def test_cli_verbs_json_and_usage_codes(job, closing, monkeypatch, capsys):
    j = job()
    monkeypatch.setenv("MINDSPEED_HA_AUTH_KEY", KEY.hex())
    addr = ["--addr", f"127.0.0.1:{j.ctl.port}"]
    assert cli.main(["status", "--json", *addr]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["code"] == 0 and out["result"]["phase"] == "running" and out["result"]["world_size"] == WORLD
    assert cli.main(["status", *addr]) == 0
    assert "job phase running" in capsys.readouterr().out
    assert cli.main(["resume", "--json", *addr]) == 4
    assert json.loads(capsys.readouterr().out)["code"] == 4
    assert cli.main(["pause", "--max", "-1", *addr]) == 2
    assert cli.main(["pause", "--then-stop", *addr]) == 2
    assert cli.main(["status", "--timeout", "0", *addr]) == 2
    assert cli.main(["status", "--addr", "nohost"]) == 2
    monkeypatch.delenv("MINDSPEED_HA_AUTH_KEY")
    assert cli.main(["status", *addr]) == 2
    capsys.readouterr()


def test_operator_frames_are_checked_like_any_peer(closing):
    """An OPERATOR_REQUEST of another schema, or unexpected fields, is rejected by the codec."""
    codec = wire.Codec(KEY, "operator-x")
    frame = codec.encode(wire.OperatorRequest("id", "status"))
    rx = wire.Codec(KEY, "controller")
    assert rx.decode(frame).body == wire.OperatorRequest("id", "status")
    with pytest.raises(wire.WireError):
        wire.Codec(b"k" * 32, "controller").decode(frame)
    assert wire.SCHEMA_VERSION >= 8  # OPERATOR_REQUEST / REPLY exist since schema 8


def test_the_client_follows_the_leader_of_the_lease_directory(job, tmp_path):
    """After a controller failover the CLI asks the leader of the highest term, as ranks do:
    a request aimed at term 0's (gone) controller goes to term 1's, same request id."""
    from mindspeed_ha.control.lease import LeaseDir, Term, lease_dir

    j = job()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = s.getsockname()[1]
    env = {"MINDSPEED_HA_LEASE_DIR": str(tmp_path / "lease")}
    lease = LeaseDir(env["MINDSPEED_HA_LEASE_DIR"], KEY)
    assert lease.take(Term(0, "127.0.0.1", gone, 0, 0, 1))
    first = operator.find_controller(None, KEY, env)
    assert (first.port, first.term) == (gone, 0)
    assert lease.take(Term(1, "127.0.0.1", j.ctl.port, 0, 1, 2))  # node 1 took over
    reply = operator.request("status", key=KEY, target=first, timeout_s=20.0, env=env, request_id="s1")
    assert reply.code == 0 and reply.request_id == "s1" and reply.result["world_size"] == WORLD
    assert operator.find_controller(None, KEY, env).port == j.ctl.port
    assert operator.find_controller(f"127.0.0.1:{gone}", KEY, env).port == gone  # --addr wins
    root = {"MINDSPEED_HA_LEASE_ROOT": str(tmp_path / "root")}  # what the launchers get
    LeaseDir(lease_dir(root["MINDSPEED_HA_LEASE_ROOT"], KEY), KEY).take(Term(3, "127.0.0.1", j.ctl.port, 0, 1, 2))
    assert operator.find_controller(None, KEY, root).term == 3


def test_status_lists_the_warm_spare_the_launcher_reports(job):
    """The agent's warm spare reaches ``status`` through the launcher's hooks (Survivors)."""
    from mindspeed_ha.launch.survivors import Survivors

    j = job()
    assert _ask(j, "status").result["spares"] is None  # nothing reported: not known
    hooks = Survivors(j.ctl, grace_s=1.0)
    hooks.spare_changed(4242)
    assert [s["pid"] for s in _ask(j, "status").result["spares"]] == [4242]
    hooks.spare_changed(None)  # adopted by a restarted worker
    assert _ask(j, "status").result["spares"] == []


# --------------------------------------------------------------------------- the pause plan (pure)
def _cfg():
    import dataclasses

    from test_control import CFG

    return dataclasses.replace(CFG, heartbeat_timeout_s=100.0)  # no silence within these instants


def _paused_state(phase, **kw):
    from mindspeed_ha.control.state import ClusterState, PauseRequest
    from test_policy import cluster

    st = ClusterState(world_size=4, ranks=cluster(1, 2, 2, 2, it=7), phase=phase, phase_since=10.0, drain_until=7,
                      pause=PauseRequest(at=9.0, **kw))
    for info in st.ranks.values():
        info.last_heartbeat = 10.0
    return st


@pytest.mark.parametrize("case,now,expect", [
    ("held", 11.0, (ActionKind.NOOP, None)),
    ("max passed", 12.5, (ActionKind.RELEASE, Phase.RUNNING)),
    ("max passed, then stop", 12.5, (ActionKind.NOOP, Phase.DRAINING)),
    ("resume", 11.0, (ActionKind.RELEASE, Phase.RUNNING)),
    ("stop", 11.0, (ActionKind.NOOP, Phase.DRAINING)),
    ("a rank died", 11.0, (ActionKind.STOP_ALL, Phase.STOPPING)),
])
def test_paused_decisions(case, now, expect):
    from mindspeed_ha.control.policy import decide
    from mindspeed_ha.control.state import StopRequest

    CFG = _cfg()
    st = _paused_state(Phase.PAUSED, max_s=2.0, then_stop=case.endswith("then stop"))
    if case == "resume":
        st.pause.resume_at = 10.5
    elif case == "stop":
        st.stop_request = StopRequest(10.5, -1, "operator")
    elif case == "a rank died":
        st.ranks[2].alive, st.ranks[2].dead_reason, st.ranks[2].failed_at = False, "killed", 10.5
    d = decide(now, st, CFG)
    assert (d.action, d.next_phase) == expect, d
    if d.action is ActionKind.RELEASE:
        assert d.targets == (0, 1, 2, 3)


def test_a_pause_that_does_not_come_is_released_with_a_reason():
    from mindspeed_ha.control.policy import decide
    from mindspeed_ha.control.policy.pause import PAUSE_FAILED

    CFG = _cfg()
    st = _paused_state(Phase.PAUSING)
    st.ranks[3].stopped = False  # never reached the agreed iteration
    assert decide(10.0 + CFG.stop_timeout_s / 2, st, CFG).action is ActionKind.NOOP
    d = decide(9.0 + CFG.stop_timeout_s + 0.1, st, CFG)
    assert d.action is ActionKind.RELEASE and d.next_phase is Phase.RUNNING and PAUSE_FAILED in d.reason
    st.ranks[3].stopped = True
    assert decide(11.0, st, CFG).next_phase is Phase.PAUSED


@pytest.mark.parametrize("first,k", [(7, 8), (0, 1)], ids=["after_load", "fresh"])
def test_a_pause_before_any_iteration_agrees_on_the_first_one_the_ranks_run(first, k):
    """No rank started an iteration when the pause came (every rank announced -1): each
    holds at its first pause point (the loop's start: the iteration loaded, or 0) and says
    where; K is the next one (a job that loaded iteration 7 pauses after 8, not after 1,
    which it never reaches)."""
    from mindspeed_ha.control.policy import decide

    CFG = _cfg()
    st = _paused_state(Phase.PAUSING)
    st.drain_until = None
    for info in st.ranks.values():
        info.pause_at, info.stopped = -1, False
    d = decide(11.0, st, CFG)
    assert d.action is ActionKind.NOOP and "first pause point" in d.reason, d
    for r in range(3):
        st.ranks[r].paused_after = first
    assert decide(11.0, st, CFG).action is ActionKind.NOOP  # rank 3 has not said yet
    st.ranks[3].paused_after = first
    d = decide(11.0, st, CFG)
    assert d.action is ActionKind.PAUSE and d.params["until"] == k and d.targets == (0, 1, 2, 3), d


def test_a_pending_request_outlives_newer_answered_ones():
    """The desk keeps the last KEEP_REQUESTS requests, but never drops a pending one for newer
    answered ones: a switch of a minute while a monitor polls ``status`` four times a second
    lost its reply (tests/test_switch_job.py's node switch held 75 s, 2026-12-05)."""
    from mindspeed_ha.control import operator_desk
    from mindspeed_ha.control import wire as w

    desk = operator_desk.OperatorDesk()
    desk.requests["switch-1"] = ("switch", None, [b"op"])
    for i in range(operator_desk.KEEP_REQUESTS + 10):
        desk.requests[f"status-{i}"] = ("status", w.OperatorReply(f"status-{i}", 0, "", {}), [])
        desk.trim()
    assert len(desk.requests) == operator_desk.KEEP_REQUESTS and desk.requests["switch-1"][1] is None
    assert f"status-{operator_desk.KEEP_REQUESTS + 9}" in desk.requests and "status-0" not in desk.requests
