"""A node's relay: the ranks of one node reach the controller over one CURVE connection.

Issue 19: at 16,384 ranks the CURVE handshakes alone (about 0.5 ms of the controller's CPU
and 0.8 ms of the client's per connection, docs/RESULTS.md) keep registration over 10 s.
The launcher of each node (``mindspeed-ha-run``) runs a :class:`NodeRelay` thread:

* a local ROUTER socket bound to ``ipc://<dir>/relay.sock``; ``dir`` is a directory the
  launcher makes with mode 0700 (``tempfile.mkdtemp``) and the socket file is made 0600,
  so only this user's processes on this node reach it; no CURVE on this hop (nothing
  leaves the host). The path reaches the workers as ``MINDSPEED_HA_RELAY``;
* one DEALER socket to the controller, a CURVE client like a processor (:mod:`auth`),
  following the lease directory's leader at start-up (controller failover).

Frames are forwarded unchanged: every rank's frame keeps its own HMAC, sender and ``seq``,
and the controller checks each one as if it came on the rank's own connection. Upstream,
what the local socket holds is sent as one multipart message ``[sub, frame, sub, frame,
...]`` (``sub``: the rank's identity on the local socket; up to ``server.RELAY_BATCH``
pairs), so the heartbeats and statuses of a node's ranks travel together; the controller
(``server.ControlServer.frames``) sees ``[relay, sub, frame, ...]`` and takes
``(relay, sub)`` as the rank's connection. Downstream the controller sends ``[relay, sub,
frame, ...]``, a fan-out of one frame to several of them (STOP, the same ACTION to all) as
``[relay, b"", frame, packed subs]`` (one message per relay and ``RELAY_BATCH`` ranks; the
frame once, ``server.pack_subs``), and the relay hands each frame to its ``sub``. A
closed local connection (the rank's process is gone) is reported upstream as ``[sub,
b""]``, after that connection's last frames: the controller takes it as it takes a
closed TCP connection of a rank.

Heartbeats are merged per node (``merge_heartbeats``, the default; wire schema 13): the
relay verifies each rank's frame with the job's key (:class:`wire.Codec`: HMAC, version,
body, ``seq``); a valid HEARTBEAT is not forwarded but noted, and every heartbeat
interval the relay sends ONE ``NODE_BEAT`` frame of its own (its own sender and ``seq``,
HMAC'd with the job's key) naming the local connections heard since its previous beat.
A connection whose close the relay saw, or that sent no valid HEARTBEAT since the
previous beat, is not named: the relay never reports a rank alive that it did not hear.
Every other frame (STATUS, FAULT, STOPPED, ...) is forwarded unchanged, in order, and
checked by the controller as before. The controller trusts the relay (it holds the job's
key, like any rank) for one thing more: that the ranks a NODE_BEAT names sent it a valid
HEARTBEAT within the last interval.

A round's routine answers are merged too (``merge_answers``, the default; wire schema 14):
a verified STOPPED, ACTION_RESULT with ``ok`` or FAULT of kind ``aborted`` (the answer to an
in-place recovery's abort; :data:`wire.MERGEABLE`) is not forwarded but noted; the answers
read in one turn go up as NODE_ANSWERS frames of the relay's own (one per common body,
naming each rank's ``sub`` and rank; another sender than its NODE_BEATs, HMAC'd with the
job's key), inside the turn's message as the pair ``[b"", frame]``, placed before the first
later frame of any rank they name (a rank's frames reach the controller in the order the
rank sent them: its STATUS / FAULT before its merged STOPPED, its merged answer before its
next frame or its close). Anything else (an error, any other FAULT, a failed ACTION_RESULT,
a frame that does not verify) is forwarded unchanged. The controller handles each named
rank's answer as that rank's own frame from ``(relay, sub)``: the relay vouches that the
rank sent it that body, verified with the job's key and ``seq``, in that order.

When the controller connection closes after it was made, with a lease directory
(controller failover) and ranks connected, the relay follows the leader: it sends every rank behind it
:data:`NOTICE_CLOSED` (their loss clock starts, as a direct rank's does at a close), stops
reading its local socket (what the ranks send meanwhile waits there, in order), connects
to the leader of a higher term the lease directory names (its entries are HMAC'd with the
job key; the connection is CURVE with the job's keys, as a rank's), and once that
connection is authenticated sends :data:`NOTICE_OPEN` (the ranks register again through
it, the fault a rank waits on first) and forwards what waited. No successor within
``follow_s``, or no lease directory: the relay closes its local socket and ends, and every
rank behind it goes on as a directly connected rank (``link.ControlLink``: CURVE to the
controller, or to the next leader of the lease directory); a rank also leaves a relay that
has not reached a leader the rank sees in the lease directory within
``link.RELAY_FOLLOW_GRACE`` x its ``lost_after_s``. A rank that finds no relay socket at
start-up (e.g. started without ``mindspeed-ha-run``) connects directly.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from mindspeed_ha.control import auth, wire
from mindspeed_ha.control.server import RELAY_BATCH, unpack_subs

log = logging.getLogger(__name__)

#: the socket file's name inside the relay's directory
SOCKET_NAME = "relay.sock"
#: frames read from the local socket per turn before what was read is sent upstream
MAX_LOCAL_PER_TURN = 4 * RELAY_BATCH
#: seconds between two looks into the lease directory while not connected (as ``link.LEASE_POLL_S``)
LEASE_POLL_S = 0.25
#: poll timeout of the relay's thread, ms (how soon it sees :meth:`NodeRelay.close`)
POLL_MS = 100
#: the longest socket path AF_UNIX takes on Linux (``sizeof(sockaddr_un.sun_path)`` - 1, bytes)
MAX_SOCKET_PATH = 107
#: downstream transport notices to every rank behind the relay (never a wire frame: those are
#: a msgpack map, whose first byte is not 0): the controller connection closed / is open again
#: to a leader (register again). Sent only while following a failover (see the module doc)
NOTICE_CLOSED = b"\x00mindspeed-ha-relay:controller-closed"
NOTICE_OPEN = b"\x00mindspeed-ha-relay:controller-open"


def socket_base(directory: Optional[str], node_rank: int) -> str:
    """Where a relay makes its directory: ``directory`` (default: the system's temp dir,
    i.e. ``TMPDIR``), or ``/tmp`` when the socket's path there would not fit AF_UNIX's
    :data:`MAX_SOCKET_PATH` bytes (a deep ``TMPDIR``); logged.

    Raises:
        OSError: neither fits (the workers then connect to the controller directly).
    """
    def length(base: str) -> int:  # bytes of the socket's path under ``base`` (mkdtemp adds 8 characters)
        return len(os.fsencode(os.path.join(base, f"mindspeed-ha-relay-{node_rank}-xxxxxxxx", SOCKET_NAME)))

    first = directory or tempfile.gettempdir()
    for base in (first, "/tmp"):
        if length(base) <= MAX_SOCKET_PATH:
            if base != first:
                log.info("relay: %s is too deep for a socket path (%d bytes > %d); using %s", first, length(first),
                         MAX_SOCKET_PATH, base)
            return base
    raise OSError(f"relay: no directory short enough for a socket path of at most {MAX_SOCKET_PATH} bytes "
                  f"({first!r} and /tmp)")


def usable_socket(path: Optional[str]) -> bool:
    """Whether ``path`` is a relay socket a rank may use: a socket file owned by this user
    whose directory is not writable or searchable by others. False for None or anything
    else (the rank then connects directly)."""
    if not path:
        return False
    try:
        st = os.lstat(path)
        dst = os.lstat(os.path.dirname(path) or ".")
    except OSError:
        return False
    uid = os.getuid()
    return (stat.S_ISSOCK(st.st_mode) and st.st_uid == uid and stat.S_ISDIR(dst.st_mode) and dst.st_uid == uid
            and not dst.st_mode & 0o077)


def remove_stale(directory: Optional[str] = None) -> List[str]:
    """Remove the directories of relays that are gone (a launcher that was SIGKILLed cannot
    remove its own): a ``mindspeed-ha-relay-*`` directory in ``directory`` (default: the
    system's temp dir) of this user, that others cannot enter, holding nothing but its
    socket file, on which nobody listens (a connection is refused). A directory without its
    socket yet (a relay starting) or with anything else in it is left alone. Returns the
    paths removed; never raises."""
    import glob
    import socket

    removed: List[str] = []
    base = directory or tempfile.gettempdir()
    for d in glob.glob(os.path.join(glob.escape(base), "mindspeed-ha-relay-*")):
        path = os.path.join(d, SOCKET_NAME)
        try:
            if os.listdir(d) != [SOCKET_NAME] or not usable_socket(path):
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(path)  # a live relay accepts: leave it
        except ConnectionRefusedError:
            try:
                os.unlink(path)
                os.rmdir(d)
                removed.append(d)
            except OSError:
                pass
        except OSError:
            continue
    if removed:
        log.info("removed %d directories of relays that are gone: %s", len(removed), ", ".join(removed[:4]))
    return removed


class NodeRelay:
    """One node's relay thread (see the module doc).

    Args:
        max_message_bytes: the job's frame size limit (each forwarded frame).
        auth_key: the job's key (the CURVE client keys derive from it).
        addr / port: the controller's endpoint.
        node_rank: this node's rank (names the relay's identity).
        directory: where to make the relay's 0700 directory (None: the system's temp dir).
        lease / term: the lease directory (a ``LeaseDir``) and the term of ``addr``/``port``:
            until its first connection is made the relay follows the leader of a higher
            term (a lease left by an earlier run names a dead controller).
        heartbeat_ms / timeout_ms: ZMTP heartbeats on the controller connection: a silent
            controller host closes it after ``timeout_ms`` (the processor's own link uses
            the heartbeat interval and half the heartbeat timeout); ``heartbeat_ms`` is
            also the interval of the merged NODE_BEAT.
        merge_heartbeats: send the ranks' heartbeats as one NODE_BEAT per interval (see the
            module doc) instead of forwarding each HEARTBEAT frame.
        merge_answers: (with ``merge_heartbeats``) send the ranks' routine answers read in
            one turn as NODE_ANSWERS frames (see the module doc) instead of each one's frame.
        follow_s: with ``lease``, seconds after the controller connection closed within
            which a leader of a higher term must be reached, else the relay ends (default:
            ``timeout_ms`` plus two leases, ``lease.lease_seconds()``: a rank's own loss budget).

    Raises:
        ConfigError: ZeroMQ without CURVE (from :func:`auth.derive_keys`).
    """

    def __init__(self, max_message_bytes: int, auth_key: bytes, addr: str, port: int, node_rank: int,
                 directory: Optional[str] = None, heartbeat_ms: int = 1000, timeout_ms: int = 5000,
                 lease=None, term: int = -1, merge_heartbeats: bool = True, merge_answers: bool = True,
                 follow_s: Optional[float] = None):
        self.max_message_bytes = max_message_bytes
        self.keys = auth.derive_keys(auth_key)
        self.addr, self.port, self.node_rank = addr, int(port), int(node_rank)
        self.directory = directory
        self.heartbeat_ms, self.timeout_ms = heartbeat_ms, timeout_ms
        self.lease, self.term = lease, int(term)
        if follow_s is None and lease is not None:
            from mindspeed_ha.control.lease import lease_seconds

            follow_s = timeout_ms / 1000.0 + 2 * lease_seconds()
        self.follow_s = float(follow_s or 0.0)
        #: failovers followed (a new leader reached after the controller connection closed)
        self.followed = 0
        self.dir: Optional[str] = None
        self.path: Optional[str] = None
        self._ctx: Optional[zmq.Context] = None
        self._local = self._up = self._local_mon = self._up_mon = None
        self._stop = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self._sub_of_fd: Dict[int, bytes] = {}
        #: counters: frames up / down, messages up, local closes reported
        self.up_frames = self.down_frames = self.up_messages = self.closes = 0
        #: heartbeat merging: the relay's own codec (its NODE_BEATs; the ranks' frames checked),
        #: the local connections heard since the last beat, and counters
        self.codec = wire.Codec(auth_key, wire.new_sender("relay", self.node_rank), max_message_bytes,
                                max_senders=wire.MAX_SENDERS) if merge_heartbeats else None
        self._heard: Dict[bytes, None] = {}
        #: counters: HEARTBEAT frames merged (not forwarded), NODE_BEAT frames sent
        self.merged = self.beats = 0
        #: answer merging (schema 14): NODE_ANSWERS are sent with a codec (sender) of their own,
        #: since they travel among the ranks' frames and NODE_BEATs apart (each sender's ``seq``
        #: must arrive in order); the answers noted this turn, (type, common body) ->
        #: (body, subs, ranks, frames), the subs among them, and a counter of answers merged
        self.merge_answers = merge_answers and merge_heartbeats
        self.answer_codec = wire.Codec(auth_key, wire.new_sender("relay", self.node_rank), max_message_bytes) \
            if self.merge_answers else None
        self._answers: Dict[Any, Any] = {}
        self._answered: set = set()
        self.answers_merged = 0
        #: why the relay ended by itself (None while it runs or after :meth:`close`)
        self.ended: Optional[str] = None

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.path}"

    def open(self) -> "NodeRelay":
        """Make the directory (0700) and the sockets, start the thread; a failure closes
        what was made and raises (zmq.ZMQError, OSError)."""
        base = socket_base(self.directory, self.node_rank)
        remove_stale(base)
        self.dir = tempfile.mkdtemp(prefix=f"mindspeed-ha-relay-{self.node_rank}-", dir=base)
        self.path = os.path.join(self.dir, SOCKET_NAME)
        ctx = zmq.Context()
        try:
            local = ctx.socket(zmq.ROUTER)
            wire.configure_socket(local, self.max_message_bytes)
            local.setsockopt(zmq.ROUTER_HANDOVER, 1)
            local.bind(self.endpoint)
            os.chmod(self.path, 0o600)
            self._local_mon = self._monitor(ctx, local, zmq.EVENT_DISCONNECTED)
            up = ctx.socket(zmq.DEALER)
            wire.configure_socket(up, self.max_message_bytes)
            auth.configure_client(up, self.keys)
            up.setsockopt(zmq.ROUTING_ID, f"n{self.node_rank}-relay-{secrets.token_hex(4)}".encode())
            up.setsockopt(zmq.RECONNECT_IVL, 100)
            up.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            up.setsockopt(zmq.HEARTBEAT_IVL, max(1, self.heartbeat_ms))
            up.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, self.timeout_ms))
            self._up_mon = self._monitor(ctx, up, zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            up.connect(wire.endpoint(self.addr, self.port))
            self._ctx, self._local, self._up = ctx, local, up
            self.thread = threading.Thread(target=self._loop, name=f"mindspeed-ha-relay-{self.node_rank}",
                                           daemon=True)
            self.thread.start()
        except BaseException:
            ctx.destroy(linger=0)
            self._ctx = self._local = self._up = self._local_mon = self._up_mon = None
            self._remove_dir()
            raise
        log.info("node %d: relay for this node's ranks at %s -> controller %s:%s", self.node_rank, self.path,
                 self.addr, self.port)
        return self

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread (it closes the sockets) and remove the directory. Idempotent."""
        self._stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)
        self._remove_dir()

    @staticmethod
    def _monitor(ctx, sock, events):
        addr = f"inproc://mindspeed-ha-relay-monitor-{id(sock):x}"
        sock.monitor(addr, events)
        mon = ctx.socket(zmq.PAIR)
        mon.setsockopt(zmq.LINGER, 0)
        mon.connect(addr)
        return mon

    def _remove_dir(self) -> None:
        """Remove the directory this relay made (``mkdtemp``: provably ours), with what is
        left in it (the socket file, unless libzmq removed it already)."""
        d, self.dir = self.dir, None
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        for s in (self._local, self._up, self._local_mon, self._up_mon):
            poller.register(s, zmq.POLLIN)
        connected = False
        closed_at: Optional[float] = None  # following a failover since (the local socket is not read)
        next_lease_check = 0.0
        next_beat = time.monotonic() + self.heartbeat_ms / 1000
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                if not connected and self.lease is not None and time.monotonic() >= next_lease_check:
                    next_lease_check = time.monotonic() + LEASE_POLL_S
                    self._follow()
                if self._up_mon in ready:
                    for evt in self._events(self._up_mon):
                        if evt == zmq.EVENT_HANDSHAKE_SUCCEEDED and not connected:
                            connected = True
                            if closed_at is not None:  # a leader reached: the ranks register again through it
                                closed_at = None
                                self._resume(poller)
                        elif evt == zmq.EVENT_DISCONNECTED and connected:
                            connected = False
                            for event, fd in self._events(self._local_mon, values=True):  # who is still here
                                if event == zmq.EVENT_DISCONNECTED:  # (nobody to report a close to now)
                                    self._sub_of_fd.pop(fd, None)
                            if self.lease is not None and self.follow_s > 0 and self._sub_of_fd:
                                closed_at = time.monotonic()
                                self._forward_down()  # what the lost leader sent goes before the notice
                                self._pause(poller)
                                continue
                            self.ended = (f"the connection to the controller at {self.addr}:{self.port} closed; the "
                                          "node's ranks connect to the controller directly")
                            # (the job's normal end: no rank is connected any more, nothing to say)
                            log.log(logging.WARNING if self._sub_of_fd else logging.INFO, "node %d: relay: %s",
                                    self.node_rank, self.ended)
                            return
                if closed_at is not None:
                    if time.monotonic() - closed_at > self.follow_s:
                        self.ended = (f"no leader of a term above {self.term} reached within {self.follow_s:.1f} s "
                                      "of the controller connection's close; the node's ranks connect directly")
                        log.warning("node %d: relay: %s", self.node_rank, self.ended)
                        return
                    continue  # following: nothing is read from the ranks until a leader is reached
                closed = [e for e in self._events(self._local_mon, values=True)] if self._local_mon in ready else []
                self._forward_up()
                if closed:
                    self._report_closed(closed)
                if self._up in ready:
                    self._forward_down()
                if self.codec is not None and time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.heartbeat_ms / 1000
                    self._send_beat()
        except Exception:  # noqa: BLE001 - keep the reason in the log; the ranks go direct
            log.exception("node %d: relay failed; the node's ranks connect to the controller directly",
                          self.node_rank)
            self.ended = "failed"
        finally:
            ctx, self._ctx = self._ctx, None
            if ctx is not None:
                for s in (self._local_mon, self._up_mon):
                    s.close(linger=0)
                self._local.close(linger=0)  # the ranks see their connection close
                self._up.close(linger=0)
                ctx.term()

    def _pause(self, poller) -> None:
        """The controller connection closed (a failover): tell the ranks, stop reading them."""
        for sock in (self._local, self._local_mon):
            poller.unregister(sock)
        self._notify(NOTICE_CLOSED)
        log.warning("node %d: relay: the connection to the controller at %s:%s (term %d) closed; following the "
                    "leader of the lease directory for up to %.1f s (the node's ranks stay on the relay)",
                    self.node_rank, self.addr, self.port, self.term, self.follow_s)

    def _resume(self, poller) -> None:
        """A leader reached after a close: the ranks register again; what waited is forwarded."""
        self.followed += 1
        # the local connections that closed meanwhile, before a frame of a new one on a reused descriptor
        self._report_closed(self._events(self._local_mon, values=True))
        self._notify(NOTICE_OPEN)
        for sock in (self._local, self._local_mon):
            poller.register(sock, zmq.POLLIN)
        log.warning("node %d: relay: connected to the leader of term %d at %s:%s; the node's ranks register again "
                    "through the relay", self.node_rank, self.term, self.addr, self.port)

    def _notify(self, notice: bytes) -> None:
        """``notice`` to every rank connected to the local socket."""
        for sub in self._subs():
            try:
                self._local.send_multipart([sub, notice], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # that rank's connection is gone (ROUTER drops unroutable frames)

    def _subs(self) -> List[bytes]:
        """The local identities of the ranks connected now (by their descriptors)."""
        return list(dict.fromkeys(self._sub_of_fd.values()))

    def _follow(self) -> None:
        """Not connected: point the controller connection at the leader of a higher term."""
        try:
            cur = self.lease.current()
        except Exception:  # noqa: BLE001 - never raises by contract; the thread must outlive a surprise
            log.exception("node %d: relay: reading the lease directory failed", self.node_rank)
            return
        if cur is None or cur.term <= self.term:
            return
        try:
            self._up.disconnect(wire.endpoint(self.addr, self.port))
        except zmq.ZMQError:
            pass
        self.addr, self.port, self.term = cur.host, cur.port, cur.term
        self._up.connect(wire.endpoint(self.addr, self.port))
        log.info("node %d: relay: following the leader of term %d at %s:%s", self.node_rank, cur.term, cur.host,
                 cur.port)

    @staticmethod
    def _events(mon, values: bool = False) -> List[Any]:
        out = []
        while True:
            try:
                evt = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append((evt["event"], evt["value"]) if values else evt["event"])

    def _forward_up(self) -> None:
        """Every frame the local socket holds, to the controller in batches of ``RELAY_BATCH``."""
        parts: List[Any] = []
        for _ in range(MAX_LOCAL_PER_TURN):
            try:
                sub, frame = self._local.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            except ValueError:  # not [identity, frame]: a rank sends one frame per message
                continue
            if len(frame) == 0:
                continue  # an empty frame upstream means "closed": never forwarded from a rank
            try:
                fd = frame.get(zmq.SRCFD)
            except zmq.ZMQError:
                fd = None
            if fd is not None and self._sub_of_fd.get(fd) != sub.bytes:
                # a reused descriptor: an earlier connection's close is reported before it is rebound,
                # after what was read before it
                self._flush_answers(parts)
                if parts:
                    self._send_up(parts)
                    parts = []
                self._report_closed(self._events(self._local_mon, values=True))
                self._sub_of_fd[fd] = sub.bytes
            msg = self._verified(frame) if self.codec is not None and fd is not None else None
            if msg is not None and msg.type is wire.MsgType.HEARTBEAT:
                self.merged += 1
                self._heard[sub.bytes] = None  # named in the next NODE_BEAT, not forwarded
                continue
            if sub.bytes in self._answered:  # that rank's merged answer goes up before this frame
                self._flush_answers(parts)
            if msg is not None and self._merge_answer(sub.bytes, msg, frame):
                continue
            parts += (sub, frame)
            if len(parts) >= 2 * RELAY_BATCH:
                self._send_up(parts)
                parts = []
        self._flush_answers(parts)
        if parts:
            self._send_up(parts)

    def _send_up(self, parts: List[Any]) -> None:
        try:
            self._up.send_multipart(parts, zmq.NOBLOCK, copy=False)
            self.up_frames += len(parts) // 2
            self.up_messages += 1
        except zmq.Again:
            log.warning("node %d: relay: the controller's queue is full; %d frames dropped", self.node_rank,
                        len(parts) // 2)

    def _verified(self, frame: Any) -> Optional[wire.Message]:
        """``frame`` decoded if it is a valid frame of a rank (the job's HMAC, this schema, a
        ``seq`` above its sender's last) small enough to be a HEARTBEAT or a routine answer,
        else None (forwarded as it is: the controller checks and counts it)."""
        if len(frame) > 1024:  # a HEARTBEAT is about 120 bytes, an answer about 200: do not verify the rest
            return None
        try:
            return self.codec.decode(frame.bytes)
        except wire.WireError:
            return None

    def _merge_answer(self, sub: bytes, msg: wire.Message, frame: Any) -> bool:
        """Note a verified routine answer (:data:`wire.MERGEABLE`: STOPPED, ACTION_RESULT ok,
        FAULT aborted) of the rank on ``sub`` for the next NODE_ANSWERS (schema 14); False
        for anything else (forwarded unchanged)."""
        if not self.merge_answers:
            return False
        plain = wire.merged_part(msg.type, msg.body)
        if plain is None:
            return False
        rank = msg.body.rank
        try:
            key = (msg.type.value, tuple(plain.items()))
            group = self._answers.get(key)
        except TypeError:  # a field that is no plain value: not merged
            return False
        if group is None:
            group = self._answers[key] = (plain, [], [], [])
        group[1].append(sub)
        group[2].append(rank)
        group[3].append(frame)
        self._answered.add(sub)
        return True

    def _flush_answers(self, parts: List[Any]) -> None:
        """The answers noted since the last flush, as NODE_ANSWERS frames of the relay's own
        appended to ``parts`` with an empty sub (in order: no frame of a rank named was read
        after its answer); a group that does not encode goes as the ranks' own frames."""
        answers, self._answers = self._answers, {}
        self._answered = set()
        for (answer, _), (plain, subs, ranks, frames) in answers.items():
            for i in range(0, len(subs), wire.MAX_BEAT_SUBS):
                try:
                    frame = self.answer_codec.encode(wire.NodeAnswers(self.node_rank, answer, plain,
                                                                      subs[i:i + wire.MAX_BEAT_SUBS],
                                                                      ranks[i:i + wire.MAX_BEAT_SUBS]))
                    parts += (b"", frame)
                    self.answers_merged += len(subs[i:i + wire.MAX_BEAT_SUBS])
                except wire.WireError:
                    for sub, raw in zip(subs[i:i + wire.MAX_BEAT_SUBS], frames[i:i + wire.MAX_BEAT_SUBS]):
                        parts += (sub, raw)

    def _send_beat(self) -> None:
        """One NODE_BEAT naming the local connections heard since the previous one (none
        heard: nothing is sent)."""
        heard, self._heard = list(self._heard), {}
        for i in range(0, len(heard), wire.MAX_BEAT_SUBS):
            try:
                self._up.send(self.codec.encode(wire.NodeBeat(self.node_rank, heard[i:i + wire.MAX_BEAT_SUBS])),
                              zmq.NOBLOCK)
                self.beats += 1
            except zmq.Again:
                log.warning("node %d: relay: the controller's queue is full; a NODE_BEAT of %d ranks dropped",
                            self.node_rank, len(heard[i:i + wire.MAX_BEAT_SUBS]))

    def _report_closed(self, events) -> None:
        parts: List[Any] = []
        for event, fd in events:
            sub = self._sub_of_fd.pop(fd, None)
            if sub is not None:
                self._heard.pop(sub, None)  # a closed connection is never named alive
            if event == zmq.EVENT_DISCONNECTED and sub is not None:
                parts += (sub, b"")
        if parts:
            self.closes += len(parts) // 2
            self._send_up(parts)

    def _forward_down(self) -> None:
        for _ in range(MAX_LOCAL_PER_TURN):
            try:
                parts = self._up.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(parts) == 3 and len(parts[0]) == 0:  # a fan-out: [b"", frame, packed subs]
                try:
                    subs = unpack_subs(parts[2].bytes)
                except ValueError:
                    continue
                for sub in subs:
                    try:
                        self._local.send_multipart([sub, parts[1]], zmq.NOBLOCK, copy=False)
                        self.down_frames += 1
                    except zmq.ZMQError:
                        pass  # that rank's connection is gone (ROUTER drops unroutable frames)
                continue
            if len(parts) % 2:
                continue  # not [sub, frame, ...]: the controller sends pairs only
            for i in range(0, len(parts), 2):
                try:
                    self._local.send_multipart(parts[i:i + 2], zmq.NOBLOCK, copy=False)
                    self.down_frames += 1
                except zmq.ZMQError:
                    pass  # that rank's connection is gone (ROUTER drops unroutable frames)
