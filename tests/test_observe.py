"""The job's events file, metrics and status port, with an in-process controller.

The controller is driven by hand (a fake clock and ROUTER, as tests/test_controller_events.py)
through the decisions of one in-place UCE recovery and the job's end; the events file and
the Prometheus registry must show them, in order, with the recovery's phase seconds. The
HTTP port is a real one (port 0), closed with the controller. The end-to-end run (4 ranks,
a scrape during the job) is in tests/test_in_place_recovery.py.
"""

import dataclasses
import json
import os
import re
import socket
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mindspeed_ha import cli
from mindspeed_ha.config import HAConfig, ConfigError
from mindspeed_ha.control import effects, handlers, job_events, wire
from mindspeed_ha.control.controller import Controller
from mindspeed_ha.control.metrics import JobMetrics
from mindspeed_ha.control.policy import ActionKind, Decision, RecoveryPlan
from mindspeed_ha.control.policy.decision import StopPlan
from mindspeed_ha.control.state import Phase
from mindspeed_ha.faults import FaultKind

from test_controller_events import CFG, KEY, _Clock, _two_ranks_registered


def _recover_and_end(ctl, clock):
    """STOP (UCE of rank 1, in place) -> RETRY (rollback to 2) -> both ranks recovered
    (their stage seconds) -> RESUME -> every rank said goodbye: DONE."""
    st = ctl.state
    clock.t += 1.0
    stop = StopPlan(rank=1, kind=FaultKind.UCE, at=clock.t - 0.25, in_place=True, recover=True)
    effects.apply(ctl, clock.t, Decision(ActionKind.STOP_ALL, "rank 1 reported uce fault", stop, (0, 1),
                                         Phase.RECOVERING))
    clock.t += 0.5
    plan = RecoveryPlan(2, 1, FaultKind.UCE, 1, {1: 0}, "repair rank 1 from rank 0")
    effects.apply(ctl, clock.t, Decision(ActionKind.RETRY, "recover in place", plan, (0, 1)))
    for r, rebuild in ((0, 0.125), (1, 0.25)):
        st.pending.results[r] = (True, json.dumps({"clean": 0.0625, "rebuild": rebuild, "repair": 0.5, "rank": r,
                                                   "iteration": 2, "generation": 1, "mode": "rollback"}))
        st.ranks[r].step = 3  # both entered iteration 3 before the fault
    clock.t += 1.0
    effects.apply(ctl, clock.t, Decision(ActionKind.RESUME, "every rank recovered", None, (), Phase.RUNNING))
    clock.t += 1.0
    effects.apply(ctl, clock.t, Decision(ActionKind.NOOP, "every rank said goodbye", None, (), Phase.DONE))


def test_events_file_holds_the_recovery_in_order_with_the_schema(tmp_path):
    path = str(tmp_path / "events.jsonl")
    clock = _Clock()
    ctl = _two_ranks_registered(CFG, clock, rejoins=False)
    sink = job_events.EventsFile(path, job_events.job_id(KEY), lambda: 0)
    ctl.recorder.add_sink(sink)
    _recover_and_end(ctl, clock)
    sink.close()
    lines = job_events.read(path)
    assert [e["type"] for e in lines] == ["FaultDetected", "RecoveryStarted", "RecoveryFinished", "JobExit"]
    assert all(tuple(e) == job_events.FIELDS for e in lines), lines[0]
    assert [e["seq"] for e in lines] == [1, 2, 3, 4]
    assert [e["ts"] for e in lines] == sorted(e["ts"] for e in lines)
    fault, started, finished, end = lines
    assert fault["severity"] == "Warning" and fault["ranks"] == [1] and fault["detail"]["kind"] == "uce"
    assert fault["phase_seconds"] == {"detect": 0.25}
    assert started["iteration"] == 2 and started["detail"]["mode"] == "rollback"
    assert started["detail"]["repairs"] == [[1, 0]]
    # slowest rank per stage; the controller's detect (evidence -> STOP) and total (evidence -> recovered)
    assert finished["phase_seconds"] == {"clean": 0.0625, "rebuild": 0.25, "repair": 0.5, "detect": 0.25, "abort": 0.0,
                                         "retry": 0.5, "total": 1.75}
    assert finished["detail"]["outcome"] == "recovered" and finished["detail"]["steps_lost"] == 1
    assert end["detail"]["exit_code"] == 0 and end["severity"] == "Normal"
    assert len({e["job"] for e in lines}) == 1 and len(lines[0]["job"]) == 12
    # a second writer (a successor, a rerun) appends and goes on counting
    again = job_events.EventsFile(path, "j", lambda: 1)
    again(job_events.note(ctl.recorder, "ControllerTakeover", reason="test"))  # the closed sink writes nothing
    again.close()
    last = job_events.read(path)[-1]
    assert last["seq"] == 5 and last["term"] == 1 and last["type"] == "ControllerTakeover"


def test_events_file_is_created_with_the_umask_and_never_through_a_link(tmp_path):
    old = os.umask(0o027)
    try:
        path = str(tmp_path / "e.jsonl")
        job_events.EventsFile(path, "j", lambda: 0).close()
        assert os.stat(path).st_mode & 0o777 == 0o640
    finally:
        os.umask(old)
    os.symlink(path, str(tmp_path / "link"))
    for bad, why in ((str(tmp_path / "link"), "not a regular file"), (str(tmp_path), "not a regular file"),
                     (str(tmp_path / "no" / "e.jsonl"), "does not exist")):
        with pytest.raises(ConfigError, match="--ha-events-file") as exc:
            job_events.EventsFile(bad, "j", lambda: 0)
        assert why in str(exc.value)
    with pytest.raises(ValueError, match="unknown job event type"):
        job_events.note(Controller(CFG, 1).recorder, "Recovered")


def test_config_flags_name_the_flag():
    import argparse

    for flags, match in (({"ha_metrics_addr": "not an address!"}, "--ha-metrics-addr"),  # ports: test_bad_input
                         ({"ha_events_file": ""}, "--ha-events-file")):
        with pytest.raises(ConfigError, match=match):
            HAConfig.from_args(argparse.Namespace(**flags), {})
    cfg = HAConfig.from_args(argparse.Namespace(ha_metrics_port=0, ha_events_file="x"), {})
    assert (cfg.metrics_port, cfg.metrics_addr, cfg.events_file) == (0, "127.0.0.1", "x")


def _families(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams, family, sample, **labels):
    return next(s.value for s in fams[family].samples if s.name == sample and s.labels == labels)


def test_metrics_collector_counts_the_recovery_and_reads_the_state():
    clock = _Clock()
    ctl = _two_ranks_registered(CFG, clock, rejoins=False)
    metrics = JobMetrics(ctl.status)
    ctl.recorder.add_sink(metrics)
    on_status = handlers.RANK_HANDLERS[wire.MsgType.STATUS]
    for r in (0, 1):  # UPDATED(1) at t, UPDATING(2), UPDATED(2) 0.5 s (rank 0) / 0.75 s (rank 1) later
        info = ctl.state.ranks[r]
        on_status(ctl, clock.t, r, info, wire.Status(r, "updated", 1, 1))
        on_status(ctl, clock.t + 0.1, r, info, wire.Status(r, "updating", 2, 2))
        on_status(ctl, clock.t + 0.5 + 0.25 * r, r, info, wire.Status(r, "updated", 2, 2))
    fams = _families(generate_latest(metrics.registry).decode())
    assert _value(fams, "mindspeed_ha_job_state", "mindspeed_ha_job_state", state="running") == 1
    assert _value(fams, "mindspeed_ha_ranks", "mindspeed_ha_ranks", state="healthy") == 2
    assert _value(fams, "mindspeed_ha_slowest_rank_step_seconds", "mindspeed_ha_slowest_rank_step_seconds") == 0.75
    assert _value(fams, "mindspeed_ha_iteration", "mindspeed_ha_iteration") == 2
    assert _value(fams, "mindspeed_ha_control_frames_accepted", "mindspeed_ha_control_frames_accepted_total") >= 2
    assert _value(fams, "mindspeed_ha_build_info", "mindspeed_ha_build_info", version=_version()) == 1
    _recover_and_end(ctl, clock)
    fams = _families(generate_latest(metrics.registry).decode())
    assert _value(fams, "mindspeed_ha_faults", "mindspeed_ha_faults_total", kind="uce") == 1
    assert _value(fams, "mindspeed_ha_recoveries", "mindspeed_ha_recoveries_total", mode="rollback",
                  outcome="recovered") == 1
    assert _value(fams, "mindspeed_ha_recovery_phase_seconds", "mindspeed_ha_recovery_phase_seconds_sum",
                  phase="rebuild") == 0.25
    assert _value(fams, "mindspeed_ha_recovery_duration_seconds", "mindspeed_ha_recovery_duration_seconds_count") == 1
    assert _value(fams, "mindspeed_ha_steps_lost", "mindspeed_ha_steps_lost_total") == 1
    assert _value(fams, "mindspeed_ha_job_state", "mindspeed_ha_job_state", state="done") == 1
    assert all(f.name.startswith("mindspeed_ha_") for f in fams.values())
    # the Grafana dashboard (docs/grafana_dashboard.json) asks only for series the registry exposes
    exposed = {sample.name for f in fams.values() for sample in f.samples}
    exposed |= {f.name + "_total" for f in fams.values() if f.type == "counter"}  # a labelled one not counted yet
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "grafana_dashboard.json")) as f:
        wanted = set(re.findall(r"mindspeed_ha_[a-z_]+", f.read()))
    assert wanted and wanted <= exposed, sorted(wanted - exposed)


def _version():
    from mindspeed_ha.version import __version__

    return __version__


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_status_port_serves_probes_and_pages_and_closes_with_the_controller(tmp_path):
    path = str(tmp_path / "events.jsonl")
    cfg = dataclasses.replace(CFG, metrics_port=0, events_file=path)
    ctl = Controller(cfg, 2, "127.0.0.1", 0).start()
    try:
        started = job_events.read(path)
        assert [e["type"] for e in started] == ["ControllerStarted"]
        url = started[0]["detail"]["metrics_url"]  # port 0: the file says which one
        assert url.startswith("http://127.0.0.1:")
        assert _get(url + "/healthz") == (200, "ok\n")
        code, why = _get(url + "/readyz")
        assert code == 503 and "0/2 registered" in why
        code, body = _get(url + "/status")
        s = json.loads(body)
        assert code == 200 and s["phase"] == "running" and s["ranks_by_state"]["unregistered"] == 2 and s["up"]
        code, body = _get(url + "/")
        assert code == 200 and "<h1>mindspeed-ha job" in body and "unregistered" in body
        code, body = _get(url + "/metrics")
        assert code == 200 and _value(_families(body), "mindspeed_ha_world_size", "mindspeed_ha_world_size") == 2
        req = urllib.request.Request(url + "/status", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(req, timeout=10)
        assert exc.value.code == 405
        port = int(url.rsplit(":", 1)[1])
    finally:
        ctl.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert not any(t.name in ("mindspeed-ha-http", "mindspeed-ha-events") for t in threading.enumerate())


def test_metrics_port_in_use_is_an_error_naming_the_flag(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = dataclasses.replace(CFG, metrics_port=busy.getsockname()[1])
        ctl = Controller(cfg, 1, "127.0.0.1", 0)
        with pytest.raises(ConfigError, match="--ha-metrics-port"):
            ctl.start()
        assert ctl.status()["up"] is False  # the controller was stopped again
        successor = Controller(cfg, 1, "127.0.0.1", 0)  # failover: the job must not be lost for its metrics
        successor.take_over({"ranks": {}})
        successor.start()
        try:
            assert successor.status()["up"] is True
        finally:
            successor.stop()


def test_events_command_prints_the_file(tmp_path, capsys):
    path = str(tmp_path / "events.jsonl")
    clock = _Clock()
    ctl = _two_ranks_registered(CFG, clock, rejoins=False)
    sink = job_events.EventsFile(path, "j", lambda: 0)
    ctl.recorder.add_sink(sink)
    _recover_and_end(ctl, clock)
    sink.close()
    assert cli.main(["events", "--file", path]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in out] == ["FaultDetected", "RecoveryStarted", "RecoveryFinished", "JobExit"]
    assert cli.main(["events", "--file", path, "--json", "--follow", "--timeout", "0.01"]) == 0
    assert [json.loads(line)["seq"] for line in capsys.readouterr().out.splitlines()] == [1, 2, 3, 4]
    assert cli.main(["events", "--file", str(tmp_path / "none")]) == 1
    assert cli.main(["events", "--file", path, "--timeout", "nan"]) == 2
