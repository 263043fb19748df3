"""The rank's link to the controller: the DEALER socket and its I/O thread.

* :class:`Outbox`: messages queued for the controller, guarded by the processor's one
  condition variable, and the wake pipe that wakes the I/O thread.
* :class:`ControlLink`: owns the DEALER socket (a CURVE client, keys derived from the
  job's auth key, see :mod:`auth`), its socket monitor and the I/O thread ("heartbeat
  thread"): registers (re-sent while unanswered: :class:`RegisterBackoff`, and at once on
  a new connection), sends a HEARTBEAT every ``heartbeat_interval_s``, drains the outbox, hands every message to the processor.
  ZeroMQ reconnects by itself (100 ms, backing off to 2 s).

Controller loss: the DEALER sends ZeroMQ heartbeats (PING every ``heartbeat_interval_s``;
no answer within ``heartbeat_timeout_s / 2`` closes the connection) and the socket
monitor reports the close, at once when the controller's process dies. With a lease
directory (controller failover) the link follows the leader of a higher term as soon as
one appears and registers again. If no controller answers within another
``heartbeat_timeout_s / 2`` (plus two leases with failover), the controller is lost:
logged once, and the processor's ``on_lost`` runs.

Through a node relay (:mod:`relay`) the same clock runs on the relay's notices: its
controller connection closed (:data:`relay.NOTICE_CLOSED`: the clock starts, nothing but
the notices is expected until) it reached a leader (:data:`relay.NOTICE_OPEN`: register
again through it, the fault this rank waits on first). A relay that has not reached the
leader this rank sees in the lease directory within ``RELAY_FOLLOW_GRACE * lost_after_s``
of the rank seeing it, or whose own socket closes, is left: the rank connects directly. The
grace runs only between the two notices: after NOTICE_OPEN the rank follows the lease's
leader (its term) and awaits REGISTERED through the relay under the loss clock.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import secrets
import threading
import time
from typing import Any, Callable, Deque, Optional, Set, Tuple

import zmq

from mindspeed_ha.control import auth, wire
from mindspeed_ha import env as ha_env
from mindspeed_ha.control.lease import LeaseDir, lease_seconds
from mindspeed_ha.control.relay import NOTICE_CLOSED, NOTICE_OPEN, usable_socket

#: the processor's logger: every line of the rank's control plane keeps the name operators and tests filter on
log = logging.getLogger("mindspeed_ha.control.processor")

#: socket-monitor events of the control connection (its close, a new authenticated one)
CONNECTION_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
#: how long a GOODBYE may take to leave when the processor closes (ms); every other close: 0
GOODBYE_LINGER_MS = 500
#: seconds between two looks into the lease directory while the control connection is closed
LEASE_POLL_S = 0.25
#: a relayed rank that sees a new leader in the lease directory while its relay follows a
#: failover waits this share of ``lost_after_s`` for the relay to reach it, then connects directly
RELAY_FOLLOW_GRACE = 0.5


#: ranks of a job per second of the first REGISTER re-send's mean delay (RegisterBackoff.for_job)
RANKS_PER_FIRST_S = 4096


class RegisterBackoff:
    """When a rank sends REGISTER again while no REGISTERED came (one outstanding at a time).

    A REGISTER is not lost on a working connection (ZeroMQ queues it until the connection
    is made, TCP delivers it): a controller that has not answered is busy, and every copy
    sent meanwhile is more work for it (thousands of ranks re-sending every 0.1 s were a
    storm that kept a 4,096-rank job registering for 34 s). So the first re-send waits
    ``first_s``, each next one twice as long up to ``max_s``, each delay drawn uniformly
    from 0.5x to 1.5x so that the ranks of a job spread out. A new connection re-sends at
    once (see ``ControlLink``): what was queued on the old one may be lost.

    Args:
        first_s: the first delay's mean, seconds.
        max_s: the largest mean delay, seconds.
        rng: uniform [0, 1) draws (tests pass their own).
    """

    def __init__(self, first_s: float = 1.0, max_s: float = 8.0, rng: Callable[[], float] = random.random):
        self.first_s, self.max_s, self.rng = first_s, max_s, rng
        self._mean = first_s

    @classmethod
    def for_job(cls, world_size: int) -> "RegisterBackoff":
        """The schedule of a rank of a ``world_size``-rank job: the first re-send waits 1 s
        per ``RANKS_PER_FIRST_S`` ranks (1 to 8 s). A controller answers some 10,000
        REGISTER per second of its loop's CPU (docs/RESULTS.md); at 16,384 ranks a 1 s first
        delay had most ranks send theirs again before the first answer came (62,326 frames)."""
        return cls(first_s=min(8.0, max(1.0, world_size / RANKS_PER_FIRST_S)))

    def next_delay(self) -> float:
        """Seconds until the next re-send (and the mean doubles, up to ``max_s``)."""
        delay = self._mean * (0.5 + self.rng())
        self._mean = min(2 * self._mean, self.max_s)
        return delay

    def reset(self) -> None:
        self._mean = self.first_s


class Outbox:
    """Messages for the controller, in order; every method but :meth:`poke` expects
    ``cond`` held (the processor's one lock)."""

    def __init__(self, cond: threading.Condition):
        self.cond = cond
        self._queue: Deque[Any] = collections.deque()
        self._wake_pending = False
        self.wake_r = self.wake_w = -1
        self.closed = False  # the processor is closing: nothing new is queued by close()
        self.goodbye_queued = False

    def put_locked(self, body: Any) -> None:
        """Queue ``body`` and wake the I/O thread."""
        self._queue.append(body)
        if not self._wake_pending:
            self._wake_pending = True
            self.poke()

    def add_locked(self, body: Any) -> None:
        """Queue ``body`` without a wake-up (the I/O thread itself, which flushes next)."""
        self._queue.append(body)

    def put_front_locked(self, body: Any) -> None:
        self._queue.appendleft(body)

    def pop_locked(self) -> Optional[Any]:
        """The next message, or None when empty (then the next put wakes the I/O thread)."""
        self._wake_pending = False
        return self._queue.popleft() if self._queue else None

    def poke(self) -> None:
        """Wake the I/O thread (callers hold ``cond``: the pipe is never written after close)."""
        if self.wake_w >= 0:
            try:
                os.write(self.wake_w, b"x")
            except (BlockingIOError, OSError):
                pass

    def open_pipe(self) -> Tuple[int, int]:
        wake = os.pipe()
        for fd in wake:
            os.set_blocking(fd, False)
        self.wake_r, self.wake_w = wake
        return wake

    def close_pipe(self) -> None:
        with self.cond:  # pokes happen under this lock: never write to a closed (reused) fd
            fds, self.wake_r, self.wake_w = (self.wake_r, self.wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def drain_wake(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass


def host_port(endpoint: bytes) -> Tuple[str, str]:
    """(host, port) of a ZeroMQ tcp endpoint, IPv4-mapped IPv6 hosts as IPv4 (libzmq names
    a reconnected peer ``tcp://[::ffff:127.0.0.1]:port``)."""
    text = endpoint.decode(errors="replace").split("://", 1)[-1]
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    return (host[7:] if host.startswith("::ffff:") else host), port


class ControlLink:
    """The DEALER socket of one rank and the I/O thread that serves it (see the module doc).

    Args:
        config: the job's HAConfig.
        rank: global rank.
        codec: the rank's wire codec.
        keys: CURVE keys (:func:`auth.derive_keys`).
        proto: the rank's :class:`~mindspeed_ha.control.protocol.StepProtocol` (status,
            stop request, the fault to report again to a new leader).
        outbox: the messages to send.
        addr / port: the controller endpoint (None: the lease's leader, else the config's).
        handle: ``handle(msg)`` for each message from the controller (I/O thread).
        register_body: the REGISTER to send (I/O thread).
        on_lost: called once when the controller is lost (I/O thread; must not block).
        end: ``end(code, reason)``: ends the rank (run on its own thread).
        world_size: the job's ranks (REGISTER's re-send schedule, :meth:`RegisterBackoff.for_job`).
    """

    def __init__(self, config, rank: int, codec: wire.Codec, keys, proto, outbox: Outbox, *,
                 addr: Optional[str], port: Optional[int], handle: Callable[[wire.Message], None],
                 register_body: Callable[[], wire.Register], on_lost: Callable[[], None],
                 end: Callable[[int, str], None], world_size: int = 1):
        self.config, self.rank, self.codec, self._keys = config, rank, codec, keys
        self.world_size = int(world_size)
        self._proto, self._outbox = proto, outbox
        self._handle, self._register_body, self._on_lost, self._end = handle, register_body, on_lost, end
        self.addr = addr or config.controller_addr
        self.port = config.controller_port if port is None else port
        # controller failover: the leader of the highest term in the job's lease directory
        lease_path = os.environ.get(ha_env.LEASE_DIR)
        self._lease = LeaseDir(lease_path, config.auth_key) if lease_path else None
        self._lease_s = lease_seconds() if lease_path else 0.0
        self._term = -1
        self._next_lease_check = 0.0
        self._left: Set[Tuple[str, str]] = set()  # (host, port) of the leaders this rank left: old news
        if self._lease is not None and addr is None and port is None:
            cur = self._lease.current()
            if cur is not None:  # e.g. a rank restarted after its node was lost: the leader moved
                self.addr, self.port, self._term = cur.host, cur.port, cur.term
        #: the node relay's socket this rank's frames go through (None: a direct connection,
        #: chosen at start-up; the rank goes direct for good when the relay's socket closes)
        relay_path = os.environ.get(ha_env.RELAY)
        self.relay: Optional[str] = relay_path if usable_socket(relay_path) else None
        if relay_path and relay_path != "0" and self.relay is None:
            log.warning("rank %d: %s=%s is not a relay socket of this user (0600 socket in a 0700 directory); "
                        "connecting to the controller directly", rank, ha_env.RELAY, relay_path)
        #: the relay's controller connection closed at (its NOTICE_CLOSED; None: open), and
        #: when this rank saw a higher term's leader meanwhile (I/O thread only)
        self.relay_closed_at: Optional[float] = None
        self._leader_seen_at: Optional[float] = None
        self.registered = threading.Event()
        self.register_attempts = 0  # REGISTER frames sent (I/O thread only)
        self.handshakes = 0  # authenticated connections made so far (I/O thread only)
        self._register_now = False  # a new connection while unregistered: re-send at once
        self.register_error: Optional[str] = None
        self.goodbye_acked = False  # the controller handled this rank's GOODBYE (I/O thread only)
        self._stop_io = threading.Event()
        self._ctx: Optional[zmq.Context] = None
        self.sock = None
        self._monitor = None
        self.thread: Optional[threading.Thread] = None
        #: when the connection closed (None: open), when the controller was declared lost
        self.disconnected_at: Optional[float] = None
        self.controller_lost_at: Optional[float] = None
        self._last_beat: Optional[Tuple[float, float]] = None  # (monotonic, CPU-s) of the last HEARTBEAT

    @property
    def lost_after_s(self) -> float:
        """Seconds without a working control connection before the controller counts as
        lost, and the ZeroMQ heartbeat timeout: half the heartbeat timeout each, so a
        silent controller host is declared lost within ``heartbeat_timeout_s``."""
        return self.config.heartbeat_timeout_s / 2

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        """Make the socket, its monitor and the wake pipe, start the I/O thread; a failure
        closes what was made here and raises. The I/O thread closes them when it ends."""
        ctx = zmq.Context()
        sock = None
        wake: Tuple[int, ...] = ()
        try:
            sock = ctx.socket(zmq.DEALER)
            wire.configure_socket(sock, self.config.max_message_bytes)
            if self.relay is None:  # a local relay's socket needs no CURVE (0700 dir); set before a direct connect
                auth.configure_client(sock, self._keys)
            sock.setsockopt(zmq.ROUTING_ID, f"r{self.rank}-{secrets.token_hex(4)}".encode())
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            # ZMTP heartbeats (libzmq >= 4.2): a silent controller host closes the connection
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(self.config.heartbeat_interval_s * 1000)))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(self.lost_after_s * 1000)))
            self._monitor = sock.get_monitor_socket(CONNECTION_EVENTS)
            sock.connect(f"ipc://{self.relay}" if self.relay else wire.endpoint(self.addr, self.port))
            wake = self._outbox.open_pipe()
            self._ctx, self.sock = ctx, sock
            self.thread = threading.Thread(target=self._loop, name=f"mindspeed-ha-processor-{self.rank}",
                                           daemon=True)
            self.thread.start()
        except BaseException:  # nothing runs yet: close what was made here
            self.thread = None
            self._ctx = self.sock = None
            monitor, self._monitor = self._monitor, None
            self._outbox.wake_r = self._outbox.wake_w = -1
            for fd in wake:
                os.close(fd)
            wire.close_all(ctx, monitor, sock)
            raise

    def stop(self) -> None:
        """Ask the I/O thread to end (it flushes, closes the socket and the pipe)."""
        self._stop_io.set()
        with self._outbox.cond:
            self._outbox.poke()

    def send(self, body: Any) -> None:
        try:
            self.sock.send(self.codec.encode(body), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("rank %d: control queue full, %s dropped", self.rank, type(body).__name__)
        except (zmq.ZMQError, wire.WireError) as exc:
            log.warning("rank %d: cannot send %s: %s", self.rank, type(body).__name__, exc)

    def flush(self) -> None:
        """Send the latest status (if it changed), then every queued message."""
        with self._outbox.cond:
            status = self._proto.status_body_locked()
        if status is not None:
            self.send(status)
        while True:
            with self._outbox.cond:
                body = self._outbox.pop_locked()
            if body is None:
                return
            self.send(body)

    # ------------------------------------------------------------------ the I/O thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._outbox.wake_r, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        hb = self.config.heartbeat_interval_s
        backoff = RegisterBackoff.for_job(self.world_size)
        next_register = time.monotonic()
        next_hb = time.monotonic() + hb
        was_registered = False
        try:
            while not self._stop_io.is_set():
                now = time.monotonic()
                lost = self.controller_lost_at is not None
                registered = self.registered.is_set()
                if was_registered and not registered:  # a new controller asks for it: at once
                    next_register, self._last_beat = now, None  # no beat due until then: no lateness
                    backoff.reset()
                was_registered = registered
                if self._register_now and not registered:
                    next_register = now
                self._register_now = False
                if not lost and not registered and now >= next_register and self.relay_closed_at is None:
                    self.register_attempts += 1
                    log.debug("rank %d: REGISTER #%d to %s:%s", self.rank, self.register_attempts, self.addr,
                              self.port)
                    self.send(self._register_body())
                    next_register = now + backoff.next_delay()
                if not lost and self.registered.is_set() and now >= next_hb:
                    self._beat(now)
                    next_hb = now + hb
                self._check_controller(now)
                wake_at = next_hb if self.registered.is_set() else next_register
                if self.relay_closed_at is not None:  # nothing to send until the relay's notice
                    wake_at = now + LEASE_POLL_S
                if self.disconnected_at is not None and self.controller_lost_at is None:
                    wake_at = min(wake_at, self.disconnected_at + self._lost_after(),
                                  now + LEASE_POLL_S if self._lease is not None else wake_at)
                ready = dict(poller.poll(max(1, int((wake_at - time.monotonic()) * 1000))))
                if self._outbox.wake_r in ready:
                    self._outbox.drain_wake()
                if self._monitor is not None and self._monitor in ready:
                    self._drain_monitor()
                self._receive()
                if self.controller_lost_at is None and self.registered.is_set() and self.disconnected_at is None:
                    with self._outbox.cond:
                        self._proto.queue_stop_request_locked()
                    self.flush()
        except Exception:  # noqa: BLE001 - keep the reason in the log, never crash silently
            log.exception("rank %d: processor I/O thread failed", self.rank)
        finally:
            self._close()

    def _beat(self, now: float) -> None:
        """Send a HEARTBEAT; log a gap of over 3 intervals (ARCHITECTURE.md, "Liveness of a rank")."""
        st, it = self._proto.status()
        self.send(wire.Heartbeat(self.rank, it, st.value))
        last, self._last_beat = self._last_beat, (now, time.process_time())
        if last is not None and now - last[0] > 3 * self.config.heartbeat_interval_s:
            log.warning("rank %d: heartbeat %.2f s after the previous one (%.2f CPU-s of this process meanwhile): its "
                        "I/O thread was not scheduled", self.rank, now - last[0], self._last_beat[1] - last[1])

    def _receive(self) -> None:
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if self.relay is not None and len(frame) <= len(NOTICE_CLOSED) and frame.bytes in (NOTICE_CLOSED,
                                                                                                   NOTICE_OPEN):
                self._relay_notice(frame.bytes, time.monotonic())
                continue
            msg = self.codec.try_decode(frame.buffer, peer="controller")
            if msg is not None and self.controller_lost_at is None:
                self._handle(msg)

    def _relay_notice(self, notice: bytes, now: float) -> None:
        """The relay's controller connection closed (the loss clock starts) or reached a
        leader (register again through it at once, the awaited fault first)."""
        if self.controller_lost_at is not None:
            return
        if notice == NOTICE_CLOSED:
            if self.relay_closed_at is None:
                self.relay_closed_at = now
                if self.registered.is_set() and self.disconnected_at is None:
                    self.disconnected_at = now
                self.registered.clear()
                log.warning("rank %d: the node relay's connection to the controller at %s:%s closed; waiting up to "
                            "%.1f s for it to reach a leader", self.rank, self.addr, self.port, self._lost_after())
            return
        if self.relay_closed_at is None:
            return
        self.relay_closed_at = self._leader_seen_at = None
        cur = self._leader()  # the leader the relay reached (the lease's highest term, or a newer one)
        if cur is not None and cur.term > self._term:  # this rank follows it too: a later close of the
            self.addr, self.port, self._term = cur.host, cur.port, cur.term  # relay's is no news of a leader
        if self.disconnected_at is not None:
            self.disconnected_at = now  # until the leader answers REGISTER (or the loss deadline)
        self.registered.clear()
        self._register_now = True
        with self._outbox.cond:
            self._proto.resend_fault_locked()
        log.warning("rank %d: the node relay reached a leader; following the leader through it (registering "
                    "again)", self.rank)

    def _drain_monitor(self) -> None:
        """Connection events: a close starts the loss clock, a new authenticated connection stops it."""
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                evt = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            now = time.monotonic()
            if host_port(evt.get("endpoint", b"")) in self._left:
                continue  # the connection to a previous leader, or the relay left
            if self.relay is not None and evt["event"] == zmq.EVENT_DISCONNECTED:
                self._leave_relay(now)
                continue
            if evt["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshakes += 1
                # the first connection carries the REGISTER queued before it; a later one
                # may have lost what was queued on the one before: re-send now
                self._register_now = self.handshakes > 1 and not self.registered.is_set()
            if evt["event"] == zmq.EVENT_DISCONNECTED:
                if self.disconnected_at is None and self.registered.is_set() and self.controller_lost_at is None:
                    self.disconnected_at = now
                    log.warning("rank %d: control connection to %s:%s closed; waiting up to %.1f s for a "
                                "controller to answer", self.rank, self.addr, self.port, self.lost_after_s)
            elif evt["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.disconnected_at is not None:
                log.warning("rank %d: control connection to %s:%s open again after %.2f s", self.rank, self.addr,
                            self.port, now - self.disconnected_at)
                self.disconnected_at = None

    def _leave_relay(self, now: float) -> None:
        """The relay's connection closed (its controller connection closed, or the launcher
        is gone): connect directly, as a CURVE client, to the controller this rank knows
        (a closed connection to it then runs the usual loss clock and lease following), and
        register again at once; the fault the training thread waits on goes first."""
        relay, self.relay = self.relay, None
        self.relay_closed_at = self._leader_seen_at = None
        try:
            self.sock.disconnect(f"ipc://{relay}")
        except zmq.ZMQError:
            pass
        self._left.add(host_port(f"ipc://{relay}".encode()))
        auth.configure_client(self.sock, self._keys)  # applies to the connection made next
        self.sock.connect(wire.endpoint(self.addr, self.port))
        if self.registered.is_set() and self.controller_lost_at is None and self.disconnected_at is None:
            self.disconnected_at = now
        self.registered.clear()
        with self._outbox.cond:
            self._proto.resend_fault_locked()
        log.warning("rank %d: the node relay's connection closed; connecting to the controller at %s:%s directly",
                    self.rank, self.addr, self.port)

    def _lost_after(self) -> float:
        """Seconds of closed connection before the controller is lost: ``lost_after_s``,
        plus, with a lease directory, two leases (the leader's lease runs out, a standby
        takes the next term and starts)."""
        return self.lost_after_s + 2 * self._lease_s

    def _leader(self):
        """The lease directory's leader of the highest term (a ``Term``), or None (no lease
        directory, none there, or reading it failed: logged)."""
        if self._lease is None:
            return None
        try:
            return self._lease.current()  # never raises by contract; this thread must outlive any surprise
        except Exception:  # noqa: BLE001
            log.exception("rank %d: reading the lease directory %s failed", self.rank, self._lease.path)
            return None

    def _follow_leader(self, now: float) -> bool:
        """The connection is closed: if a higher term than ours has a leader, connect to
        it and register again (the fault this rank waits on is reported again). True if so."""
        if self._lease is None or now < self._next_lease_check:
            return False
        self._next_lease_check = now + LEASE_POLL_S
        cur = self._leader()
        if cur is None or cur.term <= self._term:
            return False
        if self.relay is not None:  # the relay follows it too: give it RELAY_FOLLOW_GRACE, then go direct
            if self.relay_closed_at is None:
                # the relay reached a leader (NOTICE_OPEN): its REGISTERED is awaited through the
                # relay under the loss clock. Leaving now would close this rank's relayed
                # connection, which the leader takes for its death once it registered it
                # (before: with REGISTERED later than the grace, test_relay)
                return False
            if self._leader_seen_at is None:
                self._leader_seen_at = now
            if now - self._leader_seen_at <= RELAY_FOLLOW_GRACE * self.lost_after_s:
                return False
            log.warning("rank %d: the node relay has not reached a leader within %.1f s; following the leader of "
                        "term %d at %s:%s directly (node %d)", self.rank, now - self._leader_seen_at, cur.term,
                        cur.host, cur.port, cur.node_rank)
            self.addr, self.port, self._term = cur.host, cur.port, cur.term
            self._leave_relay(now)
            return True
        try:
            self.sock.disconnect(wire.endpoint(self.addr, self.port))
        except zmq.ZMQError:
            pass
        old = (self.addr, self.port, self._term)
        if (cur.host, cur.port) != (self.addr, self.port):
            self._left.add(host_port(wire.endpoint(self.addr, self.port).encode()))
        self.addr, self.port, self._term = cur.host, cur.port, cur.term
        self.sock.connect(wire.endpoint(self.addr, self.port))
        self.registered.clear()
        self.disconnected_at = now  # until the new leader answers REGISTER (or the loss deadline)
        with self._outbox.cond:
            self._proto.resend_fault_locked()
        log.warning("rank %d: the controller at %s:%s (term %d) is gone; following the leader of term %d at %s:%s "
                    "(node %d)", self.rank, old[0], old[1], old[2], cur.term, cur.host, cur.port, cur.node_rank)
        return True

    def _check_controller(self, now: float) -> None:
        """Declare the controller lost (once), and end a rank whose stop request nobody answered."""
        if self.controller_lost_at is None and self.disconnected_at is not None and self._follow_leader(now):
            return
        if self.controller_lost_at is None and self.disconnected_at is not None \
                and now - self.disconnected_at > self._lost_after():
            self.controller_lost_at = now
            with self._outbox.cond:
                done = self._proto.exit is not None or self._outbox.closed
            if done:
                return
            log.error("rank %d: CONTROLLER LOST: no controller at %s:%s for %.1f s (connection closed, no "
                      "standby answered); training stops and the ranks write the checkpoint of the last completed "
                      "iteration themselves", self.rank, self.addr, self.port, now - self.disconnected_at)
            self._on_lost()
            return
        if self.controller_lost_at is not None:
            return
        req = self._proto.take_expired_stop_request(now, self.config.heartbeat_timeout_s)
        if req is not None:
            threading.Thread(target=self._end, args=(req.exit_code, f"{req.reason}: no controller acted on the stop "
                             f"request within {self.config.heartbeat_timeout_s} s"), daemon=True).start()

    def _close(self) -> None:
        """End of the I/O thread: flush, close the socket and context, then the wake pipe.

        Linger is 0 except when this close sends a GOODBYE: that frame gets up to
        ``GOODBYE_LINGER_MS`` to leave (``term()`` returns as soon as it has), because
        without it the controller would take a clean exit for a death.
        """
        try:
            if self.controller_lost_at is None:  # nobody to send to otherwise
                self.flush()
        except Exception:  # noqa: BLE001 - closing must not fail
            log.exception("rank %d: cannot flush the control queue", self.rank)
        with self._outbox.cond:
            goodbye = self._outbox.goodbye_queued
        lost = self.controller_lost_at is not None  # nobody to say goodbye to: no linger
        if goodbye and not lost:
            self._await_goodbye_ack()
        ctx, sock, monitor = self._ctx, self.sock, self._monitor
        self._ctx = self.sock = self._monitor = None
        if monitor is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
        linger = GOODBYE_LINGER_MS if goodbye and not lost and not self.goodbye_acked else 0
        wire.close_all(ctx, monitor, sock, linger_ms=linger)
        self._outbox.close_pipe()

    def _await_goodbye_ack(self) -> None:
        """Wait up to ``GOODBYE_LINGER_MS`` for GOODBYE_ACK before the socket closes.

        The controller learns of a closed connection from its socket monitor, which may
        report the close before the GOODBYE that preceded it on the wire has been read:
        without the answer a rank ending normally could be taken for a dead one (found in
        CI: a finished job that attempted a dying checkpoint). Other messages that arrive
        meanwhile are dropped: the rank is ending.
        """
        deadline = time.monotonic() + GOODBYE_LINGER_MS / 1000.0
        while not self.goodbye_acked and self.sock is not None and self.registered.is_set():
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.sock.poll(left_ms, zmq.POLLIN):
                return
            try:
                frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            msg = self.codec.try_decode(frame.buffer, peer="controller")
            if msg is not None and msg.type is wire.MsgType.GOODBYE_ACK:
                self.goodbye_acked = True
