"""The job's Prometheus metrics (``--ha-metrics-port``), with ``prometheus_client``.

Two sources, no third: the controller's typed events (:mod:`.job_events`; this is a sink
of the same recorder as the events file, so a counter and the file never disagree) feed
the counters and histograms; a snapshot taken under the controller's lock at scrape time
(``Controller.status()``, :mod:`.snapshot`) feeds the gauges. Everything lives in one
:class:`prometheus_client.CollectorRegistry` of this job, not the process-global one.

Names (Prometheus conventions: one prefix ``mindspeed_ha_``, base units, ``_total`` for
counters, ``_seconds`` for durations; every label has a bounded set of values)::

    mindspeed_ha_build_info{version}                         1
    mindspeed_ha_job_state{state}                            1 for the job phase, 0 for the others
    mindspeed_ha_iteration                                   completed iterations (slowest live rank)
    mindspeed_ha_world_size, mindspeed_ha_ranks{state}       ranks by snapshot.RANK_STATES
    mindspeed_ha_controller_term                             failover term (0 without failover)
    mindspeed_ha_heartbeat_age_max_seconds                   oldest heartbeat of a live rank
    mindspeed_ha_slowest_rank_step_seconds                   longest last step time of a live rank
    mindspeed_ha_control_frames_accepted_total               authenticated frames handled
    mindspeed_ha_control_frames_rejected_total{reason}       frames dropped (bad framing, rate, ...)
    mindspeed_ha_events_total{type}                          job events by type (job_events.TYPES)
    mindspeed_ha_faults_total{kind}                          faults acted on, by FaultKind
    mindspeed_ha_recoveries_total{mode,outcome}              in-place recoveries (recovered | failed)
    mindspeed_ha_recovery_duration_seconds                   histogram: fault evidence -> recovered
    mindspeed_ha_recovery_phase_seconds{phase}               histogram: each phase of a recovery
                                                             (slowest rank's stage; controller's detect)
    mindspeed_ha_steps_lost_total                            iterations computed again after faults
    mindspeed_ha_pauses_total, mindspeed_ha_pause_seconds_total   graceful pauses and their time held
    mindspeed_ha_pause_tasks_total{kind,code}                online checks / relinks by result code (0 ok, 1 not
                                                             run, 2 fault, 3 timeout)
    mindspeed_ha_pause_task_seconds{kind}                    histogram: a check's / relink's time on the ranks
    mindspeed_ha_dying_checkpoints_total                     dying checkpoints committed
    mindspeed_ha_worker_restarts_total                       workers restarted alone (ARF)
    mindspeed_ha_subhealth_score{rank,signal}                a rank's last window score (> 1: worse than
                                                             its reference; --ha-subhealth; one series per
                                                             rank and signal)
    mindspeed_ha_subhealth_flagged{rank,signal}              1 while the rank is flagged for the signal
    mindspeed_ha_subhealth_flagged_total{signal}             flags raised (Subhealth events)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mindspeed_ha.control.job_events import TYPES
from mindspeed_ha.control.snapshot import RANK_STATES
from mindspeed_ha.control.state import Phase
from mindspeed_ha.events import PhaseEvent
from mindspeed_ha.version import __version__

PREFIX = "mindspeed_ha_"
#: seconds; an in-place recovery takes ~0.3-0.5 s on 4 CPU ranks (docs/RESULTS.md), a large job more
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _StateCollector(Collector):
    """Gauges (and the control plane's own counters) read from one status snapshot per scrape."""

    def __init__(self, status: Callable[[], Dict[str, Any]]):
        self.status = status

    def collect(self) -> Iterable[Metric]:
        s = self.status()
        info = GaugeMetricFamily(PREFIX + "build_info", "mindspeed-ha build; always 1", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        state = GaugeMetricFamily(PREFIX + "job_state", "1 for the job's phase as the controller sees it",
                                  labels=["state"])
        for p in Phase:
            state.add_metric([p.value], 1.0 if s["phase"] == p.value else 0.0)
        yield state
        if s["iteration"] is not None:
            yield GaugeMetricFamily(PREFIX + "iteration", "completed iterations of the slowest live rank",
                                    value=s["iteration"])
        yield GaugeMetricFamily(PREFIX + "world_size", "ranks of the job", value=s["world_size"])
        ranks = GaugeMetricFamily(PREFIX + "ranks", "ranks by state", labels=["state"])
        for name in RANK_STATES:
            ranks.add_metric([name], s["ranks_by_state"].get(name, 0))
        yield ranks
        yield GaugeMetricFamily(PREFIX + "controller_term", "the controller's failover term", value=s["term"])
        live = [r for r in s["ranks"] if r["state"] in ("healthy", "suspect")]
        if live:
            yield GaugeMetricFamily(PREFIX + "heartbeat_age_max_seconds", "oldest heartbeat of a live rank",
                                    value=max(r["heartbeat_age_s"] for r in live))
        steps = [r["step_seconds"] for r in live if r.get("step_seconds") is not None]
        if steps:
            yield GaugeMetricFamily(PREFIX + "slowest_rank_step_seconds",
                                    "longest last step time of a live rank (controller clock)", value=max(steps))
        yield CounterMetricFamily(PREFIX + "control_frames_accepted", "authenticated control frames handled",
                                  value=s["frames"]["accepted"])
        rejected = CounterMetricFamily(PREFIX + "control_frames_rejected", "control frames dropped, by reason",
                                       labels=["reason"])
        for reason, n in sorted(s["frames"]["rejected"].items()):
            rejected.add_metric([reason], n)
        yield rejected
        sub = s.get("subhealth")
        if sub is not None:
            score = GaugeMetricFamily(PREFIX + "subhealth_score", "a rank's last sub-health window score (> 1: worse "
                                      "than its reference)", labels=["rank", "signal"])
            for row in sub["scores"]:
                score.add_metric([str(row["rank"]), row["signal"]], row["score"])
            yield score
            flagged = GaugeMetricFamily(PREFIX + "subhealth_flagged", "1 while a rank is flagged for a signal",
                                        labels=["rank", "signal"])
            for row in sub["flagged"]:
                flagged.add_metric([str(row["rank"]), row["signal"]], 1.0)
            yield flagged


class JobMetrics:
    """The job's registry: a sink for the controller's recorder plus the snapshot collector.

    Args:
        status: returns ``Controller.status()`` (thread-safe; called at every scrape).
    """

    def __init__(self, status: Callable[[], Dict[str, Any]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.events = Counter(PREFIX + "events", "job events by type", ["type"], registry=r)
        self.faults = Counter(PREFIX + "faults", "faults the controller acted on, by kind", ["kind"], registry=r)
        self.recoveries = Counter(PREFIX + "recoveries", "in-place recoveries by mode and outcome",
                                  ["mode", "outcome"], registry=r)
        self.recovery_duration = Histogram(PREFIX + "recovery_duration_seconds",
                                           "in-place recovery, fault evidence -> every rank recovered",
                                           registry=r, buckets=DURATION_BUCKETS)
        self.recovery_phase = Histogram(PREFIX + "recovery_phase_seconds",
                                        "each phase of an in-place recovery (slowest rank's stage)", ["phase"],
                                        registry=r, buckets=DURATION_BUCKETS)
        self.steps_lost = Counter(PREFIX + "steps_lost", "iterations computed again after faults", registry=r)
        self.pauses = Counter(PREFIX + "pauses", "graceful pauses ended", registry=r)
        self.pause_seconds = Counter(PREFIX + "pause_seconds", "time held in graceful pauses", registry=r)
        self.tasks = Counter(PREFIX + "pause_tasks", "online checks and relinks by result code", ["kind", "code"],
                             registry=r)
        self.task_seconds = Histogram(PREFIX + "pause_task_seconds", "a check's or relink's time on the ranks",
                                      ["kind"], registry=r)
        self.dying = Counter(PREFIX + "dying_checkpoints", "dying checkpoints committed", registry=r)
        self.restarts = Counter(PREFIX + "worker_restarts", "workers restarted alone (ARF)", registry=r)
        self.subhealth = Counter(PREFIX + "subhealth_flagged", "sub-health flags raised, by signal", ["signal"],
                                 registry=r)
        self.switches = Counter(PREFIX + "switches", "hot switches ended, by outcome", ["outcome"], registry=r)
        self.switch_phase = Histogram(PREFIX + "switch_phase_seconds", "each phase of a hot switch", ["phase"],
                                      registry=r, buckets=DURATION_BUCKETS)
        r.register(_StateCollector(status))

    def __call__(self, e: PhaseEvent) -> None:
        """Recorder sink: count typed event ``e`` (others are ignored)."""
        if e.name not in TYPES:
            return
        detail, seconds = e.detail.get("detail", {}), e.detail.get("phase_seconds", {})
        self.events.labels(e.name).inc()
        if e.name == "FaultDetected":
            self.faults.labels(str(detail.get("kind", "unknown"))).inc()
        elif e.name in ("RecoveryFinished", "RecoveryFailed"):
            self.recoveries.labels(str(detail.get("mode", "")), str(detail.get("outcome", ""))).inc()
            if e.name == "RecoveryFinished":
                for phase, s in seconds.items():
                    if phase == "total":
                        self.recovery_duration.observe(s)
                    else:
                        self.recovery_phase.labels(phase).observe(s)
        elif e.name == "Resumed":
            self.pauses.inc()
            self.pause_seconds.inc(float(seconds.get("pause", 0.0)))
        elif e.name in ("CheckFinished", "RelinkFinished"):
            kind = "check" if e.name == "CheckFinished" else "relink"
            self.tasks.labels(kind, str(detail.get("code", ""))).inc()
            self.task_seconds.labels(kind).observe(float(seconds.get(kind, 0.0)))
        elif e.name == "DyingCheckpointCommitted":
            self.dying.inc()
        elif e.name == "WorkerRestarted":
            self.restarts.inc()
        elif e.name == "Subhealth":
            self.subhealth.labels(str(detail.get("signal", ""))).inc()
        elif e.name in ("SwitchFinished", "SwitchAborted"):
            self.switches.labels(str(detail.get("outcome", ""))).inc()
            for phase, s in seconds.items():
                self.switch_phase.labels(phase).observe(s)
        lost = detail.get("steps_lost")
        if isinstance(lost, int) and lost > 0:
            self.steps_lost.inc(lost)
