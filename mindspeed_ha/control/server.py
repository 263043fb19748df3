"""The controller's I/O: its ROUTER socket, the socket monitor, ZAP and the wake pipe.

:class:`ControlServer` owns a ZeroMQ ROUTER socket (a CURVE server; processors connect
DEALER sockets as CURVE clients, see :mod:`auth`), the context's ZAP handler, a socket
monitor (a closed TCP connection = the rank's process is gone, detected in well under a
millisecond on the same host) and a wake pipe that other threads write to. It knows
which connection carries which rank (identity and file descriptor) and reads input in
bounded batches; what a message means is :mod:`handlers`' business.

Connections that never authenticate are bounded: libzmq closes a connection whose
handshake (ZMTP greeting, CURVE, ZAP) has not completed ``HANDSHAKE_DEADLINE_S`` after it
was accepted (``ZMQ_HANDSHAKE_IVL``; libzmq's default is 30 s), and :meth:`open` raises
the process's soft limit on open files to its hard limit (:func:`raise_fd_limit`), so
idle or slow peers (issue 21: 1100 idle TCP connections against a soft limit of 1024 left
the port unable to accept a real rank and libzmq's I/O thread spinning on ``EMFILE``) hold
at most what they open within one deadline, out of the hard limit's descriptors, and a
rank's (re)connection still gets in. Above the hard limit libzmq still retries ``accept``
until the deadline frees descriptors (no per-source cap exists in libzmq; docs/ARCHITECTURE.md,
"Transport").

Frames are read fairly (the ROUTER reads its connections in turn); within a batch the
frames of registered ranks are handled first; each frame is checked against its peer's
rate budget (:class:`admission.PeerLimiter`) before it is authenticated, and stamped
with the clock read when it is handled.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import zmq
from zmq.utils.monitor import recv_monitor_message

from mindspeed_ha import env as ha_env
from mindspeed_ha.control import admission, auth, wire
from mindspeed_ha.control.state import summarise_ranks
from mindspeed_ha.errors import ConfigError

#: the controller's roles log under one name (operators and tests filter on it)
log = logging.getLogger("mindspeed_ha.control.controller")

#: frames read from the ROUTER socket per loop turn (the decision step follows each turn)
MAX_FRAMES_PER_TURN = 256
#: socket-monitor events handled per loop turn
MAX_EVENTS_PER_TURN = 1024
#: ZAP requests answered per loop turn (one per connection's handshake: every rank of a
#: large job connects at once, and a request left unanswered past ``HANDSHAKE_DEADLINE_S``
#: fails the handshake, and the rank connects again); about 10 us each
MAX_ZAP_PER_TURN = 1024
#: the listen backlog of the controller's port: the job's ranks, at least ZeroMQ's default
#: of 100 (the kernel caps it at ``net.core.somaxconn``); ZeroMQ's default alone overflows
#: when thousands of ranks connect at once, and each refused SYN is retried after a second
MIN_BACKLOG = 100
#: monitor events libzmq may queue before its I/O thread waits for this one to read them
#: (the default of 1000 lets a burst of failed connections stall every connection)
MONITOR_HWM = 100_000
#: seconds an accepted connection may take to complete its handshake before libzmq
#: closes it (``ZMQ_HANDSHAKE_IVL``); a real rank's takes milliseconds, one that misses
#: it just connects again (its DEALER reconnects on its own)
HANDSHAKE_DEADLINE_S = 5.0
#: ranks' frames per message sent to one node relay (a fan-out to the ranks behind it)
RELAY_BATCH = 256


def pack_subs(subs: Sequence[bytes]) -> bytes:
    """Local connections of a relay (each 1-255 bytes) as one part: each one's length byte, then it."""
    return b"".join(bytes((len(s),)) + s for s in subs)


def unpack_subs(packed: bytes) -> List[bytes]:
    """The inverse of :func:`pack_subs`. Raises ValueError on a part it did not make."""
    subs, i = [], 0
    while i < len(packed):
        n = packed[i]
        if n == 0 or i + 1 + n > len(packed):
            raise ValueError(f"packed subs: bad length {n} at byte {i} of {len(packed)}")
        subs.append(packed[i + 1:i + 1 + n])
        i += 1 + n
    return subs
#: a connection: a ROUTER identity (a rank's own connection), or (relay, sub) for a rank
#: whose frames its node's relay carries (:mod:`mindspeed_ha.control.relay`)
Ident = Union[bytes, Tuple[bytes, bytes]]
#: what the socket monitor reports: closed connections and failed handshakes
MONITOR_EVENTS = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_protocol_error",
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_auth_denied"}


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files (``RLIMIT_NOFILE``) to its hard limit,
    as systemd advises programs that need many descriptors and do not use ``select()``
    (systemd.exec(5), ``LimitNOFILE=``: the soft limit stays 1024 for ``select()``'s sake,
    the hard limit is far higher). libzmq polls with epoll. Returns the soft limit now;
    a failure is logged, not raised."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("controller: cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
        return soft
    log.info("controller: open-file limit raised from %d to %d (idle peers cannot exhaust it)", soft, hard)
    return hard


class ControlServer:
    """The controller's sockets and who is behind each connection.

    Args:
        max_message_bytes: the job's frame size limit.
        auth_key: the job's key (CURVE keys and ZAP are derived from it).
        bind_addr: address to bind; ``*`` for all.
        port: port to bind; 0 picks a free one (see :attr:`port` after :meth:`open`).
        codec: the controller's :class:`wire.Codec` (frames in and out).
        clock: monotonic clock (seconds), read for every item handled.
        limiter: per-peer rate budgets, checked before a frame is authenticated.
        on_disconnect: ``(rank, now)`` when the connection of ``rank`` closed.
        backlog: connections the port queues before they are accepted (the job's ranks).
    """

    def __init__(self, max_message_bytes: int, auth_key: bytes, bind_addr: str, port: int, codec: wire.Codec,
                 clock: Callable[[], float], limiter: admission.PeerLimiter,
                 on_disconnect: Callable[[int, float], None], backlog: int = MIN_BACKLOG):
        self.max_message_bytes = max_message_bytes
        self.keys = auth.derive_keys(auth_key)
        self.bind_addr = bind_addr
        self.port = port
        self.codec = codec
        self.clock = clock
        self.limiter = limiter
        self.on_disconnect = on_disconnect
        self.backlog = max(MIN_BACKLOG, int(backlog))
        #: libzmq I/O threads: one does every connection's CURVE handshake and frames; a
        #: second from 1,024 ranks on (thousands of handshakes at once at start-up)
        self.io_threads = 1 if backlog <= 1024 else 2
        #: ``ZMQ_HANDSHAKE_IVL``: ``HANDSHAKE_DEADLINE_S``, plus 10 ms per rank over 1,024 (up
        #: to libzmq's default of 30 s): thousands of handshakes at once (CURVE, and ZAP
        #: answered by this thread) take that long on a loaded host, and a handshake that
        #: misses the deadline is made again from scratch (4,096 ranks at 5 s: 7,153 failed)
        self.handshake_deadline_s = min(30.0, HANDSHAKE_DEADLINE_S + max(0, int(backlog) - 1024) / 100)
        #: connections refused by libzmq before any frame (failed handshakes, ZAP denials), by reason
        self.transport_rejected = admission.RejectLog(log, "connection")
        self.ctx: Optional[zmq.Context] = None
        #: the ROUTER socket (None until :meth:`open`; anything with its recv/send calls in tests)
        self.router: Any = None
        self.monitor: Any = None
        self.zap: Optional[auth.ZapHandler] = None
        self.closed_zap: Optional[auth.ZapHandler] = None
        self._wake_r = self._wake_w = -1
        self._wake_lock = threading.Lock()
        #: rank -> its connection: the ROUTER identity, or (relay's identity, the rank's
        #: identity at its node's relay) for a rank whose frames its node's relay carries
        self.ident: Dict[int, Ident] = {}
        self.rank_of_ident: Dict[Ident, int] = {}
        #: messages received from node relays (each carries one or more ranks' frames)
        self.relayed_messages = 0
        #: a relay's subs of a fan-out -> their packed part (pack_subs), reused round after round
        self._packed_subs: Dict[Tuple[bytes, ...], bytes] = {}
        self._rank_of_fd: Dict[int, int] = {}
        #: closed connections seen by the monitor, (rank, when), held until the ROUTER has
        #: been read empty: a rank's last frames (its GOODBYE) are handled before its close
        self._closed: List[Tuple[int, float]] = []
        #: those of ``_closed`` a relay reported in the frames read since the last flush (a
        #: relay's close follows that rank's frames on one connection: no wait for the ROUTER
        #: to be read empty; at 16,384 ranks it took 2 s to find it empty: death -> STOP 2.3 s)
        self._closed_relayed: List[Tuple[int, float]] = []
        self._input_empty = False
        #: closed connections reported to ``on_disconnect`` so far (a counter)
        self.closes_reported = 0

    # ------------------------------------------------------------------ sockets
    def open(self) -> None:
        """Create and bind the sockets and the wake pipe. Raises ConfigError if the port
        is in use; whatever was created is closed again before an error propagates."""
        ctx = zmq.Context(io_threads=self.io_threads)
        router = monitor = zap = None
        wake: Tuple[int, ...] = ()
        try:
            zap = auth.ZapHandler(ctx, self.keys)  # before the bind: no connection is ever unchecked
            router = ctx.socket(zmq.ROUTER)
            wire.configure_socket(router, self.max_message_bytes)
            auth.configure_server(router, self.keys)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            router.setsockopt(zmq.HANDSHAKE_IVL, int(self.handshake_deadline_s * 1000))
            router.setsockopt(zmq.BACKLOG, self.backlog)
            raise_fd_limit()
            self._bind(router)
            monitor = self._monitor_socket(ctx, router)
            wake = os.pipe()
            for fd in wake:
                os.set_blocking(fd, False)
        except BaseException:
            for fd in wake:
                os.close(fd)
            wire.close_all(ctx, monitor, router, zap.socket if zap is not None else None)
            raise
        self.ctx, self.router, self.monitor, self.zap = ctx, router, monitor, zap
        self._wake_r, self._wake_w = wake

    def close(self) -> None:
        """Close the wake pipe, the sockets and the context (linger 0); the ZAP handler
        that served stays in :attr:`closed_zap` (for its counters)."""
        with self._wake_lock:
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        ctx, router, monitor, zap = self.ctx, self.router, self.monitor, self.zap
        self.ctx = self.router = self.monitor = self.zap = None
        self.closed_zap = zap or self.closed_zap
        wire.close_all(ctx, monitor, router, zap.socket if zap is not None else None)

    @staticmethod
    def _monitor_socket(ctx: Any, router: Any) -> Any:
        """The monitor's PAIR socket, with room for ``MONITOR_HWM`` queued events."""
        addr = f"inproc://mindspeed-ha-monitor-{id(router):x}"
        router.monitor(addr, MONITOR_EVENTS)
        monitor = ctx.socket(zmq.PAIR)
        try:
            monitor.setsockopt(zmq.LINGER, 0)
            monitor.setsockopt(zmq.RCVHWM, MONITOR_HWM)
            monitor.connect(addr)
        except BaseException:
            monitor.close(linger=0)
            raise
        return monitor

    def _bind(self, router: Any) -> None:
        try:
            if self.port == 0:
                host = self.bind_addr.strip("[]")
                self.port = router.bind_to_random_port(wire.endpoint(host, 0).rsplit(":", 1)[0])
            else:
                router.bind(wire.endpoint(self.bind_addr, self.port))
        except zmq.ZMQError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"controller port {self.port} on {self.bind_addr} is already in use: choose another with "
                    f"--ha-controller-port or {ha_env.TTP_PORT} (1..65535)") from exc
            raise ConfigError(f"cannot bind the controller to {self.bind_addr}:{self.port}: {exc}") from exc

    # ------------------------------------------------------------------ the loop
    def serve(self, turn: Callable[[], bool], stopping: threading.Event, tick_s: float) -> None:
        """Run ``turn`` whenever input arrives or ``tick_s`` passed, until it returns
        True or ``stopping`` is set; then close everything (see :meth:`close`)."""
        wake_r = self._wake_r
        timeout_ms = max(1, int(tick_s * 1000))
        try:
            poller = zmq.Poller()
            for sock in (self.router, self.monitor, self.zap.socket, wake_r):
                poller.register(sock, zmq.POLLIN)
            while not stopping.is_set():
                ready = dict(poller.poll(timeout_ms))  # returns at once while a turn left input behind
                if wake_r in ready:
                    try:
                        while os.read(wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                if turn():
                    break
        finally:
            self.close()

    def wake(self, blocking: bool = True) -> None:
        """Make the loop run a turn now. ``blocking=False`` never waits for the pipe's
        lock (safe in a signal handler that may have interrupted its holder): the loop
        then sees the work within ``tick_s``."""
        if not self._wake_lock.acquire(blocking=blocking):
            return
        try:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except (BlockingIOError, OSError):
                    pass
        finally:
            self._wake_lock.release()

    # ------------------------------------------------------------------ input
    def serve_zap(self) -> None:
        """Answer at most ``MAX_ZAP_PER_TURN`` ZAP requests."""
        if self.zap is not None:
            self.zap.serve(MAX_ZAP_PER_TURN)

    def drain_monitor(self, limit: int = MAX_EVENTS_PER_TURN) -> None:
        """Read at most ``limit`` monitor events: a closed connection of a rank is held for
        :meth:`flush_closed`; failed handshakes are counted.

        The monitor's event and the connection's last frames travel apart: libzmq queues
        the frames a peer sent before it closed on the ROUTER, then the event on the
        monitor, so a loop that reads the monitor first sees the close before the GOODBYE
        (and took a job that ended normally for a dead one).
        """
        if self.monitor is None:
            return
        for _ in range(limit):
            try:
                evt = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            event, now = evt["event"], self.clock()
            if event == zmq.EVENT_DISCONNECTED:
                rank = self._rank_of_fd.pop(int(evt["value"]), None)
                if rank is not None:
                    self._closed.append((rank, now))
            elif event in HANDSHAKE_FAILED:
                self.transport_rejected.note("unauthenticated peers", HANDSHAKE_FAILED[event], now)

    def bind_fd(self, fd: Optional[int], rank: int) -> None:
        """Remember that connection ``fd`` carries ``rank`` (its close is the rank's death).

        File descriptors are reused: a connection that failed (e.g. a flood of refused
        ones) may have had the same number, and its "disconnected" event may still be
        queued. Every event of an earlier connection was queued before this one was
        accepted, so the queue is read up to its bound before a new binding is made.
        """
        if fd is None or self._rank_of_fd.get(fd) == rank:
            return
        self.drain_monitor(MONITOR_HWM + 2 * MAX_EVENTS_PER_TURN)
        # the close of this rank's earlier connection is handled before the new one counts
        self._report_closed([c for c in self._closed if c[0] == rank])
        self._rank_of_fd[fd] = rank

    def forget_rank(self, rank: int) -> None:
        """Connections bound to ``rank`` no longer carry it (a hot switch: the old process's
        close is not the rank's death; a close of it already read is dropped too: the replica
        fallback takes a dead old process); its new connection is bound next (:meth:`bind_fd`)."""
        for fd in [fd for fd, r in self._rank_of_fd.items() if r == rank]:
            del self._rank_of_fd[fd]
        self._closed = [c for c in self._closed if c[0] != rank]

    def flush_closed(self) -> None:
        """Call ``on_disconnect`` for the closes :meth:`drain_monitor` held, once
        :meth:`frames` has read the ROUTER empty since (every frame those ranks sent before
        closing has then been handled); otherwise they wait for a later turn."""
        if self._input_empty:
            self._report_closed(list(self._closed))
        elif self._closed_relayed:
            # a relay reports a close after that connection's last frames, on the same
            # connection: those were read in this batch or before, and are handled by now
            self._report_closed([c for c in self._closed if c in self._closed_relayed])
        self._closed_relayed.clear()

    def _report_closed(self, closed: List[Tuple[int, float]]) -> None:
        for item in closed:
            self._closed.remove(item)
            self.closes_reported += 1
            self.on_disconnect(*item)

    @property
    def input_empty(self) -> bool:
        """Whether the last :meth:`frames` read the ROUTER empty (no frame left queued)."""
        return self._input_empty

    def frames(self, limit: int = MAX_FRAMES_PER_TURN) -> Iterator[Tuple[float, Ident, Optional[int], wire.Message]]:
        """Read frames until at least ``limit`` (a relay's message may carry more); yield
        ``(now, identity, fd, message)`` for each one that passes its peer's budget and the
        codec, registered ranks' frames first (fd None for a relayed frame)."""
        batch: List[Tuple[Ident, Any]] = []
        self._input_empty = False
        while len(batch) < limit:
            try:
                parts = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._input_empty = True
                break
            if len(parts) == 2:
                batch.append((parts[0].bytes, parts[1]))
            elif len(parts) >= 3 and len(parts) % 2 == 1:
                self._relayed(parts, batch)
            else:
                self.codec.rejected["bad_framing"] += 1
                self.codec.reject_log.note(repr(parts[0].bytes), "bad_framing", self.clock())
        ranks = self.rank_of_ident

        def in_order(ident: Ident) -> bool:  # a registered rank's, or a relay's own among its ranks' (NODE_ANSWERS)
            return ident in ranks or (type(ident) is tuple and ident[1] == b"")
        for ident, frame in admission.ranks_first(batch, lambda item: in_order(item[0])):
            now = self.clock()
            if not self.limiter.allow(ident, in_order(ident), now):
                self.codec.rejected["rate_limited"] += 1
                self.codec.reject_log.note(repr(ident), "rate_limited", now)
                continue
            msg = self.codec.try_decode(frame.buffer, peer=repr(ident), now=now)
            if msg is None:
                continue
            fd = None
            if type(ident) is bytes:  # a relayed rank's close is reported by its relay, not by a descriptor
                try:
                    fd = frame.get(zmq.SRCFD)
                except zmq.ZMQError:
                    pass
            yield now, ident, fd, msg

    def _relayed(self, parts: List[Any], batch: List[Tuple[Ident, Any]]) -> None:
        """A node relay's message ``[relay, sub, frame, sub, frame, ...]`` (see :mod:`relay`):
        each frame is queued as from the connection ``(relay, sub)``; an empty frame says that
        the local connection ``sub`` closed (the rank's process is gone), held like a closed
        TCP connection until the ROUTER has been read empty. An empty ``sub`` carries the
        relay's own frame (NODE_ANSWERS, schema 14) in order among its ranks' frames, from
        ``(relay, b"")``: no rank's connection (a ROUTER's identities are never empty)."""
        relay = parts[0].bytes
        self.relayed_messages += 1
        for i in range(1, len(parts), 2):
            ident = (relay, parts[i].bytes)
            if len(parts[i + 1]) == 0:
                rank = self.rank_of_ident.get(ident)
                if rank is not None and self.ident.get(rank) == ident:
                    self._closed.append((rank, self.clock()))
                    self._closed_relayed.append(self._closed[-1])
            else:
                batch.append((ident, parts[i + 1]))

    def discard_input(self) -> None:
        """Read and drop a turn's worth of input (a stepped-down controller answers nothing)."""
        self.drain_monitor()
        self._input_empty = False
        for _ in range(MAX_FRAMES_PER_TURN):
            try:
                self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._input_empty = True
                break
        self.serve_zap()
        self.flush_closed()

    # ------------------------------------------------------------------ output
    def send(self, ident: Ident, body: Any) -> None:
        """Send ``body`` to connection ``ident`` now (a relayed rank's: through its relay).
        Raises zmq.ZMQError (e.g. the peer is gone, its queue is full) or WireError (the
        body does not encode)."""
        frame = self.codec.encode(body)
        self.router.send_multipart([ident, frame] if type(ident) is bytes else [*ident, frame], zmq.NOBLOCK)

    def send_to_ranks(self, ranks: Iterable[int], body: Any) -> int:
        """Send the same ``body`` to every rank of ``ranks``: encoded once, the same frame to
        each connection (a receiver checks ``seq`` per sender, and each sees this ``seq``
        once). Returns how many sends succeeded; a failure is logged at a bounded rate."""
        try:
            frame = self.codec.encode(body)
        except wire.WireError as exc:
            log.warning("controller: cannot send %s: %s", type(body).__name__, exc)
            return 0
        sent, failed = 0, []
        relayed: Dict[bytes, List[Tuple[int, bytes]]] = {}  # relay -> (rank, sub) behind it
        ident_of, send, packed = self.ident.get, self.router.send_multipart, self._packed_subs
        for rank in ranks:
            ident = ident_of(rank)
            if ident is None:
                continue
            if type(ident) is not bytes:
                found = relayed.get(ident[0])
                if found is None:
                    relayed[ident[0]] = [(rank, ident[1])]
                else:
                    found.append((rank, ident[1]))
                continue
            try:
                send([ident, frame], zmq.NOBLOCK)
                sent += 1
            except zmq.ZMQError as exc:
                failed.append((rank, exc))
        if len(packed) > 4 * len(relayed) + 1024:
            packed.clear()  # (the same relays' subs, round after round: a few entries per relay)
        for relay, subs in relayed.items():  # one message per relay and RELAY_BATCH ranks
            for i in range(0, len(subs), RELAY_BATCH):
                chunk = subs[i:i + RELAY_BATCH]
                if len(chunk) == 1:
                    parts: List[bytes] = [relay, chunk[0][1], frame]
                else:  # the frame once, and the local connections the relay hands it to
                    key = tuple([sub for _, sub in chunk])
                    part = packed.get(key)
                    if part is None:
                        part = packed[key] = pack_subs(key)
                    parts = [relay, b"", frame, part]
                try:
                    send(parts, zmq.NOBLOCK)
                    sent += len(chunk)
                except zmq.ZMQError as exc:
                    failed += [(rank, exc) for rank, _ in chunk]
        if failed:
            log.warning("controller: cannot send %s to %s: %s", type(body).__name__,
                        summarise_ranks([r for r, _ in failed]), failed[0][1])
        return sent

    def send_to_rank(self, rank: int, body: Any) -> bool:
        """Send ``body`` to ``rank``'s connection; False (logged) if it has none or the send failed."""
        ident = self.ident.get(rank)
        if ident is None:
            return False
        try:
            self.send(ident, body)
            return True
        except (zmq.ZMQError, wire.WireError) as exc:
            log.warning("controller: cannot send %s to rank %d: %s", type(body).__name__, rank, exc)
            return False
