"""Phase events: every timed phase of a recovery is one event, recorded once, read by all.

Model: torch.distributed.elastic's ``record_duration`` -> event -> ``record`` (agent/server/
api.py, events/__init__.py). A rank (``source="rank-3"``) or the controller
(``source="controller"``) times a phase with :meth:`EventRecorder.phase` (or notes an
instant with :meth:`EventRecorder.mark`); the recorder keeps the events in memory and hands
each one to its sinks (a JSON-lines file, a test's list). Consumers (the controller's
report, the demo, the benchmarks) read events; none of them recomputes a duration from
its own clock readings.

Units: ``start_wall`` is ``time.time()`` seconds (comparable across processes of one
host and, with synchronised clocks, across hosts); ``seconds`` is measured on
``time.monotonic()`` (immune to clock steps). Imports nothing but the standard library.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

log = logging.getLogger(__name__)

#: version of one JSON line (``v``); readers skip lines of another version
EVENT_SCHEMA_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PhaseEvent:
    """One phase (``seconds`` > 0) or one instant (``seconds`` == 0).

    Attributes:
        name: the phase, in the words of docs/ARCHITECTURE.md (``detect``, ``stop``,
            ``clean``, ``rebuild``, ``repair``, ``rollback``, ``save``, ...).
        source: ``"controller"`` or ``"rank-<r>"``.
        start_wall: wall clock at the start, seconds since the epoch.
        seconds: duration, seconds (monotonic clock); 0 for an instant.
        iteration: the training iteration the phase belongs to, if any.
        ok: False when the timed block raised.
        detail: small JSON-able facts (mode, rank, generation, error text).
    """

    name: str
    source: str
    start_wall: float
    seconds: float = 0.0
    iteration: Optional[int] = None
    ok: bool = True
    detail: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def end_wall(self) -> float:
        """Wall clock at the end, seconds since the epoch."""
        return self.start_wall + self.seconds

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["detail"] = dict(self.detail)
        d["v"] = EVENT_SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PhaseEvent":
        """Raises:
            ValueError: a field is missing or of the wrong type."""
        try:
            return cls(name=str(d["name"]), source=str(d["source"]), start_wall=float(d["start_wall"]),
                       seconds=float(d.get("seconds", 0.0)),
                       iteration=None if d.get("iteration") is None else int(d["iteration"]),
                       ok=bool(d.get("ok", True)), detail=dict(d.get("detail") or {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a phase event: {exc}") from None


Sink = Callable[[PhaseEvent], None]


class JsonLinesSink:
    """Appends one JSON line per event to ``path`` (created with the user's umask, never
    through a symbolic link; one ``write`` per line, so concurrent ranks do not interleave
    within a line on a local filesystem)."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, event: PhaseEvent) -> None:
        line = (json.dumps(event.to_dict(), sort_keys=True) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


class EventRecorder:
    """Records phase events of one source; thread-safe.

    Args:
        source: ``"controller"`` or ``"rank-<r>"``.
        sinks: called with every event, in order; a sink that raises is logged and
            dropped for that event (recording never fails the recovery it measures).
        keep: how many events the recorder keeps in memory (oldest dropped first).
    """

    def __init__(self, source: str, sinks: Sequence[Sink] = (), keep: int = 4096):
        self.source = source
        self._sinks: List[Sink] = list(sinks)
        self._keep = keep
        self._events: List[PhaseEvent] = []
        self._lock = threading.Lock()

    def add_sink(self, sink: Sink) -> None:
        with self._lock:
            self._sinks.append(sink)

    def record(self, event: PhaseEvent) -> PhaseEvent:
        """Keep ``event`` and hand it to every sink. Returns it."""
        with self._lock:
            self._events.append(event)
            if len(self._events) > self._keep:
                del self._events[: len(self._events) - self._keep]
            sinks = list(self._sinks)
        for sink in sinks:
            try:
                sink(event)
            except Exception as exc:  # noqa: BLE001 - a broken sink must not fail a recovery
                log.warning("%s: event sink %r failed for %s: %s", self.source, sink, event.name, exc)
        return event

    def mark(self, name: str, iteration: Optional[int] = None, *, wall: Optional[float] = None,
             **detail: Any) -> PhaseEvent:
        """Record an instant (``seconds`` = 0) at ``wall`` (default now)."""
        return self.record(PhaseEvent(name, self.source, time.time() if wall is None else wall, 0.0,
                                      iteration, True, detail))

    def span(self, name: str, start_wall: float, end_wall: float, iteration: Optional[int] = None,
             **detail: Any) -> PhaseEvent:
        """Record a phase whose ends were observed elsewhere (e.g. two message arrivals)."""
        return self.record(PhaseEvent(name, self.source, start_wall, max(0.0, end_wall - start_wall),
                                      iteration, True, detail))

    @contextlib.contextmanager
    def phase(self, name: str, iteration: Optional[int] = None, **detail: Any) -> Iterator[Dict[str, Any]]:
        """Time the ``with`` block as one phase; yields a dict the block may add detail to.

        The event is recorded when the block ends, also when it raises (``ok=False``, the
        error's type and text in ``detail["error"]``); the exception propagates.
        """
        extra: Dict[str, Any] = dict(detail)
        wall, t0 = time.time(), time.monotonic()
        ok = True
        try:
            yield extra
        except BaseException as exc:
            ok = False
            extra["error"] = f"{type(exc).__name__}: {exc}"[:500]
            raise
        finally:
            self.record(PhaseEvent(name, self.source, wall, time.monotonic() - t0, iteration, ok, extra))

    def events(self, name: Optional[str] = None) -> List[PhaseEvent]:
        """The events kept, oldest first; only those called ``name`` if given."""
        with self._lock:
            return [e for e in self._events if name is None or e.name == name]

    def last(self, name: str) -> Optional[PhaseEvent]:
        """The newest event called ``name``, or None."""
        found = self.events(name)
        return found[-1] if found else None


def read_events(path: str) -> List[PhaseEvent]:
    """Every phase event of a JSON-lines file, in file order; [] if the file is absent.

    Lines of another schema version, and lines that are not phase events (a torn last
    line of a killed writer), are skipped.
    """
    out: List[PhaseEvent] = []
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            d = json.loads(line)
            if d.get("v") != EVENT_SCHEMA_VERSION:
                continue
            out.append(PhaseEvent.from_dict(d))
        except (ValueError, AttributeError):
            continue
    return out
