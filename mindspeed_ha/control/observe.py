"""What a controller shows of its job: the events file and the metrics port, started and
stopped with it.

:class:`Observers` attaches :class:`.job_events.EventsFile` (``--ha-events-file``) and
:class:`.metrics.JobMetrics` (``--ha-metrics-port``) as sinks of the controller's one
recorder, starts :class:`.http_status.StatusServer`, and notes ``ControllerStarted`` (and
``ControllerTakeover`` for a successor), whose detail carries the bound ports: with
``--ha-metrics-port 0`` the events file is where a tool finds the chosen port (the log
line says it too). Both are off unless their flag is given.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from mindspeed_ha.control import job_events
from mindspeed_ha.errors import ConfigError
from mindspeed_ha.control.snapshot import term_of

if TYPE_CHECKING:
    from mindspeed_ha.control.controller import Controller

log = logging.getLogger(__name__)


class Observers:
    """The events file and the HTTP port of controller ``ctl`` (see the module docstring)."""

    def __init__(self, ctl: "Controller"):
        self.ctl = ctl
        self.job = job_events.job_id(ctl.config.auth_key)
        self.file: Optional[job_events.EventsFile] = None
        self.http: Any = None

    def start(self) -> None:
        """Open the events file and bind the metrics port (as configured).

        Raises:
            ConfigError: the file cannot be opened or the port bound (naming the flag);
                whatever was started is stopped first. Not for a successor (failover):
                it logs the error and goes on without them.
        """
        ctl = self.ctl
        try:
            self._open()
        except ConfigError as exc:
            if ctl.failover.takeover_at is None:
                self.stop()
                raise
            # a successor: the job must not be lost for want of a view of it
            log.error("controller failover: the successor goes on without %s: %s",
                      "the metrics port" if self.file is not None else "the events file and the metrics port", exc)
        except BaseException:
            self.stop()
            raise
        detail = {"addr": ctl.bind_addr, "port": ctl.port, "world_size": ctl.world_size}
        if self.http is not None:
            detail["metrics_url"] = self.http.url
        job_events.note(ctl.recorder, "ControllerStarted", reason="controller listening", **detail)
        if ctl.failover.takeover_at is not None:
            job_events.note(ctl.recorder, "ControllerTakeover", reason="a successor took over the lost leader's job",
                            ranks=sorted(ctl.state.ranks), term=term_of(ctl))
        if self.file is not None:
            self.file.flush()  # the port chosen for --ha-metrics-port 0 is in the file when start() returns

    def _open(self) -> None:
        ctl, cfg = self.ctl, self.ctl.config
        if cfg.events_file:
            self.file = job_events.EventsFile(cfg.events_file, self.job, lambda: term_of(ctl))
            ctl.recorder.add_sink(self.file)
        if cfg.metrics_port is not None:
            from mindspeed_ha.control.http_status import StatusServer
            from mindspeed_ha.control.metrics import JobMetrics

            metrics = JobMetrics(ctl.status)
            ctl.recorder.add_sink(metrics)
            self.http = StatusServer(cfg.metrics_addr, cfg.metrics_port, metrics.registry, ctl.status).start()

    def stop(self) -> None:
        """Close the port and the file (idempotent; after the controller's thread ended)."""
        http, self.http = self.http, None
        if http is not None:
            http.stop()
        f, self.file = self.file, None
        if f is not None:
            f.close()
