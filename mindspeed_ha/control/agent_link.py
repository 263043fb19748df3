"""The launcher of a node without the controller, talking to the controller.

With ``--enable-worker-reboot`` every node's agent restarts its own dead workers
(:class:`mindspeed_ha.agent.WorkerRebootAgent`). On the node that hosts the controller the
agent's hooks call it in process; on every other node they go through an
:class:`AgentLink`: one ZeroMQ DEALER socket to the controller's port, authenticated and
encrypted like a processor's (:mod:`auth`, CURVE with the job's auth key),
messages of :mod:`wire` (msgpack, versioned, size-limited, HMAC-tagged). The link is used
from the agent's monitor thread only (the launcher's main thread), request by request:

* :meth:`AgentLink.hello`: before the node's workers start. The controller answers the
  incarnation each rank starts as: 0 on the job's first start; n >= 1 for a rank whose
  process is gone and is awaited to rejoin (a replacement launcher after a lost node: its
  workers rejoin the survivors instead of starting a new job).
* :meth:`AgentLink.restart_refused`: a worker died; may the agent restart it?
* :meth:`AgentLink.report_rank_restart` / :meth:`report_restart_abandoned` /
  :meth:`report_rank_exit`: what the agent did (no answer).
* :meth:`AgentLink.end_requests`: the END_WORKER the controller sent unasked (a worker
  of this node is hung: the agent SIGKILLs it and restarts it, ARF), read every monitor turn.
* hot switch: :meth:`AgentLink.switch_view` (the last SWITCH_VIEW the controller sent
  unasked: per rank of this node, start / keep / commit a new process), read every monitor
  turn; :meth:`AgentLink.report_switch` and :meth:`AgentLink.report_spare` (AGENT_REPORT,
  no answer): what became of the new processes, and this node's parked warm spare.

A controller that does not answer within ``timeout_s`` refuses the restart (the job is
then in the hands of the processors' own controller-loss handling).
"""

from __future__ import annotations

from mindspeed_ha.errors import AgentLinkError  # noqa: F401  (one error tree)
import itertools
import logging
import os
import secrets
import socket
import time
from typing import Dict, List, Optional, Set, Tuple

import zmq

from mindspeed_ha.config import ENV_AUTH_KEY, ConfigError, HAConfig
from mindspeed_ha.control import auth, wire

log = logging.getLogger(__name__)

#: seconds between two AGENT_HELLO while the controller says a rank is still alive / is silent
HELLO_RETRY_S = 0.5


class AgentLink:
    """Requests of one node's launcher to the job's controller (see the module doc).

    Args:
        config: the job's HA settings (controller address and port, auth key, message limit).
        node_rank: this launcher's ``--node-rank``.
        timeout_s: how long one request waits for its answer, seconds.

    Raises:
        ConfigError: no auth key, or ZeroMQ without CURVE.
    """

    def __init__(self, config: HAConfig, node_rank: int, timeout_s: float = 10.0, lease=None):
        self.config = config
        self.node_rank = int(node_rank)
        self.timeout_s = float(timeout_s)
        self.lease = lease  # LeaseDir: the controller is the leader of its highest term
        self.endpoint = (config.controller_addr, config.controller_port)
        self.term = -1
        self.codec = wire.Codec(config.auth_key, wire.new_sender("agent", self.node_rank), config.max_message_bytes)
        keys = auth.derive_keys(config.auth_key)
        self._ids = itertools.count(1)
        self._ends: List[wire.EndWorker] = []  # END_WORKER received, not yet taken
        self._view: Optional[wire.SwitchView] = None  # the last SWITCH_VIEW received
        self._started: Set[Tuple[str, int]] = set()  # (switch request id, rank): new process started
        self.ranks: List[int] = []  # this node's global ranks (AGENT_HELLO)
        self._ctx = zmq.Context()
        try:
            self._sock = self._ctx.socket(zmq.DEALER)
            wire.configure_socket(self._sock, config.max_message_bytes)
            auth.configure_client(self._sock, keys)
            self._sock.setsockopt(zmq.ROUTING_ID, f"a{self.node_rank}-{secrets.token_hex(4)}".encode())
            self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
            self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            self._follow()
            self._sock.connect(wire.endpoint(*self.endpoint))
        except BaseException:
            self._ctx.destroy(linger=0)
            raise

    def _follow(self) -> None:
        """Point the link at the leader of the highest term (controller failover)."""
        cur = self.lease.current() if self.lease is not None else None
        if cur is None or cur.term <= self.term:
            return
        if self.term >= 0 or self._sock.get(zmq.LAST_ENDPOINT):
            try:
                self._sock.disconnect(wire.endpoint(*self.endpoint))
            except zmq.ZMQError:
                pass
            self._sock.connect(wire.endpoint(cur.host, cur.port))
        self.endpoint, self.term = (cur.host, cur.port), cur.term

    def close(self) -> None:
        """Close the socket and its context (idempotent)."""
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # ------------------------------------------------------------------ requests
    def hello(self, ranks: List[int], deadline_s: float) -> Dict[int, int]:
        """The incarnation each of global ``ranks`` starts as (see the module doc).

        Asks again every ``HELLO_RETRY_S`` while the controller is silent (not started
        yet) or says a rank is still alive (its death not detected yet), for at most
        ``deadline_s`` seconds.

        Raises:
            AgentLinkError: refused (the reason names the rank), or no answer in time.
        """
        end = time.monotonic() + deadline_s
        why = f"no answer from the controller at {self.endpoint[0]}:{self.endpoint[1]}"
        while time.monotonic() < end:
            self._follow()
            qid = next(self._ids)
            self._send(wire.AgentHello(self.node_rank, list(ranks), os.getpid(), socket.gethostname(), qid))
            ans = self._answer(wire.AgentWelcome, qid, min(HELLO_RETRY_S * 4, max(0.0, end - time.monotonic())))
            if ans is None:
                continue
            if ans.accepted:
                self.ranks = list(ranks)
                return dict(zip(ranks, ans.incarnations))
            why = ans.detail
            if not ans.wait:
                raise AgentLinkError(f"the controller refused node {self.node_rank}'s workers: {why}")
            time.sleep(HELLO_RETRY_S)  # the controller has not seen that rank die yet
        raise AgentLinkError(f"node {self.node_rank}: {why} within {deadline_s} s (--ha-connect-timeout)")

    def restart_refused(self, rank: int, exitcode: int) -> Optional[str]:
        """None if the controller lets the agent restart ``rank``, else why not."""
        self._follow()
        qid = next(self._ids)
        self._send(wire.RestartQuery(int(rank), int(exitcode), qid))
        ans = self._answer(wire.RestartAnswer, qid, self.timeout_s)
        if ans is None:
            return f"no answer from the controller within {self.timeout_s} s"
        return ans.refused or None

    def report_rank_restart(self, rank: int, incarnation: int, pid: int, exitcode: int) -> None:
        self._send(wire.AgentReport(int(rank), "restarted", int(exitcode), int(incarnation), int(pid)))

    def report_restart_abandoned(self, rank: int, why: str) -> None:
        self._send(wire.AgentReport(int(rank), "abandoned", detail=str(why)[:512]))

    def report_rank_exit(self, rank: int, exitcode: int) -> None:
        self._send(wire.AgentReport(int(rank), "exit", int(exitcode)))

    def end_requests(self) -> List[wire.EndWorker]:
        """The END_WORKER the controller sent since the last call (without waiting)."""
        self._answer(wire.EndWorker, -1, 0.0)
        out, self._ends = self._ends, []
        return out

    def switch_view(self) -> Dict[int, str]:
        """Hot switch: global rank of this node -> ``start`` | ``keep`` | ``commit``, as the
        last SWITCH_VIEW says (without waiting; a ``start`` already reported started for the
        same switch is a ``keep``: a view sent before the controller read that report)."""
        self._answer(wire.EndWorker, -1, 0.0)
        view = self._view
        if view is None:
            return {}
        return {int(r): ("keep" if w == "start" and (view.request_id, int(r)) in self._started else str(w))
                for r, w in zip(view.ranks, view.wanted)}

    def report_switch(self, what: str, rank: int, value) -> None:
        """Hot switch: the new process of ``rank`` ``started`` (value: pid), is ``gone``
        (value: why) or ``switched`` (value: pid), as AGENT_REPORT ``switch_started`` /
        ``switch_gone`` / ``switched``."""
        if what == "started" and self._view is not None:
            self._started.add((self._view.request_id, int(rank)))
        pid = int(value) if what in ("started", "switched") else 0
        detail = str(value)[:512] if what == "gone" else ""
        self._send(wire.AgentReport(int(rank), "switched" if what == "switched" else f"switch_{what}", pid=pid,
                                    detail=detail))

    def report_spare(self, pid: Optional[int]) -> None:
        """This node's parked warm spare is now ``pid`` (None: none), as AGENT_REPORT ``spare``
        (for the controller's switch refusals and ``status``); nothing before AGENT_HELLO."""
        if self.ranks:
            self._send(wire.AgentReport(int(self.ranks[0]), "spare", pid=int(pid or 0),
                                        detail=socket.gethostname()[:512]))

    # ------------------------------------------------------------------ transport
    def _send(self, body) -> None:
        self._follow()
        try:
            self._sock.send(self.codec.encode(body), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("agent link: %s not sent (the controller is not reachable)", type(body).__name__)

    def _answer(self, cls: type, qid: int, timeout_s: float):
        """The first ``cls`` answer with ``query_id`` ``qid`` within ``timeout_s`` (END_WORKER
        kept for :meth:`end_requests`, the last SWITCH_VIEW for :meth:`switch_view`, others
        dropped); ``timeout_s`` 0: what has arrived."""
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            if not self._sock.poll(max(0, int(left * 1000) + 1) if left > 0 else 0, zmq.POLLIN):
                return None
            msg = self.codec.try_decode(self._sock.recv(copy=False).buffer, peer="controller",
                                        now=time.monotonic())
            if msg is not None and isinstance(msg.body, wire.EndWorker):
                self._ends.append(msg.body)
            elif msg is not None and isinstance(msg.body, wire.SwitchView):
                self._view = msg.body
            elif msg is not None and isinstance(msg.body, cls) and msg.body.query_id == qid:
                return msg.body


def node_link(config: HAConfig, node_rank: int, lease=None) -> AgentLink:
    """An :class:`AgentLink` for ``node_rank`` (following the leader of ``lease``, a
    LeaseDir, when given); ConfigError names what is missing."""
    if not config.auth_key:
        raise ConfigError("--enable-worker-reboot on a node without the controller needs the job's auth key: set "
                          f"{ENV_AUTH_KEY} (the same hex key on every node)")
    return AgentLink(config, node_rank, timeout_s=min(10.0, config.connect_timeout_s), lease=lease)
