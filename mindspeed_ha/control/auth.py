"""Transport authentication: ZeroMQ CURVE keys derived from the job's auth key, and ZAP.

The controller's ROUTER socket is a CURVE server; every processor's DEALER is a CURVE
client. Both key pairs are derived from ``MINDSPEED_HA_AUTH_KEY`` (the job's HMAC key,
which every rank and the controller already hold), so nothing new is distributed::

    secret = HMAC-SHA256(auth_key, label)          32 bytes, one label per role
    secret_z85 = z85(secret); public_z85 = zmq.curve_public(secret_z85)

A peer without the key cannot complete the CURVE handshake (it cannot encrypt its HELLO
to the server's key), and a peer that learned the server's *public* key is refused by
the ZAP handler, which accepts only the job's client public key. libzmq drops such
connections in its own I/O thread: an unauthenticated peer never reaches the
application, costs no Python time per frame and cannot make the controller log per
frame. The ZAP domain is enforced, so a ROUTER whose ZAP handler is missing refuses
every client (fail closed) instead of accepting all.

Without CURVE in the installed libzmq (``zmq.has("curve")`` false, e.g. a pyzmq built
against a system libzmq without libsodium) the control plane refuses to start with a
:class:`~mindspeed_ha.config.ConfigError`; there is no unauthenticated fallback. The
pyzmq wheels on PyPI always include CURVE.

The HMAC/version/sequence checks of :mod:`wire` still apply to every frame that passes.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import logging
from typing import Any

import zmq
from zmq.utils import z85

from mindspeed_ha import env as ha_env
from mindspeed_ha.errors import ConfigError

log = logging.getLogger(__name__)

#: libzmq's fixed ZAP endpoint (RFC 27), one per context
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"mindspeed-ha"
_SERVER_LABEL = b"mindspeed-ha/curve/server/v1"
_CLIENT_LABEL = b"mindspeed-ha/curve/client/v1"


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """The job's two CURVE key pairs, Z85-encoded (40 bytes each)."""

    server_public: bytes
    server_secret: bytes = dataclasses.field(repr=False)
    client_public: bytes
    client_secret: bytes = dataclasses.field(repr=False)


def _pair(auth_key: bytes, label: bytes):
    secret = z85.encode(hmac.new(auth_key, label, hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def require_curve() -> None:
    """Raise ConfigError unless the installed libzmq supports CURVE."""
    if not zmq.has("curve"):
        raise ConfigError(
            f"the installed ZeroMQ (libzmq {zmq.zmq_version()}, pyzmq {zmq.__version__}) has no CURVE "
            "security, which the mindspeed-ha control plane requires to authenticate its peers; install "
            "the pyzmq wheel from PyPI (pip install --force-reinstall --only-binary=:all: pyzmq) or a libzmq "
            "built with libsodium; check with: python -c \"import zmq; print(zmq.has('curve'))\"")


def derive_keys(auth_key: bytes) -> CurveKeys:
    """The job's CURVE server and client key pairs, derived from its auth key.

    Raises:
        ConfigError: no key, or CURVE unavailable (see :func:`require_curve`).
    """
    if not auth_key:
        raise ConfigError(f"the control plane needs the job's auth key: set {ha_env.AUTH_KEY} (hex)")
    require_curve()
    server_public, server_secret = _pair(auth_key, _SERVER_LABEL)
    client_public, client_secret = _pair(auth_key, _CLIENT_LABEL)
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def configure_server(sock: Any, keys: CurveKeys) -> None:
    """Make ``sock`` (before bind) a CURVE server checked by the ZAP handler of its context."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def configure_client(sock: Any, keys: CurveKeys) -> None:
    """Make ``sock`` (before connect) a CURVE client of the job's controller."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


class ZapHandler:
    """A minimal ZAP handler (RFC 27) served by its owner's I/O thread (no thread of its own).

    Binds the context's ZAP endpoint; :meth:`serve` answers pending requests without
    blocking. Accepts CURVE clients of the job's domain whose public key is the job's
    client key; refuses everything else. ``counts`` holds ``accepted`` / ``denied``.
    Bind it before the server socket binds, close it from the thread that serves it.
    """

    def __init__(self, ctx: Any, keys: CurveKeys):
        self._client_key = z85.decode(keys.client_public)
        self.counts: collections.Counter = collections.Counter()
        self.socket = ctx.socket(zmq.REP)
        try:
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.bind(ZAP_ENDPOINT)
        except BaseException:
            self.socket.close(linger=0)
            raise

    def serve(self, limit: int) -> int:
        """Answer at most ``limit`` pending requests; return how many were answered."""
        done = 0
        while done < limit:
            try:
                req = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.socket.send_multipart(self._answer(req))
            done += 1
        return done

    def _answer(self, req: list) -> list:
        # version, request id, domain, address, identity, mechanism, credentials...
        if len(req) < 6 or req[0] != b"1.0":
            self.counts["denied"] += 1
            return [b"1.0", req[1] if len(req) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
        request_id, domain, mechanism, creds = req[1], req[2], req[5], req[6:]
        ok = (domain == ZAP_DOMAIN and mechanism == b"CURVE" and len(creds) == 1
              and hmac.compare_digest(creds[0], self._client_key))
        self.counts["accepted" if ok else "denied"] += 1
        if ok:
            return [b"1.0", request_id, b"200", b"OK", b"mindspeed-ha", b""]
        return [b"1.0", request_id, b"400", b"not a client of this job", b"", b""]

    def close(self) -> None:
        if not self.socket.closed:
            self.socket.close(linger=0)


__all__ = ["CurveKeys", "ZapHandler", "ZAP_DOMAIN", "ZAP_ENDPOINT", "configure_client", "configure_server",
           "derive_keys", "require_curve"]
