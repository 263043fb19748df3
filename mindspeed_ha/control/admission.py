"""What the controller admits per loop turn: rate limits and rate-limited rejection logs.

Pure bookkeeping, no I/O and no clock of its own: every call takes ``now`` (monotonic
seconds), so tests drive it with chosen times.

* :class:`TokenBucket`: ``rate`` tokens per second up to ``burst``.
* :class:`PeerLimiter`: one bucket per registered rank (generous: a healthy rank sends a
  few frames per heartbeat interval), one small bucket per other peer, and one bucket
  shared by all other peers, so neither one peer nor many new peers can take more than
  a fixed share. Checked before a frame is authenticated, so a dropped frame costs a
  dictionary lookup and no HMAC.
* :class:`RejectLog`: rejected frames are counted, not logged one by one: the first from
  a peer is logged, then at most one line per peer per ``interval_s`` with the count
  since, at most ``max_lines`` such lines per interval in all, and once per interval one
  summary line for whatever was counted but not logged.
* :func:`ranks_first`: the order in which one turn's frames are handled.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Dict, Hashable, List, Optional, Sequence, TypeVar

#: per registered rank (frames/s, burst); a healthy rank sends well under 100/s
RANK_RATE, RANK_BURST = 1000.0, 1000.0
#: per peer that is not a registered rank (a rank before REGISTERED re-sends with backoff)
STRANGER_RATE, STRANGER_BURST = 20.0, 20.0
#: shared by all such peers, at least this much; the controller scales it with the world size
STRANGERS_RATE, STRANGERS_BURST = 200.0, 200.0
#: other peers whose buckets are remembered (least recently seen forgotten first)
MAX_STRANGERS = 4096

T = TypeVar("T")


class TokenBucket:
    """``rate`` tokens per second, at most ``burst``; starts full."""

    __slots__ = ("rate", "burst", "tokens", "last")

    def __init__(self, rate: float, burst: float, now: float):
        self.rate, self.burst = float(rate), float(burst)
        self.tokens, self.last = float(burst), now

    def allow(self, now: float, cost: float = 1.0) -> bool:
        """Take ``cost`` tokens if there are that many (refilled up to ``now``)."""
        if now > self.last:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False


class PeerLimiter:
    """Per-peer frame budgets (see the module docstring).

    Args:
        strangers_rate / strangers_burst: the budget shared by every peer that is not a
            registered rank (scale it with the world size: all ranks register at once).
        max_strangers: how many such peers keep their own bucket.
    """

    def __init__(self, strangers_rate: float = STRANGERS_RATE, strangers_burst: float = STRANGERS_BURST,
                 max_strangers: int = MAX_STRANGERS):
        self._ranks: Dict[Hashable, TokenBucket] = {}
        self._strangers: "collections.OrderedDict[Hashable, TokenBucket]" = collections.OrderedDict()
        self._shared: Optional[TokenBucket] = None
        self._shared_budget = (float(strangers_rate), float(strangers_burst))
        self.max_strangers = int(max_strangers)

    def allow(self, peer: Hashable, is_rank: bool, now: float) -> bool:
        """May the next frame of ``peer`` (a registered rank or not) be handled at ``now``?"""
        if is_rank:
            bucket = self._ranks.get(peer)
            if bucket is None:
                bucket = self._ranks[peer] = TokenBucket(RANK_RATE, RANK_BURST, now)
            return bucket.allow(now)
        if self._shared is None:
            self._shared = TokenBucket(*self._shared_budget, now)
        bucket = self._strangers.get(peer)
        if bucket is not None:
            self._strangers.move_to_end(peer)
            return bucket.allow(now) and self._shared.allow(now)
        if not self._shared.allow(now):  # a new peer gets a bucket only if the shared budget admits it
            return False
        bucket = self._strangers[peer] = TokenBucket(STRANGER_RATE, STRANGER_BURST, now)
        bucket.allow(now)
        while len(self._strangers) > self.max_strangers:
            self._strangers.popitem(last=False)
        return True


class _PeerCount:
    __slots__ = ("logged_at", "count", "reasons")

    def __init__(self) -> None:
        self.logged_at: Optional[float] = None
        self.count = 0
        self.reasons: collections.Counter = collections.Counter()


class RejectLog:
    """Counts rejected frames by peer and reason and logs them at a bounded rate.

    At most ``max_lines`` per-peer lines plus one summary line per ``interval_s``,
    whatever the rate of rejections or the number of peers. ``totals`` counts every
    rejection by reason since the start.

    Args:
        logger: where the warnings go.
        what: what is rejected, for the messages (e.g. "control frame").
        interval_s: the least time between two lines about one peer, and the summary period.
        max_lines: per-peer lines per interval, all peers together.
        max_peers: peers counted individually; the rest are counted as "other peers".
    """

    OTHERS = "other peers"

    def __init__(self, logger: logging.Logger, what: str = "control frame", interval_s: float = 10.0,
                 max_lines: int = 5, max_peers: int = 1024):
        self.log = logger
        self.what = what
        self.interval_s = float(interval_s)
        self.max_lines = int(max_lines)
        self.max_peers = int(max_peers)
        self.totals: collections.Counter = collections.Counter()
        self.lines = 0  # warning lines written so far
        self._peers: Dict[str, _PeerCount] = {}
        self._window_start: Optional[float] = None
        self._window_lines = 0

    def note(self, peer: str, reason: str, now: float, detail: str = "") -> None:
        """Count one rejected frame of ``peer`` at ``now``; log it if the budget allows."""
        self.totals[reason] += 1
        self.flush(now)
        p = self._peers.get(peer)
        if p is None:
            if len(self._peers) >= self.max_peers:
                peer = self.OTHERS
                p = self._peers.get(peer)
            if p is None:
                p = self._peers[peer] = _PeerCount()
        p.count += 1
        p.reasons[reason] += 1
        if self._due(p, now):
            self._line(peer, p, now, detail)

    def flush(self, now: float) -> None:
        """Once per ``interval_s``: a line for each peer due one (within the budget), then
        one summary line for whatever else was counted but not logged."""
        if self._window_start is None:
            self._window_start = now
        if now - self._window_start < self.interval_s:
            return
        elapsed, self._window_start, self._window_lines = now - self._window_start, now, 0
        rest: Dict[str, _PeerCount] = {}
        for peer, p in list(self._peers.items()):
            if p.count and self._due(p, now):
                self._line(peer, p, now)
            elif p.count:
                rest[peer] = p
            elif p.logged_at is None or now - p.logged_at >= self.interval_s:
                del self._peers[peer]  # quiet for an interval: forgotten (bounded table)
        if rest:
            reasons: collections.Counter = collections.Counter()
            for p in rest.values():
                reasons.update(p.reasons)
            top = sorted(rest.items(), key=lambda kv: -kv[1].count)[:3]
            self._emit("%d more %ss rejected from %d peer(s) in the last %.1f s (%s; most from %s); all so far: %s",
                       sum(p.count for p in rest.values()), self.what, len(rest), elapsed, dict(reasons),
                       ", ".join(f"{peer}: {p.count}" for peer, p in top), dict(self.totals))
            for p in rest.values():
                p.count = 0
                p.reasons.clear()

    def _due(self, p: _PeerCount, now: float) -> bool:
        return ((p.logged_at is None or now - p.logged_at >= self.interval_s)
                and self._window_lines < self.max_lines)

    def _line(self, peer: str, p: _PeerCount, now: float, detail: str = "") -> None:
        self._window_lines += 1
        self._emit("%ss from %s rejected: %d since %s (%s)%s; all so far: %s", self.what, peer, p.count,
                   "the start" if p.logged_at is None else f"{now - p.logged_at:.1f} s ago", dict(p.reasons),
                   f", last: {detail}" if detail else "", dict(self.totals))
        p.logged_at, p.count = now, 0
        p.reasons.clear()

    def _emit(self, fmt: str, *args) -> None:
        self.lines += 1
        self.log.warning(fmt, *args)


def ranks_first(batch: Sequence[T], is_rank: Callable[[T], bool]) -> List[T]:
    """The frames of registered ranks first, then the others; arrival order kept within each."""
    ranks: List[T] = []
    others: List[T] = []
    for item in batch:
        (ranks if is_rank(item) else others).append(item)
    return ranks + others


__all__ = ["TokenBucket", "PeerLimiter", "RejectLog", "ranks_first", "RANK_RATE", "RANK_BURST", "STRANGER_RATE",
           "STRANGER_BURST", "STRANGERS_RATE", "STRANGERS_BURST", "MAX_STRANGERS"]
