"""The sub-health decision: one window of per-rank values in, flags and their actions out.

Pure: no I/O, no clock (``now`` is an argument), no mutation (new :class:`Track` values
are returned). The controller's :mod:`~mindspeed_ha.control.subhealth_monitor` builds the
window and applies the verdicts; tests call :func:`assess` with chosen values.

Per signal (:data:`SIGNALS`) and rank, a window's value is **degraded** when it is worse
than a reference by at least ``degradation`` (relative, see :func:`worse`) and by more than
``sigma`` standard deviations of the reference sample. Two references, either suffices:

* the peers: the median of the other ranks' values in the same window (sample: theirs);
* the rank's own baseline: the median of its last healthy windows (:data:`HISTORY`, at
  least :data:`MIN_HISTORY` of them; sample: those windows).

"Relative" is against the larger of the reference and a window ``scale`` (for ``step``, the
window's median step time): a rank's own seconds per iteration count as degraded when the
difference is a fraction of the job's step, not of a waiting rank's near-zero own time.

Then, per signal:

1. **many at once**: more than ``many`` of the ranks reporting (and at least 2) degraded
   in the same window is a cluster-wide slowdown (a data or storage stall, a slow shared
   filesystem), not hardware: no rank's streak grows and no baseline moves; after
   ``windows`` such windows in a row one ``cluster_wide`` verdict (once per episode);
2. **hysteresis**: a rank is flagged after ``windows`` consecutive degraded windows (one
   ``flagged`` verdict), and cleared after as many consecutive healthy ones (``cleared``);
3. **escalation by frequency**: the ``escalate_after``-th flag of the same (rank, signal)
   within :data:`~mindspeed_ha.subhealth.ESCALATION_WINDOW_S` (24 h) takes
   ``escalate_action`` instead of the signal's action.

A rank with no value for a signal in a window (no progress, no sampler) keeps its track.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from mindspeed_ha.subhealth import ESCALATION_WINDOW_S, SubhealthSettings


@dataclasses.dataclass(frozen=True)
class Signal:
    """How one signal is read: ``higher_is_worse`` (a step time, a temperature) or lower (a
    clock); ``floor``: the smallest reference a relative change is taken against (a count
    whose baseline is 0); ``aggregate``: a window's value is the ``mean`` of its samples, or
    the ``delta`` of a cumulative counter over the window."""

    higher_is_worse: bool
    floor: float
    aggregate: str
    unit: str


#: signal -> how it is read. ``step``: the rank's own seconds per iteration (the controller's
#: step time x the fraction of time the training thread was not waiting in a collective);
#: the others: device counters (NVML / npu-smi, :mod:`~mindspeed_ha.control.subhealth_sampler`)
SIGNALS: Dict[str, Signal] = {
    "step": Signal(True, 1e-3, "mean", "s"),
    "sm_clock_mhz": Signal(False, 1.0, "mean", "MHz"),
    "temperature_c": Signal(True, 1.0, "mean", "C"),
    "ecc_corrected": Signal(True, 1.0, "delta", "errors"),
    "throttle": Signal(True, 1.0, "mean", "fraction"),
}
#: healthy windows a baseline keeps, and needs before it is used
HISTORY = 20
MIN_HISTORY = 3
FLAGGED, CLEARED, CLUSTER_WIDE = "flagged", "cleared", "cluster_wide"


@dataclasses.dataclass(frozen=True)
class Track:
    """One (rank, signal) over time (rank -1: the cluster-wide episode of a signal)."""

    history: Tuple[float, ...] = ()  # its last healthy windows' values (the baseline)
    streak: int = 0  # consecutive degraded windows
    calm: int = 0  # consecutive healthy windows while flagged
    flagged: bool = False
    flags: Tuple[float, ...] = ()  # when it was flagged, within the escalation window


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What one window concluded: ``kind`` :data:`FLAGGED` / :data:`CLEARED` /
    :data:`CLUSTER_WIDE`; ``score``: value / reference (> 1 is worse, the worst rank's for
    a cluster-wide one); ``windows``: the consecutive windows it rests on; ``action``: one
    of :data:`mindspeed_ha.subhealth.ACTIONS`."""

    kind: str
    signal: str
    ranks: Tuple[int, ...]
    score: float
    windows: int
    action: str
    escalated: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class Assessment:
    """:func:`assess`'s result: the new tracks, the verdicts, and each (rank, signal)'s score
    in this window (for the gauges)."""

    tracks: Dict[Tuple[int, str], Track]
    verdicts: Tuple[Verdict, ...]
    scores: Dict[Tuple[int, str], float]


def worse(signal: str, value: float, reference: float, scale: float = 0.0) -> float:
    """How much worse ``value`` is than ``reference``, relative to the larger of the
    reference, the signal's floor and ``scale`` (0.3: 30% worse; <= 0: not worse)."""
    s = SIGNALS[signal]
    base = max(abs(reference), s.floor, scale)
    return ((value - reference) if s.higher_is_worse else (reference - value)) / base


def _beyond(value: float, sample: Sequence[float], sigma: float) -> bool:
    """``value`` is more than ``sigma`` standard deviations from the sample's median (a
    sample of one, or sigma 0: always)."""
    if sigma <= 0 or len(sample) < 2:
        return True
    return abs(value - statistics.median(sample)) > sigma * statistics.pstdev(sample)


def _degraded(signal: str, value: float, sample: Sequence[float], cfg: SubhealthSettings,
              scale: float) -> Optional[float]:
    """The score of ``value`` against ``sample``'s median when degraded, else None."""
    if not sample:
        return None
    ref = statistics.median(sample)
    w = worse(signal, value, ref, scale)
    if w >= cfg.degradation and _beyond(value, sample, cfg.sigma):
        return 1.0 + w
    return None


def score_of(signal: str, value: float, peers: Sequence[float], history: Sequence[float], scale: float = 0.0) -> float:
    """1 + :func:`worse` as a score (> 1 worse): against the peers' median, else the baseline's, else 1."""
    sample = peers or (history if len(history) >= MIN_HISTORY else ())
    return 1.0 + worse(signal, value, statistics.median(sample), scale) if sample else 1.0


def assess(tracks: Mapping[Tuple[int, str], Track], window: Mapping[int, Mapping[str, float]], now: float,
           cfg: SubhealthSettings, scale: Optional[Mapping[str, float]] = None) -> Assessment:
    """Score one window.

    Args:
        tracks: (rank, signal) -> :class:`Track` before this window (missing: a new one).
        window: rank -> signal -> this window's value (only the signals it has).
        now: the window's end, seconds (any monotonic clock; escalation compares these).
        cfg: the detector's settings.
        scale: signal -> the magnitude a change is relative to when larger than the
            reference (``step``: the window's median step time, so that a rank that waits
            almost the whole step is not "50% worse" than one that waits a little longer:
            only a difference that is a fraction of the job's step counts).

    Returns:
        The :class:`Assessment`.
    """
    out: Dict[Tuple[int, str], Track] = dict(tracks)
    verdicts: List[Verdict] = []
    scores: Dict[Tuple[int, str], float] = {}
    for signal in SIGNALS:
        values = {r: float(v[signal]) for r, v in window.items() if signal in v}
        if not values:
            continue
        span = float((scale or {}).get(signal, 0.0))
        degraded: Dict[int, float] = {}
        for r, v in values.items():
            t = out.get((r, signal), Track())
            peers = [x for q, x in values.items() if q != r]
            scores[(r, signal)] = score_of(signal, v, peers, t.history, span)
            found = [s for s in (_degraded(signal, v, peers, cfg, span),
                                 _degraded(signal, v, t.history, cfg, span) if len(t.history) >= MIN_HISTORY else None)
                     if s is not None]
            if found:
                degraded[r] = max(found)
        many = len(degraded) >= 2 and len(degraded) > cfg.many * len(values)
        verdicts += _cluster(out, signal, degraded, values, many, cfg)
        if many:
            for r in values:
                out[(r, signal)] = dataclasses.replace(out.get((r, signal), Track()), streak=0)
            continue
        for r, v in sorted(values.items()):
            t, v_ = _step(out.get((r, signal), Track()), r, signal, v, degraded.get(r), now, cfg)
            out[(r, signal)] = t
            if v_ is not None:
                verdicts.append(v_)
    return Assessment(out, tuple(verdicts), scores)


def _cluster(out: Dict[Tuple[int, str], Track], signal: str, degraded: Mapping[int, float],
             values: Mapping[int, float], many: bool, cfg: SubhealthSettings) -> List[Verdict]:
    """The cluster-wide episode of ``signal`` (track (-1, signal)): one verdict when it has
    lasted ``windows`` windows; over at the first window that is not one."""
    t = out.get((-1, signal), Track())
    if not many:
        if t.streak or t.flagged:
            out[(-1, signal)] = Track()
        return []
    t = dataclasses.replace(t, streak=t.streak + 1)
    verdicts = []
    if t.streak >= cfg.windows and not t.flagged:
        t = dataclasses.replace(t, flagged=True)
        ranks = tuple(sorted(degraded))
        verdicts.append(Verdict(CLUSTER_WIDE, signal, ranks, max(degraded.values()), t.streak, "event", False,
                                f"{len(ranks)} of {len(values)} ranks degraded at once for {t.streak} windows: a "
                                f"cluster-wide slowdown (data, storage, network), not a rank's hardware"))
    out[(-1, signal)] = t
    return verdicts


def _step(t: Track, rank: int, signal: str, value: float, degraded: Optional[float], now: float,
          cfg: SubhealthSettings) -> Tuple[Track, Optional[Verdict]]:
    """One rank's track after a window that is not cluster-wide."""
    if degraded is None:
        history = (t.history + (value,))[-HISTORY:]
        if t.flagged:
            calm = t.calm + 1
            if calm >= cfg.windows:
                return (dataclasses.replace(t, history=history, streak=0, calm=0, flagged=False),
                        Verdict(CLEARED, signal, (rank,), 1.0, calm, "log", False,
                                f"rank {rank}: {signal} healthy for {calm} windows"))
            return dataclasses.replace(t, history=history, streak=0, calm=calm), None
        return dataclasses.replace(t, history=history, streak=0), None
    streak = t.streak + 1
    t = dataclasses.replace(t, streak=streak, calm=0)
    if streak < cfg.windows or t.flagged:
        return t, None
    flags = tuple(x for x in t.flags if now - x < ESCALATION_WINDOW_S) + (now,)
    escalated = 0 < cfg.escalate_after <= len(flags)
    action = cfg.escalate_action if escalated else cfg.action_for(signal)
    unit = SIGNALS[signal].unit
    reason = (f"rank {rank}: {signal} {value:.4g} {unit} is {degraded:.2f}x its reference for {streak} consecutive "
              f"windows of {cfg.window_s:g} s" + (f"; flagged {len(flags)} times in 24 h: escalated" if escalated else ""))
    return (dataclasses.replace(t, flagged=True, flags=flags),
            Verdict(FLAGGED, signal, (rank,), degraded, streak, action, escalated, reason))


__all__ = ["SIGNALS", "Signal", "Track", "Verdict", "Assessment", "assess", "worse", "score_of",
           "FLAGGED", "CLEARED", "CLUSTER_WIDE", "HISTORY", "MIN_HISTORY"]
