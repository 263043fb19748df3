"""The controller's side of the sub-health detector (``--ha-subhealth``): windows in,
verdicts applied. The decision itself is :func:`mindspeed_ha.control.policy.subhealth.assess`.

What it reads, all on the controller thread under its lock (:mod:`.handlers` calls
:meth:`SubhealthMonitor.on_progress` for every STATUS UPDATED(k) and
:meth:`SubhealthMonitor.on_health` for every HEALTH; the controller calls
:meth:`SubhealthMonitor.tick` at each decision step):

* a rank's **step time** over a window: (controller clock between its last progress before
  the window and its last progress in it) / (iterations completed in between), from the
  STATUS and HEALTH frames it already sends, times its **busy** fraction (the sampler's:
  the share of time its training thread was not waiting in a collective; 1 when not
  sampled) = its own seconds per iteration, the ``step`` signal;
* its **device counters** from HEALTH: the window's mean, or the delta of a cumulative one.

Windows are counted only while the job is RUNNING with every rank registered; a window
that sees anything else (a recovery, a pause, a stop) is dropped and the next one starts.

Each verdict is applied by its action (:data:`mindspeed_ha.subhealth.ACTIONS`): ``log`` a
line; ``event`` and above a job event (``Subhealth``, ``SubhealthCleared``,
``SubhealthClusterWide``) that the metrics count; ``check`` / ``switch`` the operator's verb
of that name for the flagged rank (:func:`.operator_desk.internal_request`; where this build
has no such verb: logged ``sub-health action <x> not available: <reason>``, the event keeps
the outcome); ``exit`` the graceful stop (checkpoint of the last completed iteration, exit 75).
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from mindspeed_ha.control import job_events, operator_desk
from mindspeed_ha.control.policy.subhealth import CLEARED, CLUSTER_WIDE, FLAGGED, SIGNALS, Track, Verdict, assess
from mindspeed_ha.control.state import Phase
from mindspeed_ha.subhealth import ACTIONS, SubhealthSettings

if TYPE_CHECKING:
    from mindspeed_ha.control.controller import Controller

log = logging.getLogger("mindspeed_ha.control.controller")

#: counters a HEALTH may carry (more are ignored)
MAX_COUNTERS = 16
#: event type of each verdict kind
EVENT_TYPES = {FLAGGED: "Subhealth", CLEARED: "SubhealthCleared", CLUSTER_WIDE: "SubhealthClusterWide"}
#: verdicts a status keeps (newest)
KEEP_VERDICTS = 20


class SubhealthMonitor:
    """Windows of one job's per-rank observations and what they concluded.

    Args:
        cfg: the detector's settings.
    """

    def __init__(self, cfg: SubhealthSettings):
        self.cfg = cfg
        self.tracks: Dict[Tuple[int, str], Track] = {}
        #: (rank, signal) -> score of the last window (> 1: worse than its reference)
        self.scores: Dict[Tuple[int, str], float] = {}
        #: (rank, signal) -> what the flag said, while flagged
        self.flagged: Dict[Tuple[int, str], Dict[str, Any]] = {}
        self.verdicts: List[Dict[str, Any]] = []
        self.windows = 0  # windows scored
        self.window_start: Optional[float] = None
        self._progress: Dict[int, Tuple[float, int]] = {}  # rank -> (when, iteration) of its last progress
        self._first: Dict[int, Tuple[float, int]] = {}  # the same at the window's start
        self._busy: Dict[int, List[float]] = {}  # rank -> [busy samples, samples]
        self._counters: Dict[int, Dict[str, List[float]]] = {}
        self._last_counter: Dict[Tuple[int, str], float] = {}

    # ------------------------------------------------------------------ observations (I/O thread)
    def on_progress(self, now: float, rank: int, iteration: int) -> None:
        """Rank ``rank`` has completed ``iteration`` (seen at ``now``, the controller's clock)."""
        last = self._progress.get(rank)
        if last is None or iteration > last[1]:
            self._progress[rank] = (now, int(iteration))
        elif iteration < last[1]:  # rolled back (a recovery): progress counts from here
            self._progress[rank] = (now, int(iteration))
            self._first.pop(rank, None)

    def on_health(self, now: float, rank: int, body: Any) -> None:
        """A HEALTH of ``rank`` (values that are not finite numbers, or unknown names, are dropped)."""
        if body.iteration >= 0:
            self.on_progress(now, rank, body.iteration)
        if body.samples > 0 and 0.0 <= body.busy <= 1.0:
            acc = self._busy.setdefault(rank, [0.0, 0.0])
            acc[0] += body.busy * body.samples
            acc[1] += body.samples
        got = self._counters.setdefault(rank, {})
        for name, value in list(body.counters.items())[:MAX_COUNTERS]:
            if (name in SIGNALS and name != "step" and isinstance(value, (int, float))
                    and not isinstance(value, bool) and math.isfinite(value)):
                got.setdefault(name, []).append(float(value))

    # ------------------------------------------------------------------ windows (decision step)
    def tick(self, ctl: "Controller", now: float) -> None:
        """Close the window when it is due: score it, apply the verdicts, start the next."""
        st = ctl.state
        if st.phase is not Phase.RUNNING or len(st.ranks) < st.world_size or self.window_start is None:
            self._restart(now)
            return
        if now - self.window_start < self.cfg.window_s:
            return
        window, steps = self.window(st.alive_ranks())
        scale = {"step": statistics.median(steps)} if steps else {}
        log.debug("sub-health window %d: %s (scale %s)", self.windows + 1, window, scale)
        a = assess(self.tracks, window, now, self.cfg, scale)
        self.tracks, self.scores, self.windows = a.tracks, a.scores, self.windows + 1
        for v in a.verdicts:
            apply(ctl, self, now, v)
        self._restart(now)

    def window(self, ranks: List[int]) -> Tuple[Dict[int, Dict[str, float]], List[float]]:
        """(rank -> signal -> the value of the window now ending (only what it has), the
        ranks' step times in it, seconds per iteration)."""
        out: Dict[int, Dict[str, float]] = {}
        steps: List[float] = []
        for r in ranks:
            values: Dict[str, float] = {}
            a, b = self._first.get(r), self._progress.get(r)
            if a is not None and b is not None and b[1] > a[1]:
                busy = self._busy.get(r)
                fraction = busy[0] / busy[1] if busy and busy[1] else 1.0
                steps.append((b[0] - a[0]) / (b[1] - a[1]))
                values["step"] = steps[-1] * fraction
            for name, xs in self._counters.get(r, {}).items():
                if SIGNALS[name].aggregate == "delta":
                    prev = self._last_counter.get((r, name), xs[0])
                    values[name] = max(0.0, xs[-1] - prev)
                    self._last_counter[(r, name)] = xs[-1]
                else:
                    values[name] = statistics.fmean(xs)
            if values:
                out[r] = values
        return out, steps

    def _restart(self, now: float) -> None:
        self.window_start = now
        self._first = dict(self._progress)
        self._busy, self._counters = {}, {}

    # ------------------------------------------------------------------ views
    def snapshot(self) -> Dict[str, Any]:
        """JSON-able: the flagged (rank, signal)s, last scores, recent verdicts, settings."""
        return {"windows": self.windows, "window_s": self.cfg.window_s,
                "flagged": [dict(rank=r, signal=s, **d) for (r, s), d in sorted(self.flagged.items())],
                "scores": [{"rank": r, "signal": s, "score": round(v, 4)} for (r, s), v in sorted(self.scores.items())
                           if r >= 0],
                "verdicts": list(self.verdicts[-KEEP_VERDICTS:])}


def apply(ctl: "Controller", mon: SubhealthMonitor, now: float, v: Verdict) -> None:
    """Carry out verdict ``v`` by its action (see the module docstring). I/O thread, under
    the controller's lock."""
    signal_action = mon.cfg.action_for(v.signal)
    action = v.action if v.kind == FLAGGED else ("log" if signal_action == "log" else "event")
    outcome = ""
    if v.kind == FLAGGED:
        mon.flagged[(v.ranks[0], v.signal)] = {"since": round(now, 3), "score": round(v.score, 4),
                                               "windows": v.windows, "action": v.action, "escalated": v.escalated}
    elif v.kind == CLEARED:
        mon.flagged.pop((v.ranks[0], v.signal), None)
    log.log(logging.INFO if v.kind == CLEARED else logging.WARNING, "sub-health: %s (%s) -> %s", v.reason, v.kind,
            action)
    if action in ("check", "switch"):
        ok, outcome = operator_desk.internal_request(ctl, now, action, v.ranks, f"sub-health: {v.reason}")
        if not ok:
            log.warning("sub-health action %s not available: %s", action, outcome)
            outcome = f"not available: {outcome}"
    elif action == "exit":
        if ctl.state.request_stop(now, -1, f"sub-health: {v.reason}"):
            outcome = "graceful stop requested: checkpoint of the last completed iteration, exit 75"
            log.warning("sub-health: graceful stop requested (%s)", v.reason)
        else:
            outcome = f"no graceful stop now (phase {ctl.state.phase.value})"
            log.warning("sub-health: %s", outcome)
    mon.verdicts.append({"kind": v.kind, "signal": v.signal, "ranks": list(v.ranks), "score": round(v.score, 4),
                         "windows": v.windows, "action": action, "escalated": v.escalated, "outcome": outcome})
    if ACTIONS.index(action) >= ACTIONS.index("event"):
        job_events.note(ctl.recorder, EVENT_TYPES[v.kind], None, ranks=v.ranks, reason=v.reason, kind=v.kind,
                        signal=v.signal, score=round(v.score, 4), windows=v.windows, action=action,
                        escalated=v.escalated, outcome=outcome)


__all__ = ["SubhealthMonitor", "apply", "EVENT_TYPES"]
