"""The sub-health detector (``--ha-subhealth``, issue 18 item 4).

* the pure policy (:func:`mindspeed_ha.control.policy.subhealth.assess`), table-tested:
  the degradation and sigma rules against peers and against the rank's own baseline,
  hysteresis (flag after N windows, clear after N), many ranks at once (cluster-wide, not
  hardware), escalation by frequency within 24 h, per-signal actions;
* the flags: every bad value names its flag and range (exit 2 at the launcher);
* the samplers: the training thread's stack (waiting in a collective or not), the device
  sources (fake, NVML through a stand-in ``pynvml``, npu-smi's text);
* an in-process controller on a fake clock with 4 simulated ranks (the real handlers,
  monitor, events, metrics and status; real wire frames): one rank's steps slowed is
  flagged within the configured windows and nobody else; every rank slowed is a
  cluster-wide slowdown, nobody flagged; the actions ``exit`` (graceful stop) and
  ``switch`` (not in this build's operator table: logged, the event records it).

The multi-rank proof (a rank slowed by the injector in a real job, flagged, losses bitwise
equal) is a case of tests/test_replica_equivalence.py.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import types

import pytest
import zmq

from mindspeed_ha.config import HAConfig, add_ha_arguments
from mindspeed_ha.control import operator, wire
from mindspeed_ha.control.controller import Controller
from mindspeed_ha.control.policy.subhealth import CLEARED, CLUSTER_WIDE, FLAGGED, Track, assess
from mindspeed_ha.control.state import Layout, Phase
from mindspeed_ha.control.subhealth_sampler import (FakeSource, NvmlSource, SubhealthSampler, nvml_index,
                                                    parse_npu_smi, waiting)
from mindspeed_ha.errors import ConfigError
from mindspeed_ha.subhealth import ESCALATION_WINDOW_S, SubhealthSettings

CFG = SubhealthSettings(enabled=True, window_s=1.0, windows=3)


def run_windows(values_per_window, cfg=CFG, tracks=None, t0=0.0):
    """Assess a list of windows (rank -> signal -> value); returns (tracks, [verdicts of each window])."""
    tracks, out = dict(tracks or {}), []
    for i, window in enumerate(values_per_window):
        a = assess(tracks, window, t0 + (i + 1) * cfg.window_s, cfg)
        tracks = a.tracks
        out.append(a.verdicts)
    return tracks, out


def steps(*values):
    """One window: rank i's step seconds = values[i]."""
    return {r: {"step": v} for r, v in enumerate(values)}


HEALTHY = steps(0.10, 0.10, 0.10, 0.10)
ONE_SLOW = steps(0.10, 0.10, 0.14, 0.10)  # rank 2: 40% slower than its peers


# ---------------------------------------------------------------------- the pure policy
@pytest.mark.parametrize("slow_windows,flagged_at", [(2, None), (3, 2), (5, 2)])
def test_hysteresis_flags_after_n_consecutive_windows_once(slow_windows, flagged_at):
    _, verdicts = run_windows([ONE_SLOW] * slow_windows)
    hits = [(i, v) for i, vs in enumerate(verdicts) for v in vs]
    if flagged_at is None:
        assert hits == []
    else:  # once, at the N-th window, for rank 2 only, with the default action (log + event)
        assert [(i, v.kind, v.ranks, v.windows, v.action) for i, v in hits] == [(flagged_at, FLAGGED, (2,), 3, "event")]
        assert hits[0][1].score == pytest.approx(1.4)


def test_a_healthy_window_resets_the_streak_and_n_healthy_windows_clear_the_flag():
    _, verdicts = run_windows([ONE_SLOW, ONE_SLOW, HEALTHY, ONE_SLOW, ONE_SLOW])
    assert not any(verdicts)  # never 3 in a row
    _, verdicts = run_windows([ONE_SLOW] * 3 + [HEALTHY] * 2 + [ONE_SLOW] + [HEALTHY] * 3)
    kinds = [(i, v.kind) for i, vs in enumerate(verdicts) for v in vs]
    assert kinds == [(2, FLAGGED), (8, CLEARED)]  # the slow window at 5 restarted the healthy count


@pytest.mark.parametrize("slow,degradation,sigma,flagged", [
    (0.125, 0.3, 3.0, False),  # 25% < 30%
    (0.135, 0.3, 3.0, True),  # 35%, peers identical: beyond any sigma
    (0.135, 0.4, 3.0, False),  # 35% < 40%
])
def test_degradation_threshold_against_peers(slow, degradation, sigma, flagged):
    cfg = SubhealthSettings(enabled=True, window_s=1.0, windows=1, degradation=degradation, sigma=sigma)
    _, verdicts = run_windows([steps(0.10, 0.10, slow, 0.10)], cfg)
    assert bool(verdicts[0]) is flagged


def test_sigma_rule_spares_a_rank_inside_noisy_peers():
    """Ranks 1 and 3 are 50-60% above their peers' median (0.10) but within 3 standard
    deviations of noisy peers (about 0.04): not degraded; with the rule off they are."""
    window = steps(0.05, 0.16, 0.10, 0.15)
    for sigma, flagged in ((3.0, set()), (0.0, {1, 3})):
        cfg = SubhealthSettings(enabled=True, window_s=1.0, windows=1, sigma=sigma)
        _, verdicts = run_windows([window], cfg)
        assert {v.ranks[0] for v in verdicts[0] if v.kind == FLAGGED} == flagged, sigma


def test_own_baseline_flags_a_rank_without_peers():
    """One rank alone (or the only one reporting a signal) is compared with its own healthy windows."""
    _, verdicts = run_windows([{0: {"step": 0.10}}] * 3 + [{0: {"step": 0.14}}] * 3)
    assert [(i, v.kind) for i, vs in enumerate(verdicts) for v in vs] == [(5, FLAGGED)]


@pytest.mark.parametrize("slowed,cluster", [((2,), False), ((1, 2), False), ((0, 1, 2), True), ((0, 1, 2, 3), True)])
def test_many_ranks_at_once_is_not_hardware(slowed, cluster):
    """After a healthy baseline, more than half of the ranks degraded in the same windows
    (every rank, or three of four) is one cluster-wide verdict and no rank is flagged."""
    slow = steps(*[0.2 if r in slowed else 0.1 for r in range(4)])
    _, verdicts = run_windows([HEALTHY] * 3 + [slow] * 4)
    got = [v for vs in verdicts for v in vs]
    if cluster:
        assert [(v.kind, v.ranks) for v in got] == [(CLUSTER_WIDE, slowed)]
        assert "not a rank's hardware" in got[0].reason
    else:
        assert sorted(v.ranks[0] for v in got if v.kind == FLAGGED) == list(slowed)


def test_escalation_by_frequency_within_24_hours():
    cfg = SubhealthSettings(enabled=True, window_s=1.0, windows=1, escalate_after=3, escalate_action="exit")
    episode = [ONE_SLOW, HEALTHY]  # flagged, cleared
    tracks, verdicts = run_windows(episode * 3, cfg)
    flags = [v for vs in verdicts for v in vs if v.kind == FLAGGED]
    assert [(v.escalated, v.action) for v in flags] == [(False, "event"), (False, "event"), (True, "exit")]
    assert "escalated" in flags[-1].reason
    # a day later the old flags no longer count
    _, later = run_windows(episode, cfg, tracks, t0=ESCALATION_WINDOW_S + 10)
    assert [(v.escalated, v.action) for vs in later for v in vs if v.kind == FLAGGED] == [(False, "event")]


def test_device_signals_directions_and_per_signal_action():
    cfg = HAConfig.from_args(argparse.Namespace(ha_subhealth=True, ha_subhealth_windows=1,
                                                ha_subhealth_action="log,sm_clock_mhz=switch")).subhealth
    window = {r: {"sm_clock_mhz": 1980.0, "temperature_c": 60.0, "ecc_corrected": 0.0} for r in range(4)}
    window[3] = {"sm_clock_mhz": 1200.0, "temperature_c": 40.0, "ecc_corrected": 0.0}  # clock down; cooler is fine
    window[1] = dict(window[1], ecc_corrected=5.0)  # new corrected errors over a zero baseline
    a = assess({}, window, 1.0, cfg)
    got = sorted((v.ranks[0], v.signal, v.action) for v in a.verdicts)
    assert got == [(1, "ecc_corrected", "log"), (3, "sm_clock_mhz", "switch")]
    assert a.scores[(3, "sm_clock_mhz")] == pytest.approx(1980 / 1200 + 0.0, rel=0.2)
    assert a.scores[(0, "step")] if (0, "step") in a.scores else True


def test_a_rank_without_a_value_keeps_its_track():
    tracks, _ = run_windows([ONE_SLOW, ONE_SLOW])
    a = assess(tracks, {r: {"step": 0.1} for r in (0, 1, 3)}, 3.0, CFG)  # rank 2 silent this window
    assert a.tracks[(2, "step")] == tracks[(2, "step")] and a.tracks[(2, "step")].streak == 2
    assert Track() == Track(history=(), streak=0)


# ---------------------------------------------------------------------- the flags
def _parse(*argv):
    return add_ha_arguments(argparse.ArgumentParser()).parse_args(["--enable-high-availability", *argv])


@pytest.mark.parametrize("argv,needle", [
    (["--ha-subhealth-window", "0"], "--ha-subhealth-window"), (["--ha-subhealth-window", "nan"], "--ha-subhealth-window"),
    (["--ha-subhealth-window", "4000"], "--ha-subhealth-window"), (["--ha-subhealth-windows", "0"], "--ha-subhealth-windows"),
    (["--ha-subhealth-degradation", "0"], "--ha-subhealth-degradation"),
    (["--ha-subhealth-degradation", "inf"], "--ha-subhealth-degradation"),
    (["--ha-subhealth-sigma", "-1"], "--ha-subhealth-sigma"), (["--ha-subhealth-many", "1.5"], "--ha-subhealth-many"),
    (["--ha-subhealth-escalate", "-1"], "--ha-subhealth-escalate"),
    (["--ha-subhealth-action", "reboot"], "--ha-subhealth-action"),
    (["--ha-subhealth-action", "disk=exit"], "--ha-subhealth-action"),
    (["--ha-subhealth-escalate-action", "kill"], "--ha-subhealth-escalate-action"),
])
def test_every_subhealth_flag_names_itself_and_its_range(argv, needle):
    with pytest.raises(ConfigError) as ei:
        HAConfig.from_args(_parse("--ha-subhealth", *argv), {})
    msg = str(ei.value)
    assert msg.startswith(needle) and ("accepted" in msg), msg


def test_defaults_are_the_references_and_enforcement_is_opt_in():
    s = HAConfig.from_args(_parse(), {}).subhealth
    assert (s.enabled, s.window_s, s.windows, s.degradation, s.sigma, s.escalate_after) == (False, 30.0, 3, 0.3, 3.0, 3)
    assert s.action == "event" and s.escalate_action == "event"
    s = HAConfig.from_args(_parse("--ha-subhealth", "--ha-subhealth-action", "step=exit"), {}).subhealth
    assert s.enabled and s.action_for("step") == "exit" and s.action_for("temperature_c") == "event"


def test_launcher_refuses_a_bad_subhealth_flag_before_any_worker():
    import subprocess

    from mindspeed_ha.testing.harness import launcher_command

    r = subprocess.run([*launcher_command(2), "-m", "mindspeed_ha.testing.trainer.pretrain_gpt",
                        "--enable-high-availability", "--ha-subhealth", "--ha-subhealth-windows", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--ha-subhealth-windows=0: accepted range integers 1..100" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------------- the samplers
def _blocked_in(filename, release, started):
    """A function compiled as if it lived in ``filename`` that blocks until ``release``."""
    ns = {"release": release, "started": started}
    exec(compile("def wait():\n    started.set()\n    release.wait(30)\n", filename, "exec"), ns)
    return ns["wait"]


@pytest.mark.parametrize("filename,is_waiting", [
    ("/x/torch/distributed/distributed_c10d.py", True), ("/x/mindspeed_ha/recovery/comm.py", True),
    ("/x/megatron/core/pipeline_parallel/schedules.py", False),
])
def test_sampler_tells_a_training_thread_waiting_in_a_collective(filename, is_waiting):
    release, started, sent = threading.Event(), threading.Event(), []
    t = threading.Thread(target=_blocked_in(filename, release, started), daemon=True)
    t.start()
    try:
        assert started.wait(10)
        s = SubhealthSampler(3, sent.append, lambda: 7, window_s=1.0, source=FakeSource({"temperature_c": 51.0}),
                             thread_id=t.ident)
        for _ in range(4):
            s.sample()
        h = s.report(0.0)
    finally:
        release.set()
        t.join(10)
    assert (h.rank, h.iteration, h.samples, h.counters) == (3, 7, 4, {"temperature_c": 51.0})
    assert h.busy == (0.0 if is_waiting else 1.0)
    assert s.report(0.0).busy == -1.0  # counts reset; nothing sampled since
    assert waiting(sys._getframe(), {}) is False


def test_sampler_thread_sends_health_and_stops():
    sent = []
    got = threading.Event()
    s = SubhealthSampler(0, lambda b: (sent.append(b), got.set()), lambda: 1, window_s=0.4, source=None).start()
    try:
        assert got.wait(20)
    finally:
        s.stop()
    assert not s.thread.is_alive() and sent[0].samples >= 0 and sent[0].counters == {}


class _Nvml(types.SimpleNamespace):
    """A stand-in for ``pynvml`` with the constants and calls NvmlSource uses."""

    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU, NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC = 1, 0, 0, 0

    def __init__(self, reasons):
        super().__init__(calls=[], reasons=reasons)

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("gpu", i)

    def nvmlDeviceGetClockInfo(self, h, which):
        return 1410 if which == 1 else 0

    def nvmlDeviceGetTemperature(self, h, which):
        return 71

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        raise RuntimeError("NVMLError_NotSupported")  # ECC off: the counter is left out

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self.reasons


@pytest.mark.parametrize("reasons,throttle", [(0x0, 0.0), (0x1, 0.0), (0x4, 0.0), (0x40, 1.0), (0x8 | 0x1, 1.0)])
def test_nvml_source_reads_clock_temperature_and_slowdown_reasons(reasons, throttle):
    nv = _Nvml(reasons)
    src = NvmlSource(nv, 2)
    assert src.handle == ("gpu", 2)
    assert src.read() == {"sm_clock_mhz": 1410.0, "temperature_c": 71.0, "throttle": throttle}
    src.close()
    assert nv.calls == ["init", "shutdown"]


def test_nvml_index_and_npu_smi_text():
    assert nvml_index({"LOCAL_RANK": "1"}) == 1
    assert nvml_index({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,6"}) == 6
    assert nvml_index({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "GPU-1f2e"}) is None
    text = "        NPU ID                         : 0\n        Temperature(C)                 : 46\n" \
           "        Aicore curFreq(MHZ)            : 1800\n        HBM Usage Rate(%)              : 3\n"
    assert parse_npu_smi(text) == {"temperature_c": 46.0, "sm_clock_mhz": 1800.0}


def test_health_frame_round_trip():
    tx, rx = wire.Codec(b"k" * 32, "rank-1-a"), wire.Codec(b"k" * 32, "rx")
    body = wire.Health(1, 12, 0.25, 20, {"temperature_c": 60.0})
    assert rx.decode(tx.encode(body)).body == body


# ---------------------------------------------------------------------- the controller, in process
KEY = b"h" * 32
WORLD = 4


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class _Frame:
    def __init__(self, data):
        self.bytes, self.buffer = data, memoryview(data)

    def get(self, option):
        raise zmq.ZMQError(zmq.EINVAL)


class Router:
    """The ROUTER's stand-in: queued frames in, sent frames recorded."""

    def __init__(self):
        self.queue, self.sent = collections.deque(), []

    def recv_multipart(self, flags=0, copy=True):
        if not self.queue:
            raise zmq.Again()
        ident, data = self.queue.popleft()
        return [_Frame(ident), _Frame(data)]

    def send_multipart(self, parts, flags=0):
        self.sent.append(parts)


class Job:
    """A never-started Controller on a fake clock and WORLD simulated DP ranks that complete
    iterations at their own pace (seconds per iteration, changeable) and report as a
    processor does: STATUS UPDATED(k) and HEARTBEAT, every ``beat_s``."""

    def __init__(self, argv=(), beat_s=0.1):
        cfg = HAConfig.from_args(_parse("--ha-subhealth", "--ha-subhealth-window", "1", *argv), {})
        import dataclasses

        cfg = dataclasses.replace(cfg, auth_key=KEY, heartbeat_interval_s=0.1, heartbeat_timeout_s=5.0)
        self.clock, self.router, self.beat_s = Clock(), Router(), beat_s
        self.ctl = Controller(cfg, WORLD, "127.0.0.1", 0, tick_s=0.05, clock=self.clock)
        self.ctl._router = self.router
        self.codecs = {r: wire.Codec(KEY, wire.new_sender("rank", r)) for r in range(WORLD)}
        self.pace = {r: 0.1 for r in range(WORLD)}
        self.done = {r: 0.0 for r in range(WORLD)}  # fractional iterations completed
        for r in range(WORLD):
            self.send(r, wire.Register(r, WORLD, 100 + r, "node", Layout(dp_rank=r, dp_size=WORLD), None, "run",
                                       "updated", 0))
        self.ctl._turn()
        assert len(self.ctl.state.ranks) == WORLD

    def send(self, r, body):
        self.router.queue.append((b"r%d" % r, self.codecs[r].encode(body)))

    def run(self, seconds):
        end = self.clock.t + seconds
        while self.clock.t < end:
            self.clock.t += self.beat_s
            for r in range(WORLD):
                self.done[r] += self.beat_s / self.pace[r]
                k = int(self.done[r])
                self.send(r, wire.Status(r, "updated", k, k + 1))
                self.send(r, wire.Heartbeat(r, k, "updated"))
            self.ctl._turn()

    def events(self, *types_):
        return [e for e in self.ctl.recorder.events() if e.name in types_]


def test_controller_flags_the_slowed_rank_within_its_windows_and_no_other():
    j = Job()
    j.run(3.0)  # healthy: baselines
    assert j.events("Subhealth", "SubhealthClusterWide") == []
    j.pace[2] = 0.2  # rank 2's steps take twice as long
    before = j.ctl.subhealth.windows
    while not j.events("Subhealth") and j.ctl.subhealth.windows < before + 8:
        j.run(0.5)
    # within the configured windows: the 3rd window after the change (4th: the first straddled it)
    assert j.ctl.subhealth.windows - before in (3, 4), (before, j.ctl.subhealth.windows)
    j.run(3.0)
    flagged = j.events("Subhealth")
    assert [e.detail["ranks"] for e in flagged] == [[2]], flagged  # once, and nobody else
    d = flagged[0].detail["detail"]
    assert d["signal"] == "step" and d["windows"] == 3 and d["action"] == "event" and d["score"] > 1.3
    status = j.ctl.status()
    assert [(f["rank"], f["signal"]) for f in status["subhealth"]["flagged"]] == [(2, "step")]
    from mindspeed_ha.control.operator_desk import status as desk_status

    text = operator.format_status(desk_status(j.ctl, j.clock.t))
    assert "sub-health:" in text and "flagged: rank 2 step" in text
    from mindspeed_ha.control.http_status import page

    assert "flagged: rank 2 step x" in page(status)
    from mindspeed_ha.control.metrics import JobMetrics
    from prometheus_client import generate_latest

    metrics = JobMetrics(j.ctl.status)
    for e in flagged:
        metrics(e)
    scrape = generate_latest(metrics.registry).decode()
    assert 'mindspeed_ha_subhealth_flagged{rank="2",signal="step"} 1.0' in scrape
    assert 'mindspeed_ha_subhealth_flagged_total{signal="step"} 1.0' in scrape
    assert 'mindspeed_ha_subhealth_score{rank="2",signal="step"}' in scrape
    j.pace[2] = 0.1
    j.run(5.0)
    assert [e.detail["ranks"] for e in j.events("SubhealthCleared")] == [[2]]
    assert j.ctl.status()["subhealth"]["flagged"] == []


def test_controller_everyone_slowed_is_a_cluster_wide_slowdown_not_hardware():
    j = Job()
    j.run(4.0)
    for r in range(WORLD):
        j.pace[r] = 0.25  # a data or storage stall: every rank at once
    j.run(6.0)
    assert j.events("Subhealth") == []
    wide = j.events("SubhealthClusterWide")
    assert len(wide) == 1 and wide[0].detail["ranks"] == list(range(WORLD)), wide


def test_controller_action_exit_is_the_graceful_stop():
    j = Job(("--ha-subhealth-action", "step=exit"))
    j.run(3.0)
    j.pace[1] = 0.3
    j.run(5.0)
    assert [e.detail["detail"]["outcome"] for e in j.events("Subhealth")] == [
        "graceful stop requested: checkpoint of the last completed iteration, exit 75"]
    assert j.ctl.state.stop_request is not None and "sub-health" in j.ctl.state.stop_request.reason
    assert j.ctl.state.phase is Phase.DRAINING


def test_controller_action_switch_asks_the_hot_switch_and_records_its_refusal(caplog):
    j = Job(("--ha-subhealth-action", "switch"))
    j.run(3.0)
    j.pace[0] = 0.3
    with caplog.at_level("WARNING", logger="mindspeed_ha.control.controller"):
        j.run(5.0)
    (e,) = j.events("Subhealth")
    assert e.detail["ranks"] == [0] and e.detail["detail"]["action"] == "switch"
    outcome = e.detail["detail"]["outcome"]  # this job has no worker reboot: the switch verb refuses
    assert outcome.startswith("not available: code 4") and "--enable-worker-reboot" in outcome, outcome
    assert "sub-health action switch not available: code 4" in caplog.text
    assert j.ctl.state.phase is Phase.RUNNING


def test_settings_travel_to_a_controller_started_as_its_own_process(capsys):
    """Without the launcher rank 0 starts ``python -m mindspeed_ha.control.controller``: the
    settings go as the same flags, and a bad one there exits 2 naming it."""
    from mindspeed_ha.control import controller

    s = HAConfig.from_args(_parse("--ha-subhealth", "--ha-subhealth-window", "2.5", "--ha-subhealth-action",
                                  "log,step=exit", "--ha-subhealth-escalate", "0"), {}).subhealth
    assert HAConfig.from_args(_parse(*s.to_argv()), {}).subhealth == s
    assert SubhealthSettings().to_argv() == []
    assert controller.main(["--world-size", "1", "--port", "0", "--ha-subhealth-window", "0"]) == 2
    assert "--ha-subhealth-window=0.0: accepted range" in capsys.readouterr().err


def test_step_is_relative_to_the_jobs_step_time_not_a_waiting_ranks_own():
    """Waiting ranks' own seconds are near zero (0.08 vs 0.05: '60% worse' on their own
    scale); against the job's step time (0.6 s) that is 5%: not degraded. The straggler
    (0.58 s of its own) is."""
    cfg = SubhealthSettings(enabled=True, window_s=1.0, windows=1, sigma=0.0)
    waiting_ranks = steps(0.05, 0.03, 0.05, 0.08)
    assert [v.ranks for v in assess({}, waiting_ranks, 1.0, cfg).verdicts] == [(3,)]  # unscaled: noise flagged
    assert assess({}, waiting_ranks, 1.0, cfg, {"step": 0.6}).verdicts == ()
    a = assess({}, steps(0.05, 0.58, 0.03, 0.08), 1.0, cfg, {"step": 0.6})
    assert [(v.kind, v.ranks) for v in a.verdicts] == [(FLAGGED, (1,))]
    assert a.scores[(1, "step")] == pytest.approx(1 + (0.58 - 0.05) / 0.6)


@pytest.mark.parametrize("text,error", [
    ("rank=1,iteration=2,point=forward,fault=slow,sleep=0.5", None),
    ("rank=1,iteration=2,fault=slow", "fault=slow needs sleep= seconds in (0, 60]"),
    ("rank=1,iteration=2,fault=slow,sleep=0", "fault=slow needs sleep= seconds in (0, 60]"),
    ("rank=1,iteration=2,fault=slow,sleep=nan", "fault=slow needs sleep= seconds in (0, 60]"),
    ("rank=1,iteration=2,point=eval,fault=slow,sleep=1", "fault=slow fires only at points"),
    ("rank=1,iteration=2,fault=kill,sleep=1", "sleep= goes with fault=slow only"),
])
def test_injector_straggler_spec(text, error):
    from mindspeed_ha.faultspec import parse_env
    from mindspeed_ha.testing.injector import Injector

    if error is not None:
        with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
            parse_env(text)
        return
    inj = Injector(1, parse_env(text))
    assert [inj.armed("forward", k) is not None for k in (1, 2, 3, 9)] == [False, True, True, True]
    assert inj.armed("backward", 3) is None


def test_controller_action_check_reaches_the_operators_verb_with_the_rank(monkeypatch):
    """Where the build has the verb and its request carries the ranks (the shape of the
    operator's ``check`` / ``switch``: ``params["ranks"]``), the detector's request reaches
    that verb's function, for the flagged rank only, and the reply is the event's outcome."""
    import dataclasses
    from typing import Any, Dict

    from mindspeed_ha.control import operator_desk

    @dataclasses.dataclass(frozen=True)
    class Request:  # OperatorRequest with the verbs' params
        request_id: str
        verb: str
        max_s: float = 0.0
        then_stop: bool = False
        params: Dict[str, Any] = dataclasses.field(default_factory=dict)

    calls = []

    def check(ctl, now, body):
        calls.append((body.verb, body.params, body.request_id))
        return wire.OperatorReply(body.request_id, operator_desk.DONE, "check of rank(s) queued")

    monkeypatch.setattr(wire, "OperatorRequest", Request)
    monkeypatch.setitem(operator_desk.VERBS, "check", check)
    j = Job(("--ha-subhealth-action", "check"))
    j.run(3.0)
    j.pace[3] = 0.3
    j.run(5.0)
    assert [(v, p["ranks"], rid) for v, p, rid in calls] == [("check", [3], "internal-1")]
    assert calls[0][1]["reason"].startswith("sub-health: rank 3: step "), calls  # SwitchRequested's reason
    (e,) = j.events("Subhealth")
    assert e.detail["detail"]["outcome"] == "code 0: check of rank(s) queued (request internal-1)"
    assert j.ctl.operators.requests["internal-1"][0] == "check"
