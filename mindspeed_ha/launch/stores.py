"""TCPStores a launcher hosts, listening on the job's interface only.

torch's ``TCPStore(host, port, is_master=True)`` listens on every interface whatever
``host`` says (torch 2.13: ``host`` is where clients connect; the server binds the
wildcard address, measured with ``ss -ltn``). A store hosted here listens on one
address: a socket bound to ``host`` is made first and handed to the store
(``master_listen_fd``, which the store then owns and closes). A TCPStore has no
authentication: whoever reaches the address can read and write every key, which is why
what mindspeed-ha keeps in one is sealed with the job's key
(:mod:`mindspeed_ha.recovery.startup_blob`) and README.md states the trust boundary.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket

log = logging.getLogger("mindspeed_ha.launcher")

#: listen backlog of a hosted store (torch's own TCPStore uses the same order)
BACKLOG = 2048


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (``port`` 0: a free one), the first
    address ``host`` resolves to.

    Raises:
        OSError: ``host`` does not resolve to a local address, or the port is taken.
    """
    family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def _loopback_alias(host: str) -> bool:
    """True if ``host`` is a name (not an IP literal, not ``localhost``) that resolves to a
    loopback address: binding it would shut other nodes out, where torch's wildcard does not."""
    name = host.strip("[]")
    try:
        ipaddress.ip_address(name)
        return False
    except ValueError:
        pass
    if name == "localhost":
        return False
    try:
        addr = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return False
    return ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback


def tcp_store(host: str, port: int, world_size, timeout: datetime.timedelta, *, wait_for_workers: bool,
              multi_tenant: bool = False):
    """A ``torch.distributed.TCPStore`` server listening on ``host:port`` only (torch's
    wildcard, with a warning, when ``host`` is a host name that resolves to a loopback
    address here: other nodes know it by another address).

    Raises:
        OSError: see :func:`listening_socket`; RuntimeError: torch's store errors.
    """
    import torch.distributed as dist

    if _loopback_alias(host):
        log.warning("TCPStore on %s:%d listens on every interface: %s is a host name that resolves to a loopback "
                    "address here (e.g. /etc/hosts' 127.0.1.1), which other nodes could not reach; pass an IP "
                    "address to listen on that interface only", host, port, host)
        return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=wait_for_workers,
                             multi_tenant=multi_tenant)
    sock = listening_socket(host, port)
    try:
        store = dist.TCPStore(host.strip("[]"), sock.getsockname()[1], world_size, True, timeout,
                              wait_for_workers=wait_for_workers, multi_tenant=multi_tenant,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store


__all__ = ["listening_socket", "tcp_store"]
