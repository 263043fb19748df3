"""The interface every ``--ckpt-format`` of the dying checkpoint implements.

The dying checkpoint's flow (:mod:`mindspeed_ha.checkpoint.dying`) is the same for every
format: each saver dumps its part into the staging dir, one rank per (TP, PP) assembles,
one rank merges, validates, publishes and updates the tracker. What differs per format
is what these steps do to the files; a format object answers for its format, and
:func:`mindspeed_ha.checkpoint.formats.get_format` finds it by the ``--ckpt-format``
value (the model: megatron-core's ``dist_checkpointing.strategies.base`` registry of
save/load strategies per backend).

A format's module imports nothing heavy at import time (no torch): the start-up check
runs in the launcher too, which never imports torch.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, List, Optional


@dataclass(frozen=True)
class SaverRole:
    """What one rank writes in the dump phase (its part of the controller's ``DumpPlan``).

    Attributes:
        shard: write this rank's optimizer shard.
        model: write the model (and everything else of its (TP, PP) position).
        shard_digest / model_digest: the digest the VERIFY round trusted for that part
            ("" = not verified): the bytes written must have it.
    """

    shard: bool
    model: bool
    shard_digest: str = ""
    model_digest: str = ""


class CheckpointFormat(abc.ABC):
    """One checkpoint format the dying checkpoint writes; no method uses a collective.

    Attributes:
        name: the ``--ckpt-format`` value.
    """

    name: str = ""

    def check(self, args: Any) -> None:
        """At start-up: the dying checkpoint can be written in this format for ``args``
        (Megatron's parsed args). Must not import torch. The built-in formats refuse
        expert parallelism: the savers write one ``mp_rank_TT[_PPP]`` per (TP, PP) and
        know nothing of the expert ranks' files (``mp_rank_TT[_PPP]_EEE``).

        Raises:
            ConfigError: naming the flag and what to use instead.
        """
        ep = getattr(args, "expert_model_parallel_size", 1) or 1
        if ep != 1:
            from mindspeed_ha.errors import ConfigError

            raise ConfigError(f"--expert-model-parallel-size {ep} with --enable-high-availability: the dying "
                              f"checkpoint ({self.name}) writes no expert-parallel layout; use "
                              "--expert-model-parallel-size 1")

    @abc.abstractmethod
    def dump(self, ctx, iteration: int, snapshot, role: SaverRole) -> str:
        """Phase 1 on one saver (garbage collection already paused): write this rank's
        part(s) of the checkpoint of ``iteration`` into the staging dir.

        Args:
            ctx: the rank's :class:`~mindspeed_ha.checkpoint.state.DyingContext`.
            snapshot: its :class:`~mindspeed_ha.checkpoint.state.IterationSnapshot` of ``iteration``.

        Returns:
            A one-line description of what was written, with the seconds of each step.

        Raises:
            IntegrityError: what was written is not what was verified.
            CheckpointError, OSError: the write failed.
        """

    @abc.abstractmethod
    def assemble(self, ctx, iteration: int) -> str:
        """Phase 2 on one rank per (TP, PP), after every saver. Returns what was done.

        Raises:
            CheckpointError: the savers' parts do not form a complete file.
        """

    def merge(self, save_dir: str, iteration: int, staged: str, steps) -> None:
        """Phase 3, before validation (one rank): make the savers' parts one ``iter_XXXXXXX``
        at ``staged``; each step timed in ``steps`` (:class:`~mindspeed_ha.checkpoint.steps.Steps`).
        Nothing for a format whose savers write the final files in place.

        Raises:
            CheckpointError: the parts do not form a complete checkpoint.
        """

    @abc.abstractmethod
    def validate(self, ckpt_dir: str, iteration: Optional[int] = None) -> List[str]:
        """Check that ``ckpt_dir`` (an ``iter_XXXXXXX`` directory) is complete and of
        ``iteration`` (when given); returns its files.

        Raises:
            CheckpointError: naming what is missing or unreadable.
        """

    @abc.abstractmethod
    def recognizes(self, ckpt_dir: str) -> bool:
        """Whether the files in ``ckpt_dir`` say it is of this format (for a directory of
        unknown format, e.g. in a test; the dying checkpoint goes by ``--ckpt-format``)."""

    def commit(self, staged: str, save_dir: str, iteration: int,
               validate: Optional[Callable[[str, int], Any]] = None) -> str:
        """Publish a merged ``staged`` directory: :meth:`validate` (or ``validate``, a
        wrapper of it), fsync, rename to ``<save_dir>/iter_XXXXXXX``, then the tracker
        (temp + fsync + rename). Returns the published directory.

        Raises:
            CheckpointError: validation failed (nothing renamed, tracker untouched).
            FileExistsError, OSError: see
                :func:`mindspeed_ha.integrations.megatron_lm.commit_checkpoint`.
        """
        from mindspeed_ha.integrations import megatron_lm as mlm

        return mlm.commit_checkpoint(staged, save_dir, iteration, validate=validate or self.validate)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
