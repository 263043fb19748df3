"""Controller failover on the launcher's side (:mod:`mindspeed_ha.control.lease`).

A multi-node job with ``--enable-worker-reboot`` keeps a lease directory (under
``MINDSPEED_HA_LEASE_ROOT``, else ``<--save>/.mindspeed_ha``): node 0's launcher leads term
0 with its in-process controller (:func:`lead`); every other launcher runs a
:class:`Standby` that watches the lease and, when it runs out, takes the next term with a
successor controller and a new TCPStore for the process-group rebuilds.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from typing import Optional

from mindspeed_ha import env as ha_env
from mindspeed_ha.errors import ConfigError
from mindspeed_ha.launch.survivors import Survivors

log = logging.getLogger("mindspeed_ha.launcher")


def lease_dir(nnodes: int, save: Optional[str], config):
    """The job's lease directory (a ``LeaseDir``), or None: only with ``--nnodes`` > 1 and
    ``--enable-worker-reboot``, under ``MINDSPEED_HA_LEASE_ROOT`` or else
    ``<--save>/.mindspeed_ha``; exported to the workers as ``MINDSPEED_HA_LEASE_DIR``.

    Raises:
        ConfigError: the lease length (``MINDSPEED_HA_LEASE_S``) is out of range; the
            directory cannot be made ``0700`` for this user (a symbolic link, another user's).
    """
    from mindspeed_ha.control.lease import ENV_LEASE_DIR, LeaseDir, lease_dir as job_lease_dir, lease_seconds
    from mindspeed_ha.control.sealed import private_dir

    root = os.environ.get(ha_env.LEASE_ROOT) or (os.path.join(save, ".mindspeed_ha") if save else None)
    os.environ.pop(ENV_LEASE_DIR, None)  # never an inherited one
    if nnodes < 2 or not config.worker_reboot:
        return None
    if root is None:
        log.warning("--nnodes %s without --save or %s: no controller failover (losing node 0 ends the job)",
                    nnodes, ha_env.LEASE_ROOT)
        return None
    try:
        lease_seconds()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    path = job_lease_dir(os.path.abspath(root), config.auth_key)
    try:
        private_dir(path)  # 0700, this user's: refused before anything starts otherwise
    except OSError as exc:
        raise ConfigError(f"lease directory {path} (under {ha_env.LEASE_ROOT} or <--save>/.mindspeed_ha): "
                          f"{exc}; it must be a directory of this user") from None
    os.environ[ENV_LEASE_DIR] = path
    return LeaseDir(path, config.auth_key)


def leader_alive(lease) -> bool:
    """Whether the highest term of ``lease`` has a live leader: its counter moves, or a
    successor takes the next term, within three leases (a standby takes over about one
    lease after the leader's last renewal). A term left by an earlier run of the same job
    (nothing moves) is not: the new run leads the next term (terms are never reused or
    removed while a job may run)."""
    from mindspeed_ha.control.lease import lease_seconds

    first = lease.current()
    if first is None:
        return False
    lease_s, beat = lease_seconds(), lease.beat(first.term)
    end = time.monotonic() + 3 * lease_s
    while time.monotonic() < end:
        time.sleep(lease_s / 8)  # polling a file the leader rewrites: nothing to wait on
        cur = lease.current()
        if cur is not None and (cur.term != first.term or lease.beat(cur.term) != beat):
            return True
    log.warning("lease directory %s: term %d was left by an earlier run (its lease did not move for %.1f s): "
                "this run leads the next term", lease.path, first.term, 3 * lease_s)
    return False


def first_term(lease) -> Optional[int]:
    """The term node 0's launcher leads: 0 for a new job, the next one after a term an
    earlier run left; None when a live leader runs the job (a replacement node 0 joins it)."""
    cur = lease.current()
    if cur is None:
        return 0
    if not leader_alive(lease):
        return cur.term + 1  # a term left by an earlier run: never reuse a term
    log.warning("node 0: the job is led by the controller of term %d (node %d): this launcher joins it",
                cur.term, cur.node_rank)
    return None


def lead(controller, lease, term: int, host: str, store_port: int, node_rank: int) -> bool:
    """Take ``term`` for ``controller`` (listening on ``host``); False if someone else has."""
    from mindspeed_ha.control.lease import Leadership, Term, lease_seconds

    t = Term(term, host, controller.port, store_port, node_rank, os.getpid())
    if not lease.take(t):
        return False
    controller.lease = lease
    controller.leadership = Leadership(lease, t, lease_seconds())
    log.warning("controller failover: this launcher (node %d) leads term %d at %s:%d", node_rank, term, host,
                controller.port)
    return True


class Standby(threading.Thread):
    """A launcher without the controller watches the leader's lease and, when it runs out,
    tries to take the next term: a TCPStore for the process-group rebuilds (the first
    one lived in node 0's agent) and a successor controller that takes over the roster;
    on success the launcher's hooks use it in process instead of the link. Started by
    the constructor; :meth:`stop` ends it."""

    def __init__(self, state: Survivors, lease, config, world_size: int, node_rank: int):
        super().__init__(name="mindspeed-ha-standby", daemon=True)
        from mindspeed_ha.control.lease import Watch, lease_seconds

        self.state, self.lease, self.config = state, lease, config
        self.world_size, self.node_rank = world_size, node_rank
        self.watch = Watch(lease, lease_seconds())
        self.store = None
        self._halt = threading.Event()
        self.start()

    def stop(self) -> None:
        self._halt.set()
        self.join()  # a takeover in progress finishes (its term is then this launcher's to end)

    def run(self) -> None:
        from mindspeed_ha.control.lease import lease_seconds

        while not self._halt.wait(lease_seconds() / 8):
            try:
                expired = self.watch.expired()
                if expired is None or self._halt.is_set():
                    continue
                if self._take_over(expired.term + 1):
                    return
            except Exception:  # noqa: BLE001 - log it and keep watching: the next term may be ours
                log.exception("controller failover: watching the lease or taking the next term failed")

    def _take_over(self, term: int) -> bool:
        from mindspeed_ha.control.controller import Controller
        from mindspeed_ha.launch.stores import tcp_store

        local = self.config.controller_addr in ("127.0.0.1", "localhost")
        host = os.environ.get(ha_env.NODE_ADDR) or ("127.0.0.1" if local else socket.gethostname())
        store = tcp_store(host, 0, None, datetime.timedelta(seconds=300), wait_for_workers=False)  # on host only
        controller = Controller(self.config, world_size=self.world_size, bind_addr=host, port=0)
        controller.take_over(self.lease.read_roster())
        controller.rebuild_store = f"{host}:{store.port}"
        controller.start()
        try:
            led = lead(controller, self.lease, term, host, store.port, self.node_rank)
        except BaseException:
            controller.stop()
            raise
        if not led:
            controller.stop()
            return False
        self.store = store  # kept alive with the launcher
        # the main thread may be inside a request on the link: it is closed at the launcher's end
        self.state.controller = controller
        self.state.old_links.append(self.state.link)
        self.state.link = None
        return True
