"""Controller failover: fencing, the roster a successor needs, the takeover window.

A multi-node job's launcher makes its controller the leader of a term
(:mod:`mindspeed_ha.control.lease`: it sets ``Controller.leadership`` and
``Controller.lease``). The leader keeps the roster (who registered, with what layout;
the in-place recoveries so far) in the lease directory; a successor starts from it
(:meth:`Failover.take_over`) and takes no decision until every rank of it registered
again or ``heartbeat_timeout_s`` passed. A controller whose lease ran out, or whose
term a successor took, acts no more (:meth:`Failover.fenced`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any, Dict, Optional

from mindspeed_ha.control.state import Layout, RankInfo

if TYPE_CHECKING:
    from mindspeed_ha.control.controller import Controller

log = logging.getLogger("mindspeed_ha.control.controller")


class Failover:
    """The controller's share of failover; runs on its I/O thread under its lock.

    Args:
        ctl: the controller (its ``state``, ``config``, ``leadership``, ``lease`` and
            ``stepped_down`` are read; ``stepped_down`` and ``first_register_at`` set).
        stopping: set when this controller steps down (its I/O thread ends).
    """

    def __init__(self, ctl: "Controller", stopping: threading.Event):
        self.ctl = ctl
        self.stopping = stopping
        #: a successor: when it started (see take_over); None once its window is over
        self.takeover_at: Optional[float] = None
        #: the roster changed since it was last written
        self.roster_dirty = False

    def fenced(self) -> bool:
        """True once this controller may not act (its lease ran out or a successor took
        a higher term); from then on it handles nothing, for good."""
        ctl = self.ctl
        if ctl.stepped_down is None and ctl.leadership is not None and not ctl.leadership.may_act():
            ctl.stepped_down = ctl.leadership.lost or "leadership lost"
            log.error("controller: STEPPING DOWN (term %d): %s; this controller acts no more and closes its port",
                      ctl.leadership.term.term, ctl.stepped_down)
            self.stopping.set()  # the I/O thread ends and closes the sockets: the ranks see it and follow
        return ctl.stepped_down is not None

    def may_decide(self, now: float) -> bool:
        """Before a decision step: write the roster if it changed; False while this
        controller is fenced or a successor's registration window is open."""
        if self.fenced():
            return False
        if self.roster_dirty and self.ctl.lease is not None:
            self.write_roster()
        return self.takeover_at is None or self._window_over(now)

    def take_over(self, roster: Dict[str, Any], now: float) -> None:
        """Start as the successor of a lost leader (see ``Controller.take_over``)."""
        st = self.ctl.state
        self.takeover_at = now
        st.recoveries.extend(
            dict(r, **{k: None for k in r if k.endswith("_at")}, inherited=True) for r in roster.get("recoveries", ()))
        for rank, rec in roster.get("ranks", {}).items():
            info = RankInfo(rank=int(rank), layout=Layout(**rec["layout"]), last_heartbeat=now, pid=int(rec["pid"]),
                            host=str(rec["host"]), save_dir=rec.get("save_dir"), sender="")
            info.incarnation = int(rec.get("incarnation", 0))
            info.rejoins = bool(rec.get("rejoins", False))
            info.verifies = bool(rec.get("verifies", False))
            st.ranks[int(rank)] = info
        if st.ranks:
            self.ctl.first_register_at = now

    def _window_over(self, now: float) -> bool:
        """True once a successor's registration window is over (then: the ranks that did
        not register again are dead)."""
        ctl, st = self.ctl, self.ctl.state
        missing = sorted(r for r, i in st.ranks.items() if i.sender == "" and i.alive)
        if missing and now - self.takeover_at <= ctl.config.heartbeat_timeout_s:
            return False
        for r in missing:
            st.mark_dead(r, "did not register with the new leader (lost with the previous leader's node)", None,
                         self.takeover_at)
            log.warning("rank %d: did not register with the new leader within %.1f s: lost", r,
                        ctl.config.heartbeat_timeout_s)
            ctl.arbiter.expect_rejoin(r, None, self.takeover_at)
        self.takeover_at = None
        return True

    def roster(self) -> Dict[str, Any]:
        """What a successor needs (JSON-able): ``ranks``, rank -> what its processor
        registered; ``recoveries``, the in-place recoveries so far."""
        st = self.ctl.state
        ranks = {str(r): {"layout": dataclasses.asdict(i.layout), "pid": i.pid, "host": i.host,
                          "save_dir": i.save_dir, "incarnation": i.incarnation, "rejoins": i.rejoins,
                          "verifies": i.verifies} for r, i in st.ranks.items()}
        recoveries = [{k: v for k, v in r.items() if k != "ranks"} | {"ranks": {}} for r in st.recoveries]
        return {"ranks": ranks, "recoveries": recoveries}

    def write_roster(self) -> None:
        """Write :meth:`roster` to the lease directory (an error is logged, not raised)."""
        self.roster_dirty = False
        lease = self.ctl.lease
        try:
            lease.write_roster(self.roster())
        except OSError as exc:
            log.warning("controller: cannot write the roster to %s: %s", lease.path, exc)
