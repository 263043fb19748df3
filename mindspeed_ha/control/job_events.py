"""The job's events: one JSON-lines stream (``--ha-events-file``, ``mindspeed-ha events``).

Kubernetes Event style: a CamelCase ``type`` (the reason of a Kubernetes Event) and a
``severity`` (``Normal`` or ``Warning``, Kubernetes' two event types). The controller
notes each one with :func:`note` on its one phase-event recorder
(:class:`mindspeed_ha.events.EventRecorder`, ``source="controller"``: an instant whose
name is the type); :class:`EventsFile`, a sink of that recorder, writes the typed ones
(names in :data:`TYPES`; the recorder's other events, the phases of
:mod:`.outcome`, are not written: their seconds travel in ``phase_seconds``), and
:mod:`.metrics` counts the same events. :func:`on_decision` turns the controller's applied
decisions into events; the few other sources (start, takeover, worker restart) call
:func:`note` directly.

One line (schema version ``v`` = :data:`SCHEMA_VERSION`; a reader skips other versions)::

    {"v": 1, "ts": 1733332800.123, "seq": 7, "job": "3f2a9c0d11e4", "term": 0,
     "type": "RecoveryFinished", "severity": "Normal", "ranks": [1], "iteration": 2,
     "reason": "...", "detail": {"mode": "rollback", ...}, "phase_seconds": {"rebuild": 0.11, ...}}

``ts``: wall clock, seconds since the epoch; ``seq``: 1, 2, ... in file order, continued
across writers of the same file (a successor controller, a rerun with ``--load``);
``job``: 12 hex digits derived from the job's key (the same on every node, reveals nothing
of the key); ``term``: the controller's failover term (0 without failover); ``ranks``: the
global ranks concerned; ``iteration``: the training iteration, or null; ``phase_seconds``:
name -> seconds of the phases the event closes (empty when none). Imports no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import stat
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

from mindspeed_ha.config import ConfigError
from mindspeed_ha.control.policy import ActionKind, Decision
from mindspeed_ha.control.state import Phase
from mindspeed_ha.events import EventRecorder, PhaseEvent
from mindspeed_ha.faults import EXIT_DYING_CHECKPOINT_SAVED

if TYPE_CHECKING:
    from mindspeed_ha.control.controller import Controller

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
#: the fields of one line, in this order
FIELDS = ("v", "ts", "seq", "job", "term", "type", "severity", "ranks", "iteration", "reason", "detail",
          "phase_seconds")
NORMAL, WARNING = "Normal", "Warning"

#: event type -> severity. Who notes each: the controller's decisions (:func:`on_decision`)
#: unless said otherwise.
TYPES: Dict[str, str] = {
    "ControllerStarted": NORMAL,  # the controller listens (detail: control port, metrics URL)
    "ControllerTakeover": WARNING,  # a successor took over a lost leader's job (term)
    "FaultDetected": WARNING,  # the controller acts on a fault: its STOP (detail: kind)
    "RecoveryStarted": NORMAL,  # RETRY(plan) sent (detail: mode, kind, generation, repairs)
    "RecoveryFinished": NORMAL,  # every rank recovered in place (phase_seconds: slowest rank's per stage)
    "RecoveryFailed": WARNING,  # an in-place recovery was abandoned for the dying checkpoint
    "StopRequested": WARNING,  # a graceful stop (SIGTERM / SIGINT / a rank's request) starts
    "PauseRequested": NORMAL,  # an operator's graceful pause (notes: the pause plan)
    "Paused": NORMAL,  # every rank holds at one step boundary (phase_seconds: drain)
    "Resumed": NORMAL,  # a graceful pause ended (notes: the pause plan)
    "CheckFinished": NORMAL,  # an online check ran while paused (detail: code; Warning unless 0; pause_tasks.py)
    "RelinkFinished": NORMAL,  # process groups rebuilt on another address while paused (pause_tasks.py)
    "SwitchRequested": NORMAL,  # a hot switch of ``ranks`` starts its spares (notes: switch_desk)
    "SwitchReady": NORMAL,  # every spare of the hot switch is READY (phase_seconds: spare_ready)
    "SwitchFinished": NORMAL,  # the switched ranks train in their new processes (phase_seconds: every phase)
    "SwitchAborted": WARNING,  # a hot switch given up before its commit point: training goes on (reason)
    # an outgoing process died in its handoff: its new process is repaired from a replica holder (detail: sources)
    "SwitchFallback": WARNING,
    "DyingCheckpointCommitted": WARNING,  # the dying checkpoint of ``iteration`` is committed
    "WorkerRestarted": WARNING,  # a worker's process restarted alone (ARF; notes: the restart arbiter)
    "JobExit": NORMAL,  # the job is over (detail: exit_code; Warning unless 0)
    # the sub-health detector (notes: subhealth_monitor; detail: kind, signal, score, windows, action, outcome)
    "Subhealth": WARNING,  # a rank flagged degraded for ``windows`` consecutive windows
    "SubhealthCleared": NORMAL,  # a flagged rank healthy again for as many windows
    "SubhealthClusterWide": NORMAL,  # many ranks degraded at once: a cluster-wide slowdown, not hardware
}


def job_id(key: Optional[bytes]) -> str:
    """12 hex digits naming the job: HMAC-SHA256 of a fixed label with the job's key (the
    same for every controller of the job; ``""`` without a key)."""
    if not key:
        return ""
    return hmac.new(key, b"mindspeed-ha job id", hashlib.sha256).hexdigest()[:12]


def note(recorder: EventRecorder, type_: str, iteration: Optional[int] = None, *, ranks: Sequence[int] = (),
         reason: str = "", phase_seconds: Optional[Mapping[str, float]] = None, severity: Optional[str] = None,
         **detail: Any) -> PhaseEvent:
    """Record event ``type_`` (a key of :data:`TYPES`) on ``recorder``; returns it.

    Raises:
        ValueError: ``type_`` is not in :data:`TYPES` (a typo would vanish from the file).
    """
    if type_ not in TYPES:
        raise ValueError(f"unknown job event type {type_!r}; known: {sorted(TYPES)}")
    extra: Dict[str, Any] = {"ranks": sorted(int(r) for r in ranks), "reason": str(reason),
                             "phase_seconds": {k: round(float(v), 6) for k, v in (phase_seconds or {}).items()},
                             "detail": detail}
    if severity is not None:
        extra["severity"] = severity
    return recorder.mark(type_, iteration, **extra)


def to_line(e: PhaseEvent, seq: int, job: str, term: int) -> Dict[str, Any]:
    """The schema's dict of typed event ``e`` (see the module docstring)."""
    d = e.detail
    return {"v": SCHEMA_VERSION, "ts": round(e.start_wall, 6), "seq": seq, "job": job, "term": term,
            "type": e.name, "severity": d.get("severity", TYPES[e.name]), "ranks": list(d.get("ranks", ())),
            "iteration": e.iteration, "reason": d.get("reason", ""), "detail": dict(d.get("detail", {})),
            "phase_seconds": dict(d.get("phase_seconds", {}))}


# ---------------------------------------------------------------------- the file
def check_events_file(path: Any) -> None:
    """``--ha-events-file``: a non-empty path whose directory exists and that, if it exists,
    is a regular file (not a directory, a FIFO or a symbolic link). Checked where the
    controller runs (its launcher, before any worker starts), not in every rank: the
    directory need exist on the controller's host only.

    Raises:
        ConfigError: naming ``--ha-events-file`` and what is accepted.
    """
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"--ha-events-file={path!r}: accepted a file path (its directory must exist)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"--ha-events-file={path!r}: directory {parent!r} does not exist")
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isfile(path)):
        raise ConfigError(f"--ha-events-file={path!r}: exists and is not a regular file (a symbolic link, "
                          "a directory or a device); accepted a new file or a regular file to append to")


def _open_append(path: str) -> int:
    """A descriptor to append to ``path``: created O_EXCL (mode 0o666 less the umask), or an
    existing regular file; never through a symbolic link, never a FIFO or device.

    Raises:
        ConfigError: naming ``--ha-events-file``.
    """
    check_events_file(path)
    nofollow = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | nofollow, 0o666)
        except FileExistsError:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | nofollow)
    except OSError as exc:
        raise ConfigError(f"--ha-events-file={path!r}: cannot open for appending: {exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"--ha-events-file={path!r}: not a regular file")
    os.set_blocking(fd, True)
    return fd


def _last_seq(path: str, tail: int = 1 << 16) -> int:
    """The highest ``seq`` among the last lines of ``path`` (0: none)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - tail))
            lines = f.read().splitlines()
    except OSError:
        return 0
    best = 0
    for line in lines:
        try:
            best = max(best, int(json.loads(line).get("seq", 0)))
        except (ValueError, AttributeError, TypeError):
            continue
    return best


class EventsFile:
    """Sink of the controller's recorder: one line per typed event, ``seq`` in file order.

    The controller's thread only formats the line and queues it; a writer thread of this
    sink writes it, so a slow or hung filesystem (a shared one) never holds the controller's
    turn. One ``write`` per line on an O_APPEND descriptor: a reader sees whole lines, and
    lines of two writers of one file (a leader and its successor) do not interleave on a
    local filesystem. A write error is logged once and the stream goes on (events are a
    view; they never stop the job).

    Args:
        path: ``--ha-events-file``.
        job: :func:`job_id`.
        term: returns the controller's term now.

    Raises:
        ConfigError: the file cannot be opened (see :func:`_open_append`).
    """

    def __init__(self, path: str, job: str, term: Callable[[], int]):
        self.path, self.job, self.term = path, job, term
        self._fd = _open_append(path)
        self._seq = _last_seq(path)
        self._lock = threading.Lock()
        self._closed = False
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_lines, name="mindspeed-ha-events", daemon=True)
        self._writer.start()

    def __call__(self, event: PhaseEvent) -> None:
        if event.name not in TYPES:
            return
        with self._lock:  # seq and queue order are one order
            if self._closed:
                return
            self._seq += 1
            self._queue.put((json.dumps(to_line(event, self._seq, self.job, self.term())) + "\n").encode())

    def _write_lines(self) -> None:
        failed = False
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                os.write(self._fd, item)
            except OSError as exc:
                if not failed:
                    log.warning("events file %s: write failed (%s); later events may be missing", self.path, exc)
                failed = True

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every line queued so far is written; False after ``timeout_s``."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then close the file (idempotent). A writer stuck for more
        than ``timeout_s`` (a hung filesystem) is left with its descriptor, and logged."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._writer.join(timeout_s)
        if self._writer.is_alive():
            log.error("events file %s: the writer is stuck for %.1f s; left open", self.path, timeout_s)
            return
        os.close(self._fd)


def read(path: str) -> List[Dict[str, Any]]:
    """Every event line of ``path`` (this schema version), in file order; [] when absent.
    A torn last line (a writer killed mid-line) and lines of other versions are skipped."""
    out: List[Dict[str, Any]] = []
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return out
    for line in data.splitlines():
        d = _parse(line)
        if d is not None:
            out.append(d)
    return out


def _parse(line: bytes) -> Optional[Dict[str, Any]]:
    try:
        d = json.loads(line)
    except ValueError:
        return None
    return d if isinstance(d, dict) and d.get("v") == SCHEMA_VERSION else None


def follow(path: str, timeout_s: float, stop: Optional[threading.Event] = None,
           poll_s: float = 0.1) -> Iterator[Dict[str, Any]]:
    """Yield the events of ``path`` from its start, then those appended, until
    ``timeout_s`` seconds passed or ``stop`` is set. The file may not exist yet.

    Polls the file's size every ``poll_s`` seconds (no inotify in the standard library);
    a partial last line waits for its newline.
    """
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout_s
    offset, partial = 0, b""
    while True:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        offset += len(chunk)
        *lines, partial = (partial + chunk).split(b"\n")
        for line in lines:
            d = _parse(line)
            if d is not None:
                yield d
        left = deadline - time.monotonic()
        if left <= 0 or stop.wait(min(poll_s, left)):
            return


# ---------------------------------------------------------------------- the controller's decisions
def on_decision(ctl: "Controller", d: Decision, old: Phase, fault_before: Any) -> None:
    """Note the events decision ``d`` (applied; the job was in ``old``) means. I/O thread,
    under the controller's lock (called by :func:`.effects.apply`)."""
    st, rec = ctl.state, ctl.recorder
    it = d.params.get("iteration")
    it = it if isinstance(it, int) else None
    if d.action is ActionKind.STOP_ALL and fault_before is None and st.fault is not None:
        f = st.fault
        detect = ctl.recorder.last("detect")
        faulty = st.ranks.get(f.rank)
        if it is None and faulty is not None and faulty.fault_iteration >= 0:
            it = faulty.fault_iteration  # the iteration being computed when it raised
        note(rec, "FaultDetected", it, ranks=[f.rank] if f.rank >= 0 else [], reason=f.reason,
             phase_seconds={"detect": detect.seconds} if detect is not None else None, kind=f.kind.value)
    elif d.action is ActionKind.RETRY and st.recoveries:
        r = st.recoveries[-1]
        note(rec, "RecoveryStarted", r["iteration"], ranks=[r["rank"]], reason=d.reason, mode=r["mode"],
             kind=r["kind"], generation=r["generation"], repairs=[list(x) for x in r.get("repairs") or ()])
    elif d.action is ActionKind.RESUME and old is Phase.RECOVERING and st.recoveries:
        r = st.recoveries[-1]
        note(rec, "RecoveryFinished", r["iteration"], ranks=[r["rank"]], reason=d.reason,
             phase_seconds=recovery_seconds(r), mode=r["mode"], kind=r["kind"], generation=r["generation"],
             outcome="recovered", steps_lost=steps_lost(st, r["iteration"]))
    if old is Phase.RECOVERING and st.phase is Phase.STOPPING and st.recoveries:
        r = st.recoveries[-1]
        note(rec, "RecoveryFailed", r["iteration"], ranks=[r["rank"]], reason=d.reason, mode=r["mode"],
             kind=r["kind"], generation=r["generation"], outcome="failed")
    if old is not Phase.DRAINING and st.phase is Phase.DRAINING and st.stop_request is not None:
        req = st.stop_request
        note(rec, "StopRequested", None, ranks=[req.rank] if req.rank >= 0 else [], reason=req.reason,
             until=d.params.get("until"))
    if old is Phase.DRAINING and st.phase in (Phase.VERIFYING, Phase.DUMPING) and st.stop_request is not None:
        drain = ctl.recorder.last("drain")
        note(rec, "Paused", st.drain_until, ranks=st.alive_ranks(), reason=d.reason,
             phase_seconds={"drain": drain.seconds} if drain is not None else None, purpose="stop")
    if d.action is ActionKind.EXIT and old is Phase.COMMITTING and st.exit_code == EXIT_DYING_CHECKPOINT_SAVED:
        plan = st.plan
        note(rec, "DyingCheckpointCommitted", plan.iteration if plan is not None else None, reason=d.reason,
             phase_seconds=ctl.timer.timings(), steps_lost=steps_lost(st, plan.iteration) if plan is not None else 0)
    if old is not Phase.DONE and st.phase is Phase.DONE:
        code = st.exit_code if st.exit_code is not None else 0
        note(rec, "JobExit", None, reason=st.exit_reason or d.reason, severity=NORMAL if code == 0 else WARNING,
             exit_code=code)


def steps_lost(st: Any, resumed_from: int) -> int:
    """Iterations computed (or entered) past ``resumed_from`` that must be computed again:
    the furthest ``train_step`` a rank entered, less the iteration the job goes on from
    (1 for a rollback, 0 for a roll forward)."""
    steps = [i.step for i in st.ranks.values() if i.step >= 0]
    return max(0, max(steps) - resumed_from) if steps else 0


def recovery_seconds(r: Mapping[str, Any]) -> Dict[str, float]:
    """Phase seconds of in-place recovery record ``r`` (``ClusterState.recoveries``): each
    rank stage's seconds of the slowest rank (``clean``, ``rebuild``, ``repair``,
    ``rollback``, ...), and the controller's ``detect`` (evidence -> STOP), ``abort``
    (STOP -> abort sent), ``retry`` (stop round -> RETRY sent), ``total`` (evidence -> every
    rank recovered), on its clock."""
    out: Dict[str, float] = {}
    for detail in (r.get("ranks") or {}).values():
        try:
            d = json.loads(detail) if isinstance(detail, str) else dict(detail)
        except (ValueError, TypeError):
            continue
        for k, v in d.items():
            if isinstance(v, float) and k not in ("rank", "iteration", "generation"):
                out[k] = max(out.get(k, 0.0), v)
    ev, stop, abort, retry, done = (r.get(k) for k in ("evidence_at", "stop_at", "abort_at", "retry_at", "done_at"))
    for name, a, b in (("detect", ev, stop), ("abort", stop, abort), ("retry", abort or stop, retry),
                       ("total", ev, done)):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            out[name] = max(0.0, b - a)
    return out


# ---------------------------------------------------------------------- mindspeed-ha events
def format_line(d: Mapping[str, Any]) -> str:
    """One event as a line of text: UTC time, seq, type, severity, ranks, iteration, reason,
    phase seconds, detail."""
    when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(d["ts"])) + f".{int(d['ts'] % 1 * 1000):03d}Z"
    parts = [when, f"#{d['seq']}", f"{d['type']:<24}", f"{d['severity']:<7}", f"ranks={d['ranks']}",
             f"iteration={d['iteration']}", d["reason"]]
    if d.get("phase_seconds"):
        parts.append("phase_seconds=" + json.dumps(d["phase_seconds"], sort_keys=True))
    if d.get("detail"):
        parts.append("detail=" + json.dumps(d["detail"], sort_keys=True))
    return "  ".join(str(p) for p in parts)


def cli(path: str, follow_: bool, timeout_s: float, as_json: bool, out=None) -> int:
    """``mindspeed-ha events --file PATH [--follow] [--timeout S] [--json]``: print the
    events of ``path`` (JSON lines with ``--json``); with ``--follow`` go on printing those
    appended until ``timeout_s`` passed. Returns the exit status: 0, 1 (no such file,
    without ``--follow``), 2 (bad ``--timeout``), 130 (Ctrl-C)."""
    import math
    import sys

    out = out or sys.stdout
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        print(f"mindspeed-ha events: error: --timeout={timeout_s}: accepted finite seconds > 0", file=sys.stderr)
        return 2
    if not follow_ and not os.path.exists(path):
        print(f"mindspeed-ha events: error: --file {path!r}: no such file (the job's --ha-events-file)",
              file=sys.stderr)
        return 1
    events = follow(path, timeout_s) if follow_ else iter(read(path))
    try:
        for d in events:
            print(json.dumps(d) if as_json else format_line(d), file=out, flush=True)
    except KeyboardInterrupt:  # Ctrl-C ends --follow: no traceback
        return 130
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        return 0
    return 0
