"""Which controller leads the job: terms and a lease on the shared checkpoint filesystem.

The controller runs in node 0's launcher; every other node's launcher is a standby. When
the leader is lost with its node, one standby takes over. The rule that keeps two
controllers from ever both acting (split brain) uses the one thing every node of a
Megatron job already shares and that outlives any node: the checkpoint filesystem
(``--save``, e.g. Lustre, GPFS, NFS), which every rank writes its dying checkpoint to.
A node that cannot reach it cannot save anything either.

* **Terms.** Leadership comes in numbered terms. Term ``t`` is held by whoever created
  the file ``term-<t>.json`` in the job's lease directory. The file is created whole and
  exclusively: written under a private name, then hard-linked to its final name
  (``link(2)`` fails with EEXIST when the name exists, atomically, also on NFS). At most
  one controller per term, ever. The leader is the holder of the highest term. The file
  says where it listens (host, controller port, rendezvous store port).
* **Lease.** The holder of term ``t`` renews its lease every ``lease_s / 4`` by replacing
  ``beat-<t>`` (a counter, written then renamed). A standby never compares clocks across
  nodes: it notes, on its own monotonic clock, when it last saw the counter change. After
  ``lease_s`` without a change it may take term ``t + 1``.
* **Fencing.** A leader acts only while it holds the highest term *and* its last
  successful renewal is younger than ``lease_s / 2``. It checks both before every
  decision it sends (:meth:`Leadership.may_act`). A standby waits a full ``lease_s`` of
  silence. So a leader that was paused or cut off from the filesystem has stopped acting
  at least ``lease_s / 2`` before anyone else can start (assuming the clocks' rates
  differ by less than 2x: the usual lease assumption, no synchronised clocks). Once it
  sees a higher term it steps down for good.

* **Only the job writes it.** Every file is sealed with the job's key (an HMAC line,
  :mod:`sealed`) in a ``0700`` directory of this user; temporary files are created with
  ``O_EXCL | O_NOFOLLOW`` under random names. A file that does not verify (a stranger's
  forged higher term, a malformed or truncated one, a symbolic link) is ignored with a
  log line: it deposes no leader and stops no thread.

A node that loses the filesystem but not the network keeps its workers but cannot lead.
A network partition with the filesystem reachable from both sides leaves the incumbent in
charge while it renews; the other side's standby never takes over, and its ranks wait for
a leader until their deadline (then the usual controller-lost path). Without a shared
directory (no ``--save`` and no ``MINDSPEED_HA_LEASE_DIR``) there is no failover: losing
node 0 ends the job as before (exit 78, or the ranks' own dying checkpoint).

Sources: the lease-with-fencing pattern of Chubby (Burrows, OSDI 2006, section 2.8) and
the term numbers of Raft (Ongaro and Ousterhout, ATC 2014); the exclusive create by
``link(2)``: the Linux ``open(2)`` manual, O_EXCL ("... create a unique file ... and use
link(2) to make a link to the lockfile" on NFS).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from typing import Any, Callable, Dict, Optional

from mindspeed_ha import env as ha_env
from mindspeed_ha.control import sealed

log = logging.getLogger("mindspeed_ha.control.lease")

ENV_LEASE_DIR = ha_env.LEASE_DIR
ENV_LEASE_S = ha_env.LEASE_S
DEFAULT_LEASE_S = 10.0
#: the longest lease, seconds: a standby takes over at most this long after the leader's loss
MAX_LEASE_S = 3600.0
_TERM = re.compile(r"^term-(0|[1-9][0-9]{0,17})\.json$", re.ASCII)
#: largest term, counter file read back, bytes
_MAX_SMALL = 64 << 10
#: refused files logged one line each (a directory full of forgeries writes no more)
_MAX_REFUSED_LOGGED = 32


@dataclasses.dataclass(frozen=True)
class Term:
    """One leadership term: who holds it and where it listens."""

    term: int
    host: str
    port: int  # the controller's port
    store_port: int  # the TCPStore the holder hosts for process-group rebuilds (0: none)
    node_rank: int
    pid: int


def lease_dir(base: str, auth_key: bytes) -> str:
    """The job's lease directory under ``base``: one per job key (hex digest of the key's
    SHA-256, 16 characters), so jobs sharing a filesystem never see each other's terms."""
    return os.path.join(base, hashlib.sha256(b"mindspeed-ha/lease/" + auth_key).hexdigest()[:16])


def lease_seconds() -> float:
    """``MINDSPEED_HA_LEASE_S``, seconds in (0, ``MAX_LEASE_S``], default ``DEFAULT_LEASE_S``
    (``inf`` would mean a standby never takes over).

    Raises:
        ValueError: naming the variable and the accepted range.
    """
    raw = os.environ.get(ENV_LEASE_S, "")
    try:
        value = float(raw) if raw else DEFAULT_LEASE_S
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_LEASE_S:  # NaN fails too
        raise ValueError(f"{ENV_LEASE_S}={raw!r}: accepted range (0, {MAX_LEASE_S:g}] seconds "
                         f"(default {DEFAULT_LEASE_S:g})")
    return value


class LeaseDir:
    """The files of one job's lease directory (see the module doc).

    Every file is sealed with the job's key (:mod:`sealed`): a file a stranger wrote
    (a forged higher term, a counter, a roster), a malformed one, a symbolic link or
    an oversized file counts as absent; it is logged once per name and never raises.
    The directory is made ``0700`` (and must be this user's) before the first write.

    Args:
        path: the directory (:func:`lease_dir`).
        auth_key: the job's key (``MINDSPEED_HA_AUTH_KEY``).
    """

    def __init__(self, path: str, auth_key: bytes):
        if not auth_key:
            raise ValueError(f"the lease directory {path} needs the job's auth key ({ha_env.AUTH_KEY})")
        self.path = path
        self._key = auth_key
        self._ready = False
        #: names of the files refused so far (each is logged once), with the reason
        self.refused: Dict[str, str] = {}

    # ------------------------------------------------------------------ sealed files
    def _prepare(self) -> None:
        if not self._ready:
            sealed.private_dir(self.path)
            self._ready = True

    def _write(self, name: str, payload: bytes, exclusive: bool = False) -> bool:
        self._prepare()
        return sealed.write_sealed(self._key, self.path, name, payload, exclusive=exclusive)

    def _read(self, name: str, parse: Callable[[bytes], Any], limit: int = _MAX_SMALL) -> Any:
        """``parse(payload)`` of the sealed file ``name``; None when absent or refused."""
        try:
            payload = sealed.read_sealed(self._key, self.path, name, limit)
            return None if payload is None else parse(payload)
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - whatever lies there: a stranger's, damaged, not a file
            self._refuse(name, f"{type(exc).__name__}: {exc}")
            return None

    def _refuse(self, name: str, why: str) -> None:
        """Remember (and log, for the first ``_MAX_REFUSED_LOGGED`` names) that ``name`` was refused."""
        if self.refused.get(name) != why:
            first = name not in self.refused
            self.refused[name] = why
            if not first or len(self.refused) <= _MAX_REFUSED_LOGGED:
                log.warning("lease directory %s: %s ignored (%s)", self.path, name, why)
            elif len(self.refused) == _MAX_REFUSED_LOGGED + 1:
                log.warning("lease directory %s: more files ignored; no further line per file", self.path)

    def _names(self) -> list:
        try:
            return os.listdir(self.path)
        except FileNotFoundError:
            return []
        except OSError as exc:
            self._refuse(".", f"cannot list the directory: {exc}")
            return []

    # ------------------------------------------------------------------ terms and counters
    def current(self) -> Optional[Term]:
        """The highest valid term taken so far, or None (never raises)."""
        terms = sorted((int(m.group(1)) for m in map(_TERM.match, self._names()) if m), reverse=True)
        for t in terms:
            term = self._read(f"term-{t}.json", lambda b, t=t: _parse_term(b, t))
            if term is not None:
                return term
        return None

    def take(self, term: Term) -> bool:
        """Create ``term-<term.term>.json`` exclusively with ``term``'s fields. False if
        that term is taken already (someone else holds it).

        Raises:
            OSError: the filesystem's errors; PermissionError: the directory is not this user's.
        """
        payload = json.dumps(dataclasses.asdict(term), sort_keys=True).encode()
        return self._write(f"term-{term.term}.json", payload, exclusive=True)

    def renew(self, term: int, beat: int) -> None:
        """Write the lease counter of ``term`` (raises OSError when the filesystem fails)."""
        self._write(f"beat-{term}", str(int(beat)).encode())

    def beat(self, term: int) -> Optional[int]:
        """The lease counter of ``term``, or None (absent or refused; never raises)."""
        return self._read(f"beat-{term}", lambda b: int(b.decode("ascii")))

    def write_roster(self, roster: dict) -> None:
        """Replace ``roster.json`` (the leader's registrations, for a successor) atomically."""
        self.write_roster_payload(json.dumps(roster).encode())

    def write_roster_payload(self, payload: bytes) -> None:
        """Replace ``roster.json`` with ``payload`` (a JSON object, already encoded) atomically."""
        self._write("roster.json", payload)

    def drop_roster(self) -> None:
        """Remove ``roster.json`` (an earlier run's: a new leader writes its own)."""
        try:
            os.remove(os.path.join(self.path, "roster.json"))
        except FileNotFoundError:
            pass

    def read_roster(self) -> dict:
        """The last roster written ({} when none, or refused; never raises)."""
        roster = self._read("roster.json", json.loads, limit=sealed.MAX_FILE_BYTES)
        if roster is not None and not isinstance(roster, dict):
            self._refuse("roster.json", "not a JSON object")
            roster = None
        return roster or {}

    def write_blob(self, name: str, blob: bytes) -> None:
        """Replace the sealed file ``name`` with ``blob`` (e.g. a rank's start-up record)."""
        self._write(name, blob)

    def read_blob(self, name: str, limit: int = sealed.MAX_FILE_BYTES) -> Optional[bytes]:
        """The payload of the sealed file ``name``, or None (absent or refused; never raises)."""
        return self._read(name, bytes, limit=limit)

    def clear(self) -> None:
        """Remove the directory (the job ended: nobody leads it any more)."""
        shutil.rmtree(self.path, ignore_errors=True)


def _parse_term(payload: bytes, number: int) -> Term:
    """The :class:`Term` in a term file's payload; ValueError unless its fields are exactly
    a term's, of the right types, and its number is the file's."""
    raw = json.loads(payload)
    if not isinstance(raw, dict) or set(raw) != {f.name for f in dataclasses.fields(Term)}:
        raise ValueError("not a term record")
    if not isinstance(raw["host"], str) or not all(
            type(raw[k]) is int and raw[k] >= 0 for k in ("term", "port", "store_port", "node_rank", "pid")):
        raise ValueError("a field of the wrong type")
    if raw["term"] != number:
        raise ValueError(f"holds term {raw['term']}, not {number}")
    return Term(**raw)


class Leadership:
    """The lease of a term this process holds: renewed by a thread of its own.

    Args:
        lease: the job's :class:`LeaseDir`.
        term: the term taken (:meth:`LeaseDir.take` returned True).
        lease_s: the lease, seconds.
        on_lost: called once (from the renewing thread) when leadership is lost: a higher
            term appeared, or no renewal succeeded for ``lease_s / 2``.
    """

    def __init__(self, lease: LeaseDir, term: Term, lease_s: float,
                 on_lost: Optional[Callable[[str], None]] = None, clock: Callable[[], float] = time.monotonic):
        self.lease, self.term, self.lease_s, self.clock = lease, term, lease_s, clock
        self.on_lost = on_lost
        self._beat = 0
        self._renewed_at = clock()
        self.lost: Optional[str] = None
        self._stop = threading.Event()
        self.lease.renew(term.term, self._beat)
        self._thread = threading.Thread(target=self._run, name="mindspeed-ha-lease", daemon=True)
        self._thread.start()

    def may_act(self) -> bool:
        """True while this process holds its term with a lease younger than ``lease_s / 2``
        (in memory: the renewing thread looks for higher terms and never renews late)."""
        if self.lost is not None:
            return False
        if self.clock() - self._renewed_at > self.lease_s / 2:
            self._lose(f"no lease renewal for {self.clock() - self._renewed_at:.1f} s (lease {self.lease_s} s)")
            return False
        return True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            if self.on_lost is not None:
                self.on_lost(why)

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            if self.lost is not None:
                return
            try:
                if self._turn():
                    return
            except Exception:  # noqa: BLE001 - the lease thread outlives any surprise; may_act still fences
                log.exception("lease of term %d: renewal turn failed", self.term.term)

    def _turn(self) -> bool:
        """One renewal; True once leadership is lost."""
        if self.clock() - self._renewed_at > self.lease_s / 2:  # this process was frozen: too late
            self._lose(f"no lease renewal for {self.clock() - self._renewed_at:.1f} s (lease {self.lease_s} s)")
            return True
        cur = self.lease.current()
        if cur is not None and cur.term > self.term.term:
            self._lose(f"term {cur.term} was taken by node {cur.node_rank} ({cur.host}:{cur.port})")
            return True
        try:
            self._beat += 1
            self.lease.renew(self.term.term, self._beat)
            self._renewed_at = self.clock()
        except OSError:
            if self.clock() - self._renewed_at > self.lease_s / 2:
                self._lose(f"the lease directory {self.lease.path} is not writable")
                return True
        return False


class Watch:
    """A standby's view of the leader's lease, on its own clock (no cross-node clocks).

    :meth:`expired` is True once the highest term's counter, after this watch saw it
    move at least once, has not changed for ``lease_s`` seconds of this process's
    monotonic clock (a new term starts the wait again). A term never seen alive (left
    by an earlier run of the job) never expires: a standby never succeeds it.
    """

    def __init__(self, lease: LeaseDir, lease_s: float, clock: Callable[[], float] = time.monotonic):
        self.lease, self.lease_s, self.clock = lease, lease_s, clock
        self._seen = (None, None)
        self._since = clock()
        self._alive: set = set()  # terms whose counter this watch saw move

    def expired(self) -> Optional[Term]:
        """The expired term (the one a standby may succeed), or None while it lives."""
        cur = self.lease.current()
        key = (None if cur is None else cur.term, None if cur is None else self.lease.beat(cur.term))
        now = self.clock()
        if key != self._seen:
            if key[0] is not None and key[0] == self._seen[0]:
                self._alive.add(key[0])
            self._seen, self._since = key, now
            return None
        if cur is not None and cur.term in self._alive and now - self._since > self.lease_s:
            return cur
        return None
