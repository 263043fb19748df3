"""The operator's client: ``mindspeed-ha status | pause | resume | stop | check | relink`` to a running job.

It reaches the job's controller as a rank does: over the controller's CURVE-encrypted
ROUTER socket (:mod:`.auth`: keys derived from the job key ``MINDSPEED_HA_AUTH_KEY`` or
``--key-file``), with the same HMAC-tagged, versioned, size-limited msgpack frames
(:mod:`.wire`), addressed as the ranks address it: ``--addr HOST:PORT``, else the leader
of the highest term in the job's lease directory (``MINDSPEED_HA_LEASE_DIR``, or the job's
under ``MINDSPEED_HA_LEASE_ROOT``: controller failover, as :class:`~.link.ControlLink`
follows a takeover), else ``CONTROLLER_ADDR`` /
``TTP_ADDR`` and ``TTP_PORT``. One request, one reply (:mod:`.operator_desk`); while no
reply has come and the lease directory names a newer leader, the same request (same id:
the controller answers a repeat without acting twice) goes to it.

Exit codes (distinct from the launcher's 75-79; README, "Operating a running job"):

====  =====================================================================
0     done
1     the action failed (e.g. a pause that ended in a fault before every rank held)
2     usage: a bad flag, no key, no address
4     refused in the job's current state (e.g. ``pause`` during a recovery; the reason is printed)
5     unreachable: no controller answered within ``--timeout``
6     authentication failed: the controller refused this key (CURVE handshake)
====  =====================================================================
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from typing import Any, Dict, Mapping, Optional, Tuple

import zmq
from zmq.utils.monitor import recv_monitor_message

from mindspeed_ha import env as ha_env
from mindspeed_ha.config import DEFAULT_MAX_MESSAGE_BYTES, auth_key_from, controller_addr_from, port_from
from mindspeed_ha.control import auth, wire
from mindspeed_ha.control.lease import LeaseDir, lease_dir
from mindspeed_ha.errors import ConfigError, OperatorError

EXIT_DONE, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_AUTH = 0, 1, 2, 4, 5, 6
#: seconds between two looks into the lease directory while no reply came
LEASE_POLL_S = 0.25
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the controller listens: host, port and, from a lease directory, its term."""

    host: str
    port: int
    term: int = -1


def read_key(key_file: Optional[str], env: Mapping[str, str]) -> bytes:
    """The job key: ``key_file`` (hex, as ``MINDSPEED_HA_AUTH_KEY``) or the environment.

    Raises:
        ConfigError: no key, an unreadable file, not hex, shorter than 16 bytes.
    """
    if key_file:
        try:
            with open(key_file) as f:
                raw = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"--key-file {key_file}: {exc.strerror}") from None
        return auth_key_from({ha_env.AUTH_KEY: raw}) or b""
    key = auth_key_from(env)
    if key is None:
        raise ConfigError(f"no job key: set {ha_env.AUTH_KEY} (hex) or give --key-file")
    return key


def parse_addr(text: str) -> Target:
    """``HOST:PORT`` (IPv6: ``[::1]:PORT``) -> Target. Raises ConfigError naming --addr."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--addr {text!r}: expected HOST:PORT with a port in 1..65535")
    return Target(host, int(port))


def find_controller(addr: Optional[str], key: bytes, env: Mapping[str, str]) -> Target:
    """The controller to ask (see the module doc for the order).

    Raises:
        ConfigError: a bad ``--addr`` / environment value, or no usable port.
    """
    if addr:
        return parse_addr(addr)
    lease = _lease(key, env)
    if lease is not None:
        cur = lease.current()
        if cur is not None:
            return Target(cur.host, cur.port, cur.term)
    port = port_from(None, env)
    if port == 0:
        raise ConfigError(f"{ha_env.TTP_PORT}=0: the launcher picked the port (its log says 'controller listening "
                          "on HOST:PORT'); give --addr HOST:PORT")
    return Target(controller_addr_from(None, env), port)


def _lease(key: bytes, env: Mapping[str, str]) -> Optional[LeaseDir]:
    """The job's lease directory: ``MINDSPEED_HA_LEASE_DIR`` (what the ranks get), else the
    job's directory under ``MINDSPEED_HA_LEASE_ROOT`` (what the launchers get; for a job
    that kept the default, ``<--save>/.mindspeed_ha``), else None."""
    path = env.get(ha_env.LEASE_DIR)
    if not path and env.get(ha_env.LEASE_ROOT):
        path = lease_dir(os.path.abspath(env[ha_env.LEASE_ROOT]), key)
    return LeaseDir(path, key) if path else None


def request(verb: str, *, key: bytes, target: Target, timeout_s: float, max_s: float = 0.0,
            then_stop: bool = False, request_id: Optional[str] = None,
            env: Optional[Mapping[str, str]] = None,
            max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
            params: Optional[Mapping[str, Any]] = None) -> wire.OperatorReply:
    """Send one OPERATOR_REQUEST and wait up to ``timeout_s`` for its reply.

    ``max_bytes``: the job's frame limit (``MINDSPEED_HA_MAX_MESSAGE_BYTES``), for the reply.
    ``params``: the verb's arguments (``check``, ``relink``: :mod:`.pause_tasks`; ``switch``: ``ranks``).

    Raises:
        OperatorError: :data:`EXIT_AUTH` (the controller refused the key) or
            :data:`EXIT_UNREACHABLE` (no reply within ``timeout_s``).
    """
    env = os.environ if env is None else env
    body = wire.OperatorRequest(request_id or secrets.token_hex(8), verb, float(max_s), bool(then_stop),
                                dict(params or {}))
    codec = wire.Codec(key, wire.new_sender("operator"), max_bytes)
    keys = auth.derive_keys(key)
    lease = _lease(key, env) if target.term >= 0 else None
    deadline = time.monotonic() + timeout_s
    ctx = zmq.Context()
    sock = monitor = None
    try:
        while True:
            sock, monitor = _connect(ctx, keys, target, max_bytes)
            sock.send(codec.encode(body))
            reply, moved = _await(sock, monitor, codec, body.request_id, deadline, lease, target)
            if reply is not None:
                return reply
            wire.close_all(None, monitor, sock)
            sock = monitor = None
            target = moved  # a newer leader: the same request (same id) goes to it
    finally:
        wire.close_all(ctx, monitor, sock)


def _connect(ctx: Any, keys: auth.CurveKeys, target: Target, max_bytes: int) -> Tuple[Any, Any]:
    sock = ctx.socket(zmq.DEALER)
    wire.configure_socket(sock, max_bytes)
    auth.configure_client(sock, keys)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED)
    sock.connect(wire.endpoint(target.host, target.port))
    return sock, monitor


def _await(sock: Any, monitor: Any, codec: wire.Codec, rid: str, deadline: float, lease: Optional[LeaseDir],
           target: Target) -> Tuple[Optional[wire.OperatorReply], Target]:
    """(the reply, target) or (None, a newer leader's target). Raises OperatorError."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    authenticated, refused = False, ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            if refused and not authenticated:
                raise OperatorError(EXIT_AUTH, f"the controller at {target.host}:{target.port} refused this key "
                                    f"({refused}): not the job's {ha_env.AUTH_KEY}")
            raise OperatorError(EXIT_UNREACHABLE, f"no answer from the controller at {target.host}:{target.port} "
                                f"within the timeout" + ("" if authenticated else " (no connection)"))
        ready = dict(poller.poll(max(1, int(min(left, LEASE_POLL_S) * 1000))))
        if monitor in ready:
            evt = recv_monitor_message(monitor)
            if evt["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                authenticated = True
            elif evt["event"] & _HANDSHAKE_FAILED:
                refused = "CURVE handshake failed"
                if not authenticated:  # a wrong key never gets in: no use waiting out the timeout
                    raise OperatorError(EXIT_AUTH, f"the controller at {target.host}:{target.port} refused this "
                                        f"key ({refused}): not the job's {ha_env.AUTH_KEY}")
        if sock in ready:
            msg = codec.try_decode(sock.recv(), peer="controller")
            if msg is not None and msg.type is wire.MsgType.OPERATOR_REPLY and msg.body.request_id == rid:
                return msg.body, target
        if lease is not None:
            cur = lease.current()
            if cur is not None and cur.term > target.term:
                return None, Target(cur.host, cur.port, cur.term)


def result_code(reply: wire.OperatorReply) -> int:
    """The CLI's exit code for a reply: its own code when it is one of ours, else 1."""
    return reply.code if reply.code in (EXIT_DONE, EXIT_FAILED, EXIT_REFUSED) else EXIT_FAILED


def format_status(s: Dict[str, Any]) -> str:
    """``status`` for a person: the job line, the ranks' table, pauses and recoveries."""
    lines = [f"job phase {s['phase']} for {s['phase_since_s']:.1f} s, controller term {s['term']}, "
             f"{s['world_size']} ranks, features: {', '.join(s['features']) or '-'}"]
    if s.get("pause"):
        p = s["pause"]
        lines.append(f"paused after iteration {p['iteration']} for {p['since_s']:.1f} s"
                     + (f" (resumes after {p['max_s']:g} s)" if p.get("max_s") else ""))
    if s.get("stop_requested"):
        lines.append(f"graceful stop requested: {s['stop_requested']}")
    lines.append("ranks by state: " + ", ".join(f"{k} {v}" for k, v in s["by_state"].items() if v))
    lines.append(f"{'rank':>4} {'state':10} {'iteration':>9} {'optimizer':9} {'heartbeat':>9}  pid@host")
    for r in s["ranks"]:
        age = r.get("heartbeat_age_s")
        lines.append(f"{r['rank']:>4} {r['state']:10} {r.get('iteration', '-'):>9} {r.get('optimizer', '-'):9} "
                     f"{'-' if age is None else f'{age:.2f} s':>9}  {r.get('pid', '-')}@{r.get('host', '-')}")
    for rec in s.get("recoveries", []):
        secs = ", ".join(f"{k} {v:.3f} s" for k, v in rec["phase_seconds"].items())
        lines.append(f"recovery: {rec['kind']} on rank {rec['rank']} at iteration {rec['iteration']} "
                     f"({rec['mode']}): {secs}")
    for sw in s.get("switches", []):
        secs = ", ".join(f"{k} {v:.3f} s" for k, v in sw["phase_seconds"].items())
        lines.append(f"hot switch of ranks {sw['ranks']}: {sw['phase']}" + (f" ({sw['reason']})" if sw["reason"] else "")
                     + (f": {secs}" if secs else ""))
    lines.append(f"spares: {s['spares'] if s.get('spares') is not None else 'not reported to the controller'}")
    sub = s.get("subhealth")
    if sub is not None:
        flagged = "; ".join(f"rank {f['rank']} {f['signal']} x{f['score']:.2f} ({f['action']}"
                            f"{', escalated' if f['escalated'] else ''})" for f in sub["flagged"]) or "none"
        lines.append(f"sub-health: {sub['windows']} windows of {sub['window_s']:g} s; flagged: {flagged}")
    return "\n".join(lines)


def format_task(r: Dict[str, Any]) -> str:
    """A check's or relink's result for a person: one line, then one per rank."""
    names = {0: "ok", 1: "not run", 2: "fault", 3: "timeout"}
    lines = [f"{r['kind']} code {r['code']} ({names.get(r['code'], '?')}) at iteration {r.get('iteration')}: "
             f"{r.get('seconds', 0):.3f} s on the ranks, {r.get('pause_seconds', 0):.3f} s from the request; "
             f"job {r.get('after')}"]
    for rank, row in sorted(r.get("ranks", {}).items(), key=lambda kv: int(kv[0])):
        tests = row.get("tests") or {}
        secs = ", ".join(f"{n} {t.get('code')}" + (f" {t['seconds']:.4f} s" if "seconds" in t else "")
                         for n, t in tests.items())
        extra = f" bound {row['bound']}" if "bound" in row else ""
        lines.append(f"  rank {rank}: code {row['code']}{extra}" + (f" [{secs}]" if secs else "")
                     + (f" {'; '.join(row['reasons'])}" if row.get("reasons") else ""))
    return "\n".join(lines)


__all__ = ["EXIT_AUTH", "EXIT_DONE", "EXIT_FAILED", "EXIT_REFUSED", "EXIT_UNREACHABLE", "EXIT_USAGE",
           "OperatorError", "Target", "find_controller", "format_status", "format_task", "parse_addr", "read_key", "request",
           "result_code"]
