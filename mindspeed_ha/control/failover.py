"""Controller failover: fencing, the roster a successor needs, the takeover window.

A multi-node job's launcher makes its controller the leader of a term
(:mod:`mindspeed_ha.control.lease`: it sets ``Controller.leadership`` and
``Controller.lease``). The leader keeps the roster (who registered, with what layout;
the in-place recoveries so far) in the lease directory; a successor starts from it
(:meth:`Failover.take_over`) and takes no decision until every rank of it registered
again or ``heartbeat_timeout_s`` passed. A controller whose lease ran out, or whose
term a successor took, acts no more (:meth:`Failover.fenced`).

The roster is kept as one JSON fragment per rank, made when the rank registers
(:meth:`Failover.note_rank`), and written off the I/O thread (:class:`RosterWriter`:
the latest version only, at most one write every ``ROSTER_MIN_INTERVAL_S``), so a
registration costs the I/O thread one fragment, not a rewrite of every rank's entry
(16,384 ranks: a 5 MB file; built from the ranks' state each time it took 0.8 s, issue
19). Only the roster that opens a new process-group generation (``write_roster``, before
a RETRY is sent) is written at once, on the I/O thread: a successor must count it.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from mindspeed_ha.control.state import Layout, RankInfo

if TYPE_CHECKING:
    from mindspeed_ha.control.controller import Controller

log = logging.getLogger("mindspeed_ha.control.controller")

#: seconds between two roster writes of the writer thread (registrations arrive by
#: thousands at a job's start; the newest roster is written, the ones between are skipped)
ROSTER_MIN_INTERVAL_S = 1.0


def roster_entry(info: RankInfo) -> str:
    """``info``'s roster entry as a JSON fragment (``"<rank>": {...}``). (``Layout``'s fields are
    plain ints: ``vars`` instead of ``dataclasses.asdict``'s deep copy, a third of a
    registration's cost at 16,384 ranks.)"""
    return json.dumps(str(info.rank)) + ": " + json.dumps(
        {"layout": dict(vars(info.layout)), "pid": info.pid, "host": info.host, "save_dir": info.save_dir,
         "incarnation": info.incarnation, "rejoins": info.rejoins, "verifies": info.verifies})


class RosterWriter:
    """Writes the newest roster to the lease directory on its own thread.

    Writes are ordered by a version number: a version older than the one written last is
    never written (the I/O thread's own ``write_now`` may overtake a pending one).

    Args:
        may_write: asked right before each write; False (a fenced leader) skips it.
        min_interval_s: seconds the thread waits after a write before the next one.
    """

    def __init__(self, may_write: Callable[[], bool], min_interval_s: float = ROSTER_MIN_INTERVAL_S):
        self.may_write = may_write
        self.min_interval_s = min_interval_s
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()  # one write at a time, in version order
        self._pending: Optional[Tuple[int, Any, Callable[[], bytes]]] = None  # (version, lease, payload)
        self._version = 0
        self._written = 0  # the version last written
        self._done = 0  # the newest version handled (written, superseded, refused or failed)
        self._urgent = False  # flush(): write what is pending now, not after the interval
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        #: rosters written (a counter, for tests and the benchmark)
        self.writes = 0

    def submit(self, lease: Any, payload: Callable[[], bytes]) -> None:
        """Have ``payload()`` (called on the writer thread) written soon; replaces a pending one."""
        with self._cond:
            if self._closed:
                return
            self._version += 1
            self._pending = (self._version, lease, payload)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mindspeed-ha-roster", daemon=True)
                self._thread.start()
            self._cond.notify()

    def write_now(self, lease: Any, payload: bytes) -> None:
        """Write ``payload`` on the calling thread (raises OSError); a pending older one is dropped."""
        with self._cond:
            self._version += 1
            version = self._version
            self._pending = None
        try:
            self._write(version, lease, payload)
        finally:
            self._handled(version)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every version submitted so far was handled; False on timeout."""
        with self._cond:
            target = self._version
            self._urgent = True
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: self._done >= target or self._closed, timeout)
            finally:
                self._urgent = False

    def _handled(self, version: int) -> None:
        with self._cond:
            self._done = max(self._done, version)
            self._cond.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Drop what is pending and end the thread (after a write in progress)."""
        with self._cond:
            self._closed = True
            self._pending = None
            self._cond.notify()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)

    def _write(self, version: int, lease: Any, payload: bytes) -> None:
        with self._write_lock:
            if version <= self._written or not self.may_write():
                return
            lease.write_roster_payload(payload)
            self._written = version
            self.writes += 1

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                (version, lease, payload), self._pending = self._pending, None
            try:
                self._write(version, lease, payload())
            except OSError as exc:
                log.warning("controller: cannot write the roster to %s: %s", lease.path, exc)
            except Exception:  # noqa: BLE001 - the writer never dies; the next version is tried
                log.exception("controller: roster write failed")
            self._handled(version)
            with self._cond:  # at most one write per interval: the newest is written next
                self._cond.wait_for(lambda: self._closed or self._urgent, self.min_interval_s)


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
        #: rank -> its roster entry, a JSON fragment made when it registered (:func:`roster_entry`)
        self._entries: Dict[int, str] = {}
        self.writer = RosterWriter(lambda: not self.fenced_now())

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

    def fenced_now(self) -> bool:
        """Whether this controller may not act now (any thread; changes nothing)."""
        ctl = self.ctl
        return ctl.stepped_down is not None or (ctl.leadership is not None and not ctl.leadership.may_act())

    def note_rank(self, info: RankInfo) -> None:
        """``info`` registered (or registered again as a new process): its roster entry."""
        self._entries[info.rank] = roster_entry(info)
        self.roster_dirty = True

    def close(self) -> None:
        """End the roster writer (nothing pending is written: the job is over or a successor leads)."""
        self.writer.close()

    def may_decide(self, now: float) -> bool:
        """Before a decision step: write the roster if it changed; False while this
        controller is fenced or a successor's registration window is open."""
        if self.fenced():
            return False
        if self.roster_dirty and self.ctl.lease is not None:
            self.roster_dirty = False
            self.writer.submit(self.ctl.lease, self._payload_maker())
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
            self.note_rank(info)
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
        return json.loads(self._payload_maker()())

    def _payload_maker(self) -> Callable[[], bytes]:
        """A snapshot of the roster now (O(N) references), encoded when called (on any thread)."""
        entries = [self._entries[r] for r in self.ctl.state.ranks if r in self._entries]
        recoveries = json.dumps([{k: v for k, v in r.items() if k != "ranks"} | {"ranks": {}}
                                 for r in self.ctl.state.recoveries])
        return lambda: ('{"ranks": {' + ", ".join(entries) + '}, "recoveries": ' + recoveries + "}").encode()

    def write_roster(self) -> None:
        """Write the roster to the lease directory now, on this thread (an error is logged, not raised)."""
        self.roster_dirty = False
        lease = self.ctl.lease
        try:
            self.writer.write_now(lease, self._payload_maker()())
        except OSError as exc:
            log.warning("controller: cannot write the roster to %s: %s", lease.path, exc)
