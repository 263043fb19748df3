"""The one error tree of mindspeed-ha, and the fault kinds that label it.

Every error this package raises is an :class:`HAError` (a ``RuntimeError``); errors about
bad input are also ``ValueError`` so that callers that caught the built-in keep working.
``kind`` classifies an error without text matching (:func:`mindspeed_ha.faults.classify`).

::

    HAError (RuntimeError)
    +-- DeviceMemoryError            kind UCE
    +-- CommunicationError           kind NETWORK
    |   +-- recovery.comm.CollectiveAborted
    +-- ProcessFailure               kind PROCESS
    +-- ControlPlaneError            kind NETWORK
    |   +-- ControllerLostError
    |   +-- OperatorError              the operator's CLI got no reply (unreachable, key refused)
    +-- IllegalTransition
    +-- ProcessorExited
    +-- AgentLinkError
    +-- ConfigError (+ ValueError)
    +-- WireError (+ ValueError)
    +-- ArgumentError (+ ValueError)   the built-in trainer's flags
    +-- CheckpointError
    |   +-- IntegrityError, DPZeroError, TorchFileError, TorchDistCheckpointError
    +-- RecoveryError
    |   +-- RejoinError
    |   |   +-- RejoinMismatch
    |   +-- ProgressError, ReloadError, StateMismatch
    +-- InjectedFault                  raised by the fault injector's ``fault=raise``

Imports nothing but the standard library.
"""

from __future__ import annotations

import enum


class FaultKind(str, enum.Enum):
    """What broke. Values are the wire spelling."""

    UCE = "uce"
    """Device memory uncorrectable error (HBM multi-bit ECC); the rank's tensors are suspect."""
    NETWORK = "network"
    """Communication failure (NCCL, HCCL, gloo, TCP store); local state is intact."""
    PROCESS = "process"
    """A peer process died (observed by a collective or reported by the agent)."""
    UNKNOWN = "unknown"
    """Anything else (a bug, a data error): not recoverable by retry."""
    ABORTED = "aborted"
    """This rank's step was interrupted by the controller's recovery (its collective was
    aborted, see :mod:`mindspeed_ha.recovery.comm`): a consequence of another rank's
    fault, its own state is intact."""


class HAError(RuntimeError):
    """Base of every mindspeed-ha error. ``kind`` classifies it without text matching."""

    kind: FaultKind = FaultKind.UNKNOWN


class DeviceMemoryError(HAError):
    """Uncorrectable device memory error (raise ``from`` the framework's error)."""

    kind = FaultKind.UCE


class UnrepairedDamage(DeviceMemoryError):
    """This rank's state still holds the damage of a UCE: the in-place recovery that was to
    repair it failed (raised ``from`` that failure, reported as a UCE so that the next plan,
    e.g. a controller successor's, never takes this rank's state as a source)."""


class CommunicationError(HAError):
    """Collective or point-to-point communication failed."""

    kind = FaultKind.NETWORK


class ProcessFailure(HAError):
    """A peer worker process died."""

    kind = FaultKind.PROCESS


class ControlPlaneError(HAError):
    """The controller/processor link failed (not a training fault)."""

    kind = FaultKind.NETWORK


class OperatorError(ControlPlaneError):
    """An operator request got no reply: ``code`` is the CLI's exit code (5: unreachable,
    6: the controller refused the key; see :mod:`mindspeed_ha.control.operator`)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class ControllerLostError(ControlPlaneError):
    """A frozen processor waited past its deadline without an action."""


class IllegalTransition(HAError):
    """A state machine was asked for a move its transition table forbids."""


class ProcessorExited(HAError):
    """The controller ended this rank (EXIT) and the exit handler returned."""


class AgentLinkError(HAError):
    """The controller refused this launcher's workers, or did not answer in time."""


class ConfigError(HAError, ValueError):
    """An invalid HA setting; the message names the flag/env var and the accepted range."""


class WireError(HAError, ValueError):
    """A frame was rejected; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class ArgumentError(HAError, ValueError):
    """An invalid command-line value; the message names the flag and the accepted range."""


class CheckpointError(HAError):
    """A checkpoint could not be written, validated or committed."""


class IntegrityError(CheckpointError):
    """A part of the state is not what was verified: wrong layout, or its digest changed."""


class DPZeroError(CheckpointError):
    """The shard savers' writes do not form one complete ``distrib_optim.pt``."""


class TorchFileError(CheckpointError):
    """The skeleton is not a zip archive this module understands, or a write plan is inconsistent."""


class TorchDistCheckpointError(CheckpointError):
    """A part could not be written or the parts do not form a complete checkpoint."""


class RecoveryError(HAError):
    """An in-place recovery stage cannot go on (the message says why)."""


class RejoinError(RecoveryError):
    """A rejoin cannot replay this rank's start-up (no record, too big, unsupported, ...)."""


class RejoinMismatch(RejoinError):
    """The new process's start-up diverged from the recorded one (call index, both sides)."""


class ProgressError(RecoveryError):
    """A progress message is malformed, too large, or of another version."""


class ReloadError(RecoveryError):
    """The latest periodic checkpoint cannot be reloaded in place (the message says why)."""


class StateMismatch(RecoveryError):
    """The sender's and the receiver's state tensors differ in number, name, shape or dtype."""


class InjectedFault(HAError):
    """Raised by the fault injector's ``fault=raise`` (kind by its message, like a real error)."""
