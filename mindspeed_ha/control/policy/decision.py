"""What :func:`~mindspeed_ha.control.policy.decide` returns: an action and its typed plan.

A :class:`Decision` carries one frozen plan per action (:class:`StopPlan`,
:class:`DrainPlan`, :class:`ExitPlan`, :class:`VerifyPlan`, the dying checkpoint's
:class:`~mindspeed_ha.control.policy.dying.DumpOrder`, the in-place
:class:`~mindspeed_ha.control.policy.recovery.RecoveryPlan`); ``Decision.params`` is
derived from it: the msgpack-able dict the controller sends (ACTION params) or reads
(STOP / DRAIN), with the same keys and values as the wire has always carried. Pure.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, Mapping, Optional, Protocol, Tuple

from mindspeed_ha.control.state import ClusterState, Phase
from mindspeed_ha.faults import FaultKind


class ActionKind(str, enum.Enum):
    """What a decision does. DUMP, ASSEMBLE, COMMIT, EXIT, VERIFY and RETRY travel as an
    ACTION message of that kind; STOP_ALL as STOP, DRAIN as DRAIN; PAUSE (the operator's
    graceful pause) as DRAIN with ``hold``; RELEASE (the pause ends) as RELEASE; SWITCH (a hot
    switch's plan to the paused ranks, control/switch_desk.py) as an ACTION; NOOP and
    RESUME send nothing (RESUME: every rank recovered in place, the job goes back to RUNNING)."""

    NOOP = "noop"
    STOP_ALL = "stop_all"
    DUMP = "dump"
    ASSEMBLE = "assemble"
    COMMIT = "commit"
    EXIT = "exit"
    VERIFY = "verify"
    DRAIN = "drain"
    RETRY = "retry"
    RESUME = "resume"
    PAUSE = "pause"
    RELEASE = "release"
    SWITCH = "switch"


class ActionPlan(Protocol):
    """A typed plan: its wire form is :meth:`to_params`."""

    def to_params(self) -> Dict[str, Any]:
        """The msgpack-able params (str keys, lists, scalars)."""


@dataclasses.dataclass(frozen=True)
class StopPlan:
    """STOP_ALL: freeze every target (the STOP message).

    Attributes:
        rank: the rank whose fault starts the round (-1: none known).
        kind: that fault's kind.
        at: when the controller got the evidence (its monotonic clock, seconds).
        in_place: round 1 of an in-place recovery or ARF (observe: the ranks keep their
            step, no freeze).
        recover: abort every step (the ranks park in their fault handler).
        graceful: a graceful stop past its drain budget (no fault: ``rank``, ``kind`` and
            ``at`` are not sent).
    """

    rank: int = -1
    kind: FaultKind = FaultKind.UNKNOWN
    at: float = 0.0
    in_place: bool = False
    recover: bool = False
    graceful: bool = False

    def to_params(self) -> Dict[str, Any]:
        if self.graceful:
            return {"graceful": True}
        params: Dict[str, Any] = {"rank": self.rank, "kind": FaultKind(self.kind).value, "at": self.at}
        if self.in_place:
            params["in_place"] = True
        if self.recover:
            params["recover"] = True
        return params


@dataclasses.dataclass(frozen=True)
class DrainPlan:
    """DRAIN: graceful stop; ``until`` is the iteration every rank pauses after (-1: round 1,
    every rank says where it will pause)."""

    until: int
    hold: bool = False  # the operator's graceful pause (PAUSE): held until RELEASE, nothing saved

    def to_params(self) -> Dict[str, Any]:
        return {"until": self.until, "hold": True} if self.hold else {"until": self.until}


@dataclasses.dataclass(frozen=True)
class ExitPlan:
    """EXIT: every target ends its process with ``code`` (see ``mindspeed_ha.faults``)."""

    code: int
    reason: str

    def to_params(self) -> Dict[str, Any]:
        return {"code": self.code, "reason": self.reason}


@dataclasses.dataclass(frozen=True)
class VerifyPlan:
    """VERIFY: every target reports the integrity of its frozen state. ``unavailable``:
    (rank, why) of the ranks the stop round already excluded, rank order."""

    unavailable: Tuple[Tuple[int, str], ...] = ()

    def to_params(self) -> Dict[str, Any]:
        return {"unavailable": [[r, why] for r, why in self.unavailable]}


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the controller must do now.

    Attributes:
        action: the action kind (NOOP: nothing to send).
        reason: one human-readable sentence (logged, recorded in events).
        plan: the typed plan of the action (None for NOOP).
        targets: ranks the STOP / DRAIN / ACTION message goes to.
        next_phase: the job phase after applying, or None to stay.
    """

    action: ActionKind
    reason: str
    plan: Optional[ActionPlan] = None
    targets: Tuple[int, ...] = ()
    next_phase: Optional[Phase] = None

    @property
    def params(self) -> Dict[str, Any]:
        """The plan's wire form (a fresh dict; empty without a plan)."""
        return self.plan.to_params() if self.plan is not None else {}


def noop(reason: str, next_phase: Optional[Phase] = None) -> Decision:
    """Nothing to send (``next_phase``: move the job without a message)."""
    return Decision(ActionKind.NOOP, reason, next_phase=next_phase)


def live_targets(state: ClusterState, gone: Mapping[int, str]) -> Tuple[int, ...]:
    """Every live rank that has not gone (dead, goodbye, silent)."""
    alive = state.alive_ranks()
    return tuple(r for r in alive if r not in gone) if gone else tuple(alive)  # none gone: no second pass


def exit_all(state: ClusterState, code: int, reason: str) -> Decision:
    """EXIT(code) to every live rank that has not said goodbye; the job goes to EXITING."""
    targets = tuple(r for r in state.alive_ranks() if state.ranks[r].exit_code is None)
    return Decision(ActionKind.EXIT, reason, ExitPlan(code, reason), targets, Phase.EXITING)


__all__ = ["ActionKind", "ActionPlan", "Decision", "DrainPlan", "ExitPlan", "StopPlan", "VerifyPlan",
           "exit_all", "live_targets", "noop"]
