"""The registry of checkpoint formats, keyed by Megatron's ``--ckpt-format``.

One key decides the format of a dying checkpoint: ``args.ckpt_format``
(:func:`checkpoint_format`), looked up once with :func:`get_format`; every step (the
start-up check, dump, assemble, merge, validate, commit) asks the format object
(:class:`~mindspeed_ha.checkpoint.formats.base.CheckpointFormat`). A new format is one
module with a ``CheckpointFormat`` subclass and one :func:`register_format` call (the
model: megatron-core ``dist_checkpointing/strategies/base.py``,
``register_default_strategy`` / ``get_default_strategy``).

Built in: ``torch`` (:mod:`.torch`) and ``torch_dist`` (:mod:`.torch_dist`); Megatron-LM
core_v0.12.1 also has ``torch_dcp``, which the dying checkpoint does not write.
Imports no torch (the launcher checks the flags before any worker starts).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from mindspeed_ha.checkpoint.formats.base import CheckpointFormat, SaverRole
from mindspeed_ha.checkpoint.formats.torch import TorchFormat
from mindspeed_ha.checkpoint.formats.torch_dist import TorchDistFormat
from mindspeed_ha.errors import CheckpointError, ConfigError

_FORMATS: Dict[str, CheckpointFormat] = {}

#: ``--ckpt-format`` when the framework has no such flag (the built-in trainer)
DEFAULT_FORMAT = "torch"


def register_format(name: str, fmt: CheckpointFormat) -> None:
    """Make ``fmt`` the format of ``--ckpt-format name`` (replacing any earlier one)."""
    _FORMATS[name] = fmt


def registered_formats() -> Tuple[str, ...]:
    """The ``--ckpt-format`` values the dying checkpoint writes, in registration order."""
    return tuple(_FORMATS)


def checkpoint_format(args: Any) -> str:
    """The run's ``--ckpt-format`` (:data:`DEFAULT_FORMAT` when the framework has no such flag)."""
    return getattr(args, "ckpt_format", None) or DEFAULT_FORMAT


def get_format(ckpt_format: Optional[str]) -> CheckpointFormat:
    """The format registered for the ``--ckpt-format`` value ``ckpt_format`` (None: the default).

    Raises:
        ConfigError: no format of that name, naming ``--ckpt-format`` and the accepted values.
    """
    name = ckpt_format or DEFAULT_FORMAT
    try:
        return _FORMATS[name]
    except KeyError:
        raise ConfigError(f"--ckpt-format {name} with --enable-high-availability: the dying checkpoint "
                          f"is written in {' or '.join(_FORMATS)}") from None


def format_of(args: Any) -> CheckpointFormat:
    """``get_format(checkpoint_format(args))``: the format of the run with ``args``."""
    return get_format(checkpoint_format(args))


def check_args(args: Any) -> None:
    """The start-up check: the dying checkpoint can be written in the run's ``--ckpt-format``.

    Raises:
        ConfigError: an unknown format (:func:`get_format`) or one the format refuses
            (:meth:`CheckpointFormat.check`).
    """
    format_of(args).check(args)


def validate_checkpoint_dir(ckpt_dir: str, iteration: Optional[int] = None) -> List[str]:
    """Validate an ``iter_XXXXXXX`` directory of unknown format (a test, a tool): the
    format whose files are there (:meth:`CheckpointFormat.recognizes`) checks it.

    Raises:
        CheckpointError: no format recognizes it, or its format's validation failed.
    """
    for fmt in _FORMATS.values():
        if fmt.recognizes(ckpt_dir):
            return fmt.validate(ckpt_dir, iteration)
    raise CheckpointError(f"{ckpt_dir}: not a checkpoint of any format ({', '.join(_FORMATS)})")


register_format(TorchFormat.name, TorchFormat())
register_format(TorchDistFormat.name, TorchDistFormat())

__all__ = [
    "CheckpointFormat", "SaverRole", "DEFAULT_FORMAT", "register_format", "registered_formats",
    "checkpoint_format", "get_format", "format_of", "check_args", "validate_checkpoint_dir",
]
