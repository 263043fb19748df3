"""The hot switch's controller side with an in-process controller and 4 processors:
``mindspeed-ha switch --ranks R`` is refused with a reason when it cannot start, and a
switch that fails before its commit point (its spare dies, READY never comes) returns to
training on the old ranks: the pause it took is released, no rank is restarted, the
operator's reply (code 1) says why and gives the phase seconds; the events record it."""

import dataclasses
import json
import socket
import threading

import pytest

from mindspeed_ha import cli
from mindspeed_ha.control.operator_desk import FAILED, REFUSED, VERBS
from mindspeed_ha.control import wire
from mindspeed_ha.control.state import Phase

from test_control import CFG, KEY, _wait_for, closing, job, no_leaks  # noqa: F401 (fixtures)
from test_operator import _ask, _running

ARF = dataclasses.replace(CFG, worker_reboot=True, connect_timeout_s=3.0)


def _ready_job(job, closing, spare=True):
    j = job(cfg=ARF)
    _running(j, closing)
    _wait_for(lambda: len(j.ctl.state.ranks) == 4 and all(i.iteration >= 2 for i in j.ctl.state.ranks.values()),
              what="iteration 2")
    with j.ctl._lock:
        for info in j.ctl.state.ranks.values():
            info.rejoins = True  # what a runtime with --enable-worker-reboot registers
        if spare:
            j.ctl.spares = [{"host": "h", "pid": 4242}]  # what the launcher's agent reports
    return j


def _switch_in_thread(j, closing, rid, ranks=(1,)):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("reply", _ask(j, "switch", params={"ranks": list(ranks)},
                                                                      request_id=rid, timeout_s=30.0)))
    t.start()
    closing.callback(t.join, 30)
    _wait_for(lambda: j.ctl.operators.switches.current is not None, what="the switch recorded")
    return t, out


def _iterations(j):
    with j.ctl._lock:
        return {r: i.iteration for r, i in j.ctl.state.ranks.items()}


def test_refusals_have_a_reason_and_change_nothing(job, closing, monkeypatch, capsys):
    j = _ready_job(job, closing, spare=False)
    r = _ask(j, "switch", params={"ranks": [1]})
    assert r.code == REFUSED and "no spare" in r.detail, r
    with j.ctl._lock:
        j.ctl.spares = [{"host": "h", "pid": 4242}]
    assert "outside the job's ranks" in _ask(j, "switch", params={"ranks": [7]}).detail
    monkeypatch.setenv("MINDSPEED_HA_AUTH_KEY", KEY.hex())
    addr = ["--addr", f"127.0.0.1:{j.ctl.port}"]
    for bad in ("1,x", "-1"):  # usage: not a list of ranks >= 0
        with pytest.raises(SystemExit) as exc:
            cli.main(["switch", "--ranks", bad, *addr])
        assert exc.value.code == 2, bad
    assert cli.main(["switch", "--json", "--ranks", "4", *addr]) == REFUSED
    assert "outside" in json.loads(capsys.readouterr().out)["detail"]
    assert j.ctl.phase is Phase.RUNNING and j.ctl.operators.switches.current is None
    assert not j.ctl.recorder.events("SwitchRequested")


def test_spare_dies_before_the_commit_point_training_goes_on(job, closing):
    """One of two spares READY, the other dies -> abandoned, code 1 with the reason; the ranks
    never paused and train on."""
    j = _ready_job(job, closing)
    with j.ctl._lock:
        j.ctl.spares.append({"host": "h", "pid": 4243})
    t, out = _switch_in_thread(j, closing, "sw1", ranks=(0, 1))
    assert _ask(j, "switch", params={"ranks": [2]}).detail.endswith("one switch at a time)")
    desk = j.ctl.operators.switches
    with j.ctl._lock:
        assert desk.spare_ready(j.ctl, j.ctl.clock(), 1, 999)
        assert not desk.spare_ready(j.ctl, j.ctl.clock(), 2, 998)  # not a switched rank
        assert desk.wanted() == {0: ("sw1", 0)}
        desk.spare_gone(0, "the spare process was killed (SIGKILL)")
    held = _iterations(j)
    t.join(30)
    reply = out["reply"]
    assert reply.code == FAILED and "spare died before the commit point" in reply.detail, reply
    assert "SIGKILL" in reply.detail and reply.result["phase"] == "aborted" and reply.result["spares"] == {"1": 999}
    _wait_for(lambda: j.ctl.phase is Phase.RUNNING and all(i > held[r] for r, i in _iterations(j).items()),
              what="training after the abandoned switch")
    assert not j.ctl.operators.pauses  # never paused
    assert [e.name for e in j.ctl.recorder.events() if e.name.startswith("Switch")] == \
        ["SwitchRequested", "SwitchAborted"]
    assert _ask(j, "switch", request_id="sw1").code == FAILED  # a repeat gets the kept reply
    status = _ask(j, "status").result
    assert status["switches"][-1]["phase"] == "aborted" and status["phase"] == "running"


def test_ready_never_comes_training_goes_on(job, closing):
    j = _ready_job(job, closing)
    t, out = _switch_in_thread(j, closing, "sw2", ranks=(0,))
    t.join(30)
    reply = out["reply"]
    assert reply.code == FAILED and f"not READY within {ARF.connect_timeout_s:g} s" in reply.detail, reply
    assert j.ctl.phase is Phase.RUNNING and j.ctl.state.pause is None  # the pause was never asked
    assert not j.ctl.arbiter.restarts


def test_the_verb_is_callable_inside_the_controller(job, closing):
    """A policy of the controller (e.g. a sub-health action) calls the verb with the ranks."""
    j = _ready_job(job, closing, spare=False)
    with j.ctl._lock:
        reply = VERBS["switch"](j.ctl, j.ctl.clock(), wire.OperatorRequest("internal-1", "switch", params={"ranks": [3]}))
    assert reply is not None and reply.code == REFUSED and "no spare" in reply.detail


def test_the_controllers_own_switch_names_its_reason(job, closing):
    """The sub-health detector's ``switch`` (operator_desk.internal_request): the switch
    starts, its SwitchRequested event carries the detector's reason, not ``operator``."""
    from mindspeed_ha.control.operator_desk import internal_request

    j = _ready_job(job, closing)
    with j.ctl._lock:
        ok, detail = internal_request(j.ctl, j.ctl.clock(), "switch", [3], "sub-health: rank 3: step slow")
    assert ok and detail == "switch under way (request internal-1)", detail
    (requested,) = j.ctl.recorder.events("SwitchRequested")
    assert list(requested.detail["ranks"]) == [3], requested
    assert requested.detail["reason"] == "sub-health: rank 3: step slow", requested
    _wait_for(lambda: j.ctl.operators.switches.current is None, what="the switch given up (no READY spare)")


def test_a_whole_node_in_one_switch(job, closing, monkeypatch, capsys):
    """``switch --node HOST``: every rank registered from HOST in one switch (one pause, one
    plan); its one warm spare is enough (the other new processes start cold); an unknown
    host, or --node with --ranks, is refused with the reason; the CLI wants exactly one."""
    j = _ready_job(job, closing)
    host = j.ctl.state.ranks[0].host
    r = _ask(j, "switch", params={"node": "no-such-host"})
    assert r.code == REFUSED and "--node 'no-such-host': no rank registered from it" in r.detail, r
    assert host in r.detail
    r = _ask(j, "switch", params={"node": host, "ranks": [1]})
    assert r.code == REFUSED and "not both" in r.detail, r
    monkeypatch.setenv("MINDSPEED_HA_AUTH_KEY", KEY.hex())
    addr = ["--addr", f"127.0.0.1:{j.ctl.port}"]
    for flags in ([], ["--ranks", "1", "--node", host]):
        assert cli.main(["switch", "--json", *flags, *addr]) == 2, flags
        assert "exactly one of --ranks" in json.loads(capsys.readouterr().out)["detail"]
    assert not j.ctl.recorder.events("SwitchRequested")

    out = {}
    t = threading.Thread(target=lambda: out.setdefault("reply", _ask(j, "switch", params={"node": host},
                                                                      request_id="node1", timeout_s=30.0)))
    t.start()
    closing.callback(t.join, 30)
    _wait_for(lambda: j.ctl.operators.switches.current is not None, what="the switch recorded")
    desk = j.ctl.operators.switches
    with j.ctl._lock:
        ranks, wanted = desk.current.ranks, desk.agent_wanted()
        desk.spare_gone(2, "its new process exited with 1")
    assert ranks == (0, 1, 2, 3) and wanted == {0: "start", 1: "start", 2: "start", 3: "start"}
    (requested,) = j.ctl.recorder.events("SwitchRequested")
    assert list(requested.detail["ranks"]) == [0, 1, 2, 3] and requested.detail["detail"]["node"] == host
    t.join(30)
    reply = out["reply"]
    assert reply.code == FAILED and "rank 2: its new process exited with 1" in reply.detail, reply
    assert desk.agent_wanted() == {} and j.ctl.phase is Phase.RUNNING


def test_another_nodes_agent_gets_its_ranks_view_and_reports_over_its_link(job, closing):
    """Ranks 2 and 3 on another node: its agent link reports that node's warm spare (a switch
    of rank 1, whose node has none, is refused), gets SWITCH_VIEW ``start`` for rank 3,
    reports the new process started (its view says ``keep``) then gone: the switch is
    abandoned with that reason and the view empties."""
    from mindspeed_ha.control.agent_link import AgentLink

    j = _ready_job(job, closing, spare=False)
    link = AgentLink(dataclasses.replace(ARF, controller_addr="127.0.0.1", controller_port=j.ctl.port), 1,
                     timeout_s=5.0)
    closing.callback(link.close)
    link.ranks = [2, 3]  # what AGENT_HELLO set (the ranks are alive here: no hello)
    link.report_spare(5555)
    _wait_for(lambda: j.ctl.operators.switches.remote_spares, what="the other node's spare")
    with j.ctl._lock:
        j.ctl.arbiter.agent_of[3] = j.ctl.arbiter.agent_of[2]  # a report for rank 3 would map it too
        (node,) = j.ctl.operators.switches.remote_spares
    assert node.startswith("agent a1-")
    status = _ask(j, "status").result
    assert status["spares"] == [{"host": socket.gethostname(), "pid": 5555, "node": node}]
    r = _ask(j, "switch", params={"ranks": [1]})
    assert r.code == REFUSED and "no spare parked on the node of ranks [1]" in r.detail, r

    t, out = _switch_in_thread(j, closing, "remote1", ranks=(3,))
    _wait_for(lambda: link.switch_view() == {3: "start"}, what="SWITCH_VIEW start")
    link.report_switch("started", 3, 4321)
    assert link.switch_view() == {3: "keep"}  # at once: a start already reported
    _wait_for(lambda: _ask(j, "status").result["switches"][-1]["started"] == {"3": 4321}, what="started reported")
    link.report_switch("gone", 3, "its new process (pid 4321) exited with -9")
    t.join(30)
    reply = out["reply"]
    assert reply.code == FAILED and "exited with -9" in reply.detail, reply
    _wait_for(lambda: link.switch_view() == {}, what="the emptied view")
    assert j.ctl.phase is Phase.RUNNING and not j.ctl.arbiter.restarts
