"""Control-plane wire format: versioned, typed, size-limited, authenticated. Never pickle.

Transport is ZeroMQ (pyzmq): the controller binds a ROUTER socket, every processor
connects a DEALER socket (ZeroMQ frames messages, reconnects with backoff and
queues while disconnected). Connections are authenticated and encrypted with CURVE
(:mod:`auth`): a peer without the job's key never gets a frame to the application.
One ZeroMQ frame carries one message::

    frame = tag (32 bytes, HMAC-SHA256(auth_key, envelope)) + envelope
    envelope = msgpack({"v": SCHEMA_VERSION, "type": str, "seq": int, "sender": str, "body": map})

``body`` holds the fields of the message type's dataclass (below). The receiver
rejects, with a logged reason and a counter and without raising into its thread,
any frame that is oversize, has a bad tag, an unknown version or type, a body that
does not match the dataclass, or a ``seq`` not greater than the last one accepted
from the same ``sender``. Senders are named ``<role>-<rank>-<random token>``, so a
restarted process is a new sender and old frames of a previous incarnation cannot
be replayed against the same receiver. (A fresh receiver cannot tell an old frame
of a sender it has never seen; the per-job key bounds that to the same job, and CURVE
encryption keeps frames from being captured.) The receiver remembers the last ``seq``
of at most ``MAX_SENDERS`` senders, the least recently heard forgotten first.

Rejections are logged at a bounded rate (:class:`~mindspeed_ha.control.admission.RejectLog`),
never one line per frame. Sockets get ``zmq.MAXMSGSIZE`` so oversize frames are
dropped by ZeroMQ itself (the connection is closed before the frame is read).
"""

from __future__ import annotations

from mindspeed_ha.errors import WireError  # noqa: F401  (one error tree)
import collections
import dataclasses
import enum
import hashlib
import hmac
import itertools
import logging
import secrets
import threading
import time
import typing
from typing import Any, Dict, List, Optional, Type

import msgpack

from mindspeed_ha.control.admission import RejectLog
from mindspeed_ha.control.state import Layout

log = logging.getLogger(__name__)

#: 2: REGISTER says whether the rank verifies its state; INTEGRITY answers VERIFY
#: 3: graceful stop: STOP_REQUEST (a rank got SIGTERM/SIGINT), DRAIN / DRAINING (finish the
#:    current iteration, pause at an agreed one), STOPPED.pause_at
#: 5: REGISTER.incarnation / .rejoins (worker reboot)
#: 6: the launchers' agents on other nodes: AGENT_HELLO / AGENT_WELCOME, RESTART_QUERY /
#:    RESTART_ANSWER, AGENT_REPORT; array fields are checked element by element
#: 7: GOODBYE_ACK: a rank closes its connection only once its GOODBYE was handled
#: 8: the operator (``mindspeed-ha status|pause|resume|stop``): OPERATOR_REQUEST / OPERATOR_REPLY;
#:    graceful pause: DRAIN.hold, RELEASE (lift the pause limit)
#: 9: END_WORKER: the controller asks another node's agent to end a hung worker (ARF)
#: 10: HEALTH: a rank's sub-health samples (--ha-subhealth)
#: 11: pause tasks (``mindspeed-ha check | relink``): PAUSE_TASK / PAUSE_TASK_RESULT, OPERATOR_REQUEST.params
#: 12: the hot switch (``mindspeed-ha switch --ranks``): OPERATOR_REQUEST.params ranks, REGISTER.switching
#: 13: NODE_BEAT: a node relay's merged heartbeats of its ranks (``control/relay.py``); ``bytes`` fields
#: 14: NODE_ANSWERS: a node relay's merged routine answers of its ranks (STOPPED, ACTION_RESULT ok, FAULT aborted)
SCHEMA_VERSION = 14
TAG_BYTES = 32
DEFAULT_MAX_BYTES = 1 << 20
#: what CURVE adds to a frame on the wire (MESSAGE command, nonce, MAC: 33 bytes), rounded up
TRANSPORT_OVERHEAD = 256
#: senders whose last ``seq`` a Codec remembers
MAX_SENDERS = 4096


class MsgType(str, enum.Enum):
    REGISTER = "register"
    REGISTERED = "registered"
    HEARTBEAT = "heartbeat"
    STATUS = "status"
    FAULT = "fault"
    STOP = "stop"
    STOPPED = "stopped"
    ACTION = "action"
    ACTION_RESULT = "action_result"
    INTEGRITY = "integrity"
    GOODBYE = "goodbye"
    GOODBYE_ACK = "goodbye_ack"
    STOP_REQUEST = "stop_request"
    DRAIN = "drain"
    DRAINING = "draining"
    AGENT_HELLO = "agent_hello"
    AGENT_WELCOME = "agent_welcome"
    RESTART_QUERY = "restart_query"
    RESTART_ANSWER = "restart_answer"
    AGENT_REPORT = "agent_report"
    END_WORKER = "end_worker"
    OPERATOR_REQUEST = "operator_request"
    OPERATOR_REPLY = "operator_reply"
    RELEASE = "release"
    HEALTH = "health"
    PAUSE_TASK = "pause_task"
    PAUSE_TASK_RESULT = "pause_task_result"
    SWITCH_VIEW = "switch_view"
    NODE_BEAT = "node_beat"
    NODE_ANSWERS = "node_answers"


# --------------------------------------------------------------------------- bodies
@dataclasses.dataclass(frozen=True)
class Register:
    """processor -> controller, first message of a rank (re-sent until REGISTERED)."""

    rank: int
    world_size: int
    pid: int
    host: str
    layout: Layout
    save_dir: Optional[str]
    run_id: str
    status: str = "unknown"
    iteration: int = -1
    verifies: bool = False
    incarnation: int = 0  # the launcher's restarts of this rank's process (ARF), 0 for the first
    rejoins: bool = False  # a restarted process of this rank can rejoin the running job (ARF)
    switching: bool = False  # a hot switch's new process for this rank (schema 10): not the rank yet


@dataclasses.dataclass(frozen=True)
class Registered:
    """controller -> processor: registration accepted (or refused with ``detail``)."""

    rank: int
    accepted: bool
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """processor -> controller every ``heartbeat_interval_s``."""

    rank: int
    iteration: int
    status: str


@dataclasses.dataclass(frozen=True)
class Status:
    """processor -> controller at optimizer begin/end update (``status`` is OptimizerStatus).

    ``step``: the train_step the training thread has entered (-1: none yet, or not known).
    """

    rank: int
    status: str
    iteration: int
    step: int = -1


@dataclasses.dataclass(frozen=True)
class Fault:
    """processor -> controller: the training step raised; ``kind`` is FaultKind.

    ``where``: what raised: ``train_step`` (in-place recovery can re-run it) or a fault
    guard outside it (``train``, ``save``, ``final_save``, ``eval``).
    """

    rank: int
    iteration: int
    kind: str
    message: str
    status: str
    where: str = "train_step"


@dataclasses.dataclass(frozen=True)
class Stop:
    """controller -> processor: freeze (no new optimizer update) and report status.

    ``recover``: an in-place recovery starts: also abort every collective this rank is
    blocked in or starts (see :mod:`mindspeed_ha.recovery.comm`), so that its training
    thread leaves the step and waits for the recovery plan (RETRY).
    ``freeze`` False (an in-place recovery's first round): report the status (STOPPED, then
    each change at once) without blocking the next update: a rank that computed its
    gradients finishes its update, so every rank can end at the same iteration.
    """

    reason: str
    recover: bool = False
    freeze: bool = True


@dataclasses.dataclass(frozen=True)
class Stopped:
    """processor -> controller: frozen; ``status``/``iteration`` are authoritative.

    ``pause_at``: -1 answers a STOP (frozen against starting an update); k >= 0 says the
    rank's training thread is paused after iteration k at the limit a DRAIN set (the
    controller counts it only when k is the drain target it released).
    """

    rank: int
    status: str
    iteration: int
    pause_at: int = -1
    step: int = -1


@dataclasses.dataclass(frozen=True)
class StopRequest:
    """processor -> controller: this rank got a termination signal (e.g. SIGTERM from a
    scheduler); asks for a graceful stop of the whole job."""

    rank: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Drain:
    """controller -> processor: graceful stop.

    ``until`` -1 (first round): pause at the end of the iteration now in progress and
    answer DRAINING with it. ``until`` k: pause at the end of iteration k (every rank gets
    the same k, the highest any rank announced), then answer STOPPED(pause_at=k).
    ``hold``: a graceful pause (the operator's ``pause``): the rank waits at the limit
    without the freeze deadline while its controller is there, until RELEASE.
    """

    reason: str
    until: int = -1
    hold: bool = False


@dataclasses.dataclass(frozen=True)
class Release:
    """controller -> processor: the graceful pause ends; lift the pause limit, go on training."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Draining:
    """processor -> controller: answer to DRAIN(-1): the iteration after which this rank
    will pause (-1: it has not started its first iteration yet)."""

    rank: int
    pause_at: int


@dataclasses.dataclass(frozen=True)
class Action:
    """controller -> processor: run ``kind`` (policy.ActionKind value) with ``params``."""

    action_id: int
    kind: str
    params: Dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ActionResult:
    """processor -> controller: outcome of one ACTION."""

    action_id: int
    rank: int
    ok: bool
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Integrity:
    """processor -> controller, before the ACTION_RESULT of VERIFY: the integrity of the
    rank's frozen state at ``iteration`` (fields of :class:`~.integrity.IntegrityReport`)."""

    rank: int
    iteration: int
    shard_ok: bool
    shard_digest: str
    model_ok: bool
    model_digest: str
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Goodbye:
    """processor -> controller: the rank is exiting with ``exit_code`` (answered by GOODBYE_ACK)."""

    rank: int
    exit_code: int


@dataclasses.dataclass(frozen=True)
class GoodbyeAck:
    """controller -> processor: the GOODBYE of ``rank`` was handled; its connection may close
    (its close is then no longer evidence of a death)."""

    rank: int


@dataclasses.dataclass(frozen=True)
class Health:
    """processor -> controller (``--ha-subhealth``): what the rank's sampler saw since its last
    HEALTH. ``iteration``: the last completed one; ``busy``: the fraction of ``samples`` in
    which the training thread was not waiting inside a ``torch.distributed`` call (-1: not
    sampled); ``counters``: device counter name -> value (see ``subhealth_sampler``)."""

    rank: int
    iteration: int
    busy: float = -1.0
    samples: int = 0
    counters: Dict[str, float] = dataclasses.field(default_factory=dict)


# ------------------------------------------------ the launchers' agents (--enable-worker-reboot)
@dataclasses.dataclass(frozen=True)
class AgentHello:
    """agent -> controller: the launcher of ``node_rank`` (a node without the controller)
    is about to start the workers of global ``ranks``. Re-sent until AGENT_WELCOME
    answers the same ``query_id``."""

    node_rank: int
    ranks: List[int]
    pid: int
    host: str
    query_id: int


@dataclasses.dataclass(frozen=True)
class AgentWelcome:
    """controller -> agent: answer to AGENT_HELLO.

    ``incarnations[i]`` is the incarnation the worker of ``ranks[i]`` starts as: 0 on the
    job's first start, n >= 1 when that rank's earlier process is gone and the new one
    rejoins the running job (a replacement launcher after a lost node). ``accepted``
    False: do not start (``detail`` says why); ``wait`` True with it: a rank is still
    alive for the controller (its death is not detected yet): ask again.
    """

    query_id: int
    accepted: bool
    incarnations: List[int]
    detail: str = ""
    wait: bool = False


@dataclasses.dataclass(frozen=True)
class RestartQuery:
    """agent -> controller: worker ``rank`` exited with ``exit_code``; may it be restarted?"""

    rank: int
    exit_code: int
    query_id: int


@dataclasses.dataclass(frozen=True)
class RestartAnswer:
    """controller -> agent: ``refused`` empty: restart ``rank``; else why not."""

    rank: int
    query_id: int
    refused: str = ""


@dataclasses.dataclass(frozen=True)
class AgentReport:
    """agent -> controller: ``event`` ``exit`` (worker ``rank`` exited with ``exit_code``, not
    restarted by the agent's own monitor), ``restarted`` (runs again as ``pid``, its
    ``incarnation``-th process) or ``abandoned`` (will not be restarted: ``detail``)."""

    rank: int
    event: str
    exit_code: int = 0
    incarnation: int = 0
    pid: int = 0
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class EndWorker:
    """controller -> agent: the worker of ``rank`` running as ``pid`` is hung (no heartbeat
    for longer than ``--ha-heartbeat-timeout``: ``detail``); SIGKILL it if that pid is still
    the agent's worker of the rank, then treat its death as any other (restart it, ARF)."""

    rank: int
    pid: int
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class SwitchView:
    """controller -> another node's agent (hot switch, added within schema 12: only a
    switch of that node's ranks sends it): per global rank of that node, what its agent
    does, ``wanted[i]`` for ``ranks[i]``: ``start`` (start the rank's next incarnation beside
    it), ``keep`` (keep it), ``commit`` (it takes the old process's place once that one
    exited 0); a rank not listed: end its new process, if any. ``request_id``: the switch's
    (a ``start`` the agent already reported started for that request is a ``keep``). Sent
    on every change and again every second while not empty. The agent answers with
    AGENT_REPORT events ``switch_started`` (``pid``), ``switch_gone`` (``detail``),
    ``switched`` (``pid``) and ``spare`` (its parked warm spare's ``pid``, 0: none;
    ``detail``: its host)."""

    request_id: str
    ranks: List[int]
    wanted: List[str]


#: the most local connections one NODE_BEAT names (a relay with more sends several)
MAX_BEAT_SUBS = 4096


@dataclasses.dataclass(frozen=True)
class NodeBeat:
    """node relay -> controller, every heartbeat interval (schema 13, ``control/relay.py``):
    the ranks behind the relay that were heard since its previous NODE_BEAT, in place of
    each one's HEARTBEAT frame. ``subs``: their identities on the relay's local socket (the
    controller knows ``(relay, sub)`` as the rank's connection, :class:`server.Ident`); a
    connection that closed, or sent no valid HEARTBEAT since the previous beat, is not
    named. At most :data:`MAX_BEAT_SUBS` entries of at most 255 bytes each."""

    node_rank: int
    subs: List[bytes]

    def __post_init__(self) -> None:
        if len(self.subs) > MAX_BEAT_SUBS or any(len(s) > 255 for s in self.subs):
            raise WireError("bad_body", f"node_beat.subs: more than {MAX_BEAT_SUBS} entries or one over 255 bytes")


#: what a relay may merge into NODE_ANSWERS (schema 14): message type -> the body fields that
#: must have these values (a round's routine answers; an error, a FAULT of any other kind, a
#: failed ACTION_RESULT is never merged)
MERGEABLE: Dict[str, Dict[str, Any]] = {"stopped": {}, "action_result": {"ok": True}, "fault": {"kind": "aborted"}}


@dataclasses.dataclass(frozen=True)
class NodeAnswers:
    """node relay -> controller (schema 14, ``control/relay.py``): the same answer of several
    of the relay's ranks, each verified by the relay with the job's key (HMAC, schema, body,
    the rank's ``seq``), in place of their frames. ``answer``: the message type (a key of
    :data:`MERGEABLE`, its required values in ``body``); ``body``: that type's fields but
    ``rank``, the same for every rank named; ``subs[i]`` is the local connection of
    ``ranks[i]`` (the controller handles each as that rank's own frame from ``(relay, sub)``).
    Carried in the relay's message among its ranks' frames, after every earlier frame of
    each rank it names and before any later one. At most :data:`MAX_BEAT_SUBS` entries, subs
    of at most 255 bytes.

    Raises:
        WireError("bad_body"): any of that not so.
    """

    node_rank: int
    answer: str
    body: Dict[str, Any]
    subs: List[bytes]
    ranks: List[int]

    def __post_init__(self) -> None:
        need = MERGEABLE.get(self.answer)
        if need is None or "rank" in self.body or any(self.body.get(k) != v or type(self.body.get(k)) is not type(v)
                                                       for k, v in need.items()):
            raise WireError("bad_body", f"node_answers: {self.answer!r} with {sorted(map(str, self.body))} is not "
                            "a mergeable answer")
        if len(self.subs) != len(self.ranks) or len(self.subs) > MAX_BEAT_SUBS or any(len(s) > 255 for s in self.subs):
            raise WireError("bad_body", f"node_answers.subs / ranks: not of the same length, more than {MAX_BEAT_SUBS} "
                            "entries or a sub over 255 bytes")
        cls = BODY_TYPES[MsgType(self.answer)]  # the common part checked once against the type's fields
        first = _from_plain(cls, {**self.body, "rank": self.ranks[0] if self.ranks else 0}, f"node_answers.{self.answer}")
        object.__setattr__(self, "_first", first)  # (not a field: not sent, not compared)

    @property
    def common(self) -> Any:
        """The common body as checked at construction (that type's dataclass, ``rank`` the
        first one's): what every named rank answered but its rank."""
        return self._first  # type: ignore[attr-defined]

    def bodies(self) -> List[Any]:
        """Each named rank's body (``ranks[i]``'s at ``i``), as checked at construction."""
        first = self._first  # type: ignore[attr-defined]
        if not self.ranks:
            return []
        cls = type(first)
        kwargs = {name: getattr(first, name) for name in _fields(cls)[0] if name != "rank"}  # checked: built as is
        return [first] + [cls(rank=r, **kwargs) for r in self.ranks[1:]]


def merged_part(msg_type: "MsgType", body: Any) -> Optional[Dict[str, Any]]:
    """The fields but ``rank`` of ``body`` (a message of ``msg_type``) if NODE_ANSWERS may carry
    it (:data:`MERGEABLE`), else None."""
    need = MERGEABLE.get(msg_type.value)
    if need is None or any(getattr(body, k) != v for k, v in need.items()):
        return None
    plain = _to_plain(body)
    plain.pop("rank")
    return plain


# ------------------------------------------------ the operator (mindspeed-ha status | pause | resume | stop)
#: the verbs an operator may send
OPERATOR_VERBS = ("status", "pause", "resume", "stop", "check", "relink", "switch")


@dataclasses.dataclass(frozen=True)
class OperatorRequest:
    """operator -> controller: run ``verb`` (one of :data:`OPERATOR_VERBS`).

    ``request_id``: chosen by the operator (1..64 characters); the controller answers a
    repeated id with the first request's reply and does not act twice. ``max_s``: with
    ``pause``, resume by itself after this many seconds (0: until ``resume``);
    ``then_stop``: at ``max_s``, stop (checkpoint, exit 75) instead of resuming.
    ``params``: the verb's arguments (``check``: ranks, tests, budget_s, on_fault, stay;
    ``relink``: ranks, addr or iface, back, stay; see :mod:`.pause_tasks`; ``switch``: ranks,
    the global ranks moved to new processes, :mod:`.switch_desk`).
    """

    request_id: str
    verb: str
    max_s: float = 0.0
    then_stop: bool = False
    params: Dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class OperatorReply:
    """controller -> operator: the outcome of ``request_id``. ``code``: 0 done, 1 the action
    failed, 4 refused in the job's current state (``detail`` says why); ``result``: what
    the verb returns (``status``: the job's status; ``pause``: the iteration held at)."""

    request_id: str
    code: int
    detail: str = ""
    result: Dict[str, Any] = dataclasses.field(default_factory=dict)


# ------------------------------------------------ pause tasks (mindspeed-ha check | relink)
@dataclasses.dataclass(frozen=True)
class PauseTask:
    """controller -> processor, only while the job is PAUSED: run ``kind`` (``check`` or
    ``relink``) with ``params`` on the rank's training thread, at its pause point, within
    ``budget_s`` seconds, then answer PAUSE_TASK_RESULT and keep holding (:mod:`.pause_tasks`)."""

    task_id: int
    kind: str
    params: Dict[str, Any]
    budget_s: float


@dataclasses.dataclass(frozen=True)
class PauseTaskResult:
    """processor -> controller: the outcome of ``task_id`` on ``rank``. ``code``: 0 ok, 1 not
    run, 2 fault, 3 timeout (the reference's stress-test codes); ``result``: per-test details."""

    task_id: int
    rank: int
    code: int
    detail: str = ""
    result: Dict[str, Any] = dataclasses.field(default_factory=dict)


AGENT_TYPES = frozenset({"agent_hello", "restart_query", "agent_report"})

BODY_TYPES: Dict[MsgType, Type[Any]] = {
    MsgType.REGISTER: Register,
    MsgType.REGISTERED: Registered,
    MsgType.HEARTBEAT: Heartbeat,
    MsgType.STATUS: Status,
    MsgType.FAULT: Fault,
    MsgType.STOP: Stop,
    MsgType.STOPPED: Stopped,
    MsgType.ACTION: Action,
    MsgType.ACTION_RESULT: ActionResult,
    MsgType.INTEGRITY: Integrity,
    MsgType.GOODBYE: Goodbye,
    MsgType.GOODBYE_ACK: GoodbyeAck,
    MsgType.STOP_REQUEST: StopRequest,
    MsgType.DRAIN: Drain,
    MsgType.DRAINING: Draining,
    MsgType.AGENT_HELLO: AgentHello,
    MsgType.AGENT_WELCOME: AgentWelcome,
    MsgType.RESTART_QUERY: RestartQuery,
    MsgType.RESTART_ANSWER: RestartAnswer,
    MsgType.AGENT_REPORT: AgentReport,
    MsgType.END_WORKER: EndWorker,
    MsgType.OPERATOR_REQUEST: OperatorRequest,
    MsgType.OPERATOR_REPLY: OperatorReply,
    MsgType.RELEASE: Release,
    MsgType.HEALTH: Health,
    MsgType.PAUSE_TASK: PauseTask,
    MsgType.PAUSE_TASK_RESULT: PauseTaskResult,
    MsgType.SWITCH_VIEW: SwitchView,
    MsgType.NODE_BEAT: NodeBeat,
    MsgType.NODE_ANSWERS: NodeAnswers,
}
_TYPE_OF = {cls: t for t, cls in BODY_TYPES.items()}


@dataclasses.dataclass(frozen=True)
class Message:
    """A decoded, verified message."""

    type: MsgType
    seq: int
    sender: str
    body: Any


# --------------------------------------------------------------------------- body (de)serialisation
_HINTS: Dict[type, Dict[str, Any]] = {}


def _hints(cls: type) -> Dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


#: dataclass -> its field names (read once per class: :func:`_to_plain` runs for every frame sent)
_NAMES: Dict[type, Any] = {}
_SCALARS = frozenset({int, str, bool, float, bytes, type(None)})


def _to_plain(obj: Any) -> Any:
    cls = type(obj)
    names = _NAMES.get(cls)
    if names is None and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(obj))
    if names is not None:
        out = {}
        for name in names:
            v = getattr(obj, name)
            out[name] = v if type(v) in _SCALARS else _to_plain(v)
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    return obj


def _check(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin is typing.Union:
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check(value, inner[0], where)
    if dataclasses.is_dataclass(hint):
        return _from_plain(hint, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise WireError("bad_body", f"{where}: expected array")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        if item in _SCALARS and item is not float:  # a NODE_BEAT's subs, rank lists: one pass, no call per item
            if all(type(v) is item for v in value):
                return list(value)
        return [_check(v, item, f"{where}[]") for v in value]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise WireError("bad_body", f"{where}: expected map")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise WireError("bad_body", f"{where}: expected bool")
        return value
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise WireError("bad_body", f"{where}: expected int")
        return value
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise WireError("bad_body", f"{where}: expected float")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise WireError("bad_body", f"{where}: expected str")
        return value
    if hint is bytes:
        if not isinstance(value, bytes):
            raise WireError("bad_body", f"{where}: expected bin")
        return value
    return value


#: cls -> (field names, [(name, hint, required, plain type or None)]): read once per class
_FIELDS: Dict[type, Any] = {}
_PLAIN = (bool, int, float, str)


def _fields(cls: type) -> Any:
    spec = _FIELDS.get(cls)
    if spec is None:
        hints = _hints(cls)
        spec = (frozenset(f.name for f in dataclasses.fields(cls)),
                [(f.name, hints[f.name],
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                  hints[f.name] if hints[f.name] in _PLAIN else None) for f in dataclasses.fields(cls)])
        _FIELDS[cls] = spec
    return spec


def _from_plain(cls: type, data: Any, where: str) -> Any:
    """``cls`` from its plain map, every field checked against its type hint (the plain
    types inline: this runs for every frame the controller reads)."""
    if not isinstance(data, dict):
        raise WireError("bad_body", f"{where}: expected map")
    names, fields = _fields(cls)
    if not names.issuperset(data):
        extra = set(data) - names
        raise WireError("bad_body", f"{where}: unexpected fields {sorted(map(str, extra))}")
    kwargs = {}
    for name, hint, required, plain in fields:
        if name not in data:
            if required:
                raise WireError("bad_body", f"{where}: missing field {name}")
            continue
        value = data[name]
        if plain is not None and type(value) is plain:  # bool is not int here: type(), not isinstance
            kwargs[name] = value
        else:
            kwargs[name] = _check(value, hint, f"{where}.{name}")
    return cls(**kwargs)


# --------------------------------------------------------------------------- codec
def new_sender(role: str, rank: Optional[int] = None) -> str:
    """A sender name unique to this process incarnation: ``<role>-<rank>-<token>``."""
    mid = "" if rank is None else f"-{rank}"
    return f"{role}{mid}-{secrets.token_hex(4)}"


class Codec:
    """Encodes outgoing and verifies incoming frames for one endpoint.

    Thread-safe: encode may be called from any thread; decode is normally called by
    the single I/O thread. ``rejected`` counts rejections by reason; ``reject_log``
    logs them at a bounded rate.

    Args:
        key: the job's HMAC key (>= 16 bytes).
        sender: this endpoint's sender name (see :func:`new_sender`).
        max_bytes: the largest frame accepted or produced.
        max_senders: senders whose last ``seq`` is remembered.
    """

    def __init__(self, key: bytes, sender: str, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_senders: int = MAX_SENDERS):
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("auth key must be at least 16 bytes (MINDSPEED_HA_AUTH_KEY)")
        self._key = key
        self._mac = hmac.new(key, digestmod=hashlib.sha256)  # never updated: copied per frame (_tag)
        self.sender = sender
        self.max_bytes = int(max_bytes)
        self.max_senders = int(max_senders)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._last_seq: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self.rejected: collections.Counter = collections.Counter()
        self.reject_log = RejectLog(log, "control frame")
        self.accepted = 0

    def _tag(self, envelope: bytes) -> bytes:
        mac = self._mac.copy()  # the key's HMAC state made once (hmac.new redoes it per frame)
        mac.update(envelope)
        return mac.digest()

    def encode(self, body: Any) -> bytes:
        """Serialise ``body`` (one of the body dataclasses) into a frame.

        Raises:
            WireError("oversize"): the frame would exceed ``max_bytes``.
        """
        mtype = _TYPE_OF[type(body)]
        with self._lock:
            seq = next(self._seq)
        envelope = msgpack.packb(
            {"v": SCHEMA_VERSION, "type": mtype.value, "seq": seq, "sender": self.sender, "body": _to_plain(body)},
            use_bin_type=True,
        )
        frame = self._tag(envelope) + envelope
        if len(frame) > self.max_bytes:
            raise WireError("oversize", f"{mtype.value} frame of {len(frame)} bytes > {self.max_bytes}")
        return frame

    def decode(self, frame: bytes) -> Message:
        """Verify and decode a frame. Raises WireError (and counts it) on rejection."""
        try:
            msg = self._decode(frame)
        except WireError as exc:
            self.rejected[exc.reason] += 1
            raise
        self.accepted += 1
        return msg

    def try_decode(self, frame: bytes, peer: str = "?", now: Optional[float] = None) -> Optional[Message]:
        """Like :meth:`decode` but returns None on rejection (for I/O threads).

        The rejection goes to ``reject_log`` (at ``now``, default ``time.monotonic()``),
        which logs at a bounded rate whatever the rate of rejections.
        """
        try:
            return self.decode(frame)
        except WireError as exc:
            self.reject_log.note(peer, exc.reason, time.monotonic() if now is None else now, str(exc))
            return None

    def _decode(self, frame: bytes) -> Message:
        frame = bytes(frame)
        if len(frame) > self.max_bytes:
            raise WireError("oversize", f"{len(frame)} bytes > {self.max_bytes}")
        if len(frame) <= TAG_BYTES:
            raise WireError("short", f"{len(frame)} bytes")
        tag, envelope = frame[:TAG_BYTES], frame[TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(envelope)):
            raise WireError("bad_mac")
        try:
            env = msgpack.unpackb(envelope, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several types on malformed input
            raise WireError("malformed", type(exc).__name__) from None
        if not isinstance(env, dict):
            raise WireError("malformed", "envelope is not a map")
        if env.get("v") != SCHEMA_VERSION:
            raise WireError("bad_version", f"v={env.get('v')!r}, expected {SCHEMA_VERSION}")
        try:
            mtype = MsgType(env.get("type"))
        except ValueError:
            raise WireError("bad_type", repr(env.get("type"))) from None
        seq, sender = env.get("seq"), env.get("sender")
        if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(sender, str):
            raise WireError("malformed", "seq/sender")
        body = _from_plain(BODY_TYPES[mtype], env.get("body"), mtype.value)
        with self._lock:
            last = self._last_seq.get(sender, 0)
            if seq <= last:
                raise WireError("replay", f"{sender} seq {seq} <= {last}")
            self._last_seq[sender] = seq
            self._last_seq.move_to_end(sender)
            while len(self._last_seq) > self.max_senders:
                self._last_seq.popitem(last=False)
        return Message(mtype, seq, sender, body)


def configure_socket(sock: Any, max_bytes: int) -> None:
    """Common ZeroMQ options: size cap (``max_bytes`` of message plus the CURVE overhead),
    no linger on close, IPv6 allowed."""
    import zmq

    sock.setsockopt(zmq.MAXMSGSIZE, int(max_bytes) + TRANSPORT_OVERHEAD)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)


def close_all(ctx: Any, *socks: Any, linger_ms: int = 0) -> None:
    """Close ``socks`` with ``linger_ms`` (None and closed ones skipped), then terminate ``ctx``.

    Every ZeroMQ socket and context of the control plane is ended through here, in
    success and failure paths alike, so that none is left for the garbage collector
    (a context collected with an open socket blocks, or aborts, the interpreter at exit).
    Call it from the thread that owns the sockets. ``term()`` returns at once when no
    message is pending, after at most ``linger_ms`` otherwise.
    """
    for sock in socks:
        if sock is not None and not sock.closed:
            sock.close(linger=linger_ms)
    if ctx is not None and not ctx.closed:
        ctx.term()


def endpoint(addr: str, port: int) -> str:
    """``tcp://addr:port`` with IPv6 literals bracketed."""
    addr = addr.strip("[]")
    return f"tcp://[{addr}]:{port}" if ":" in addr else f"tcp://{addr}:{port}"


__all__ = [
    "SCHEMA_VERSION", "MsgType", "Message", "Codec", "WireError", "new_sender", "configure_socket", "close_all",
    "endpoint",
    "Register", "Registered", "Heartbeat", "Status", "Fault", "Stop", "Stopped", "Action", "ActionResult",
    "Integrity", "Goodbye", "GoodbyeAck", "StopRequest", "Drain", "Draining", "BODY_TYPES", "Layout",
    "Release", "OperatorRequest", "OperatorReply", "OPERATOR_VERBS", "Health", "PauseTask", "PauseTaskResult",
    "SwitchView", "NodeBeat", "MAX_BEAT_SUBS", "NodeAnswers", "MERGEABLE", "merged_part",
]

