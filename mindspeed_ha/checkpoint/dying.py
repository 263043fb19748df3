"""Dying checkpoint [TTP]: surviving ranks write one consistent Megatron checkpoint.

Runs in the processor's action thread while the training thread may be blocked in a
collective with a dead peer, so nothing here uses a collective. Three phases, each
driven by the controller (``control.policy``), each done by the run's checkpoint format
(``--ckpt-format``, :func:`mindspeed_ha.checkpoint.formats.get_format`):

1. :func:`dump`: every chosen saver writes its part into
   ``<save>/.mindspeed_ha_dying_iter_XXXXXXX/`` (optimizer shard and/or model:
   :mod:`.formats.torch`, :mod:`.formats.torch_dist`);
2. :func:`assemble`: one rank per (TP, PP) completes what the savers wrote together;
3. :func:`commit`: one rank merges the parts, validates the staged ``iter_XXXXXXX``,
   fsyncs, renames it into ``<save>`` and updates ``latest_checkpointed_iteration.txt``
   (:mod:`.commit`).

The state saved is the one consistent at the end of iteration ``k``: the controller
only picks ranks whose optimizer status is UPDATED(k) and that are frozen (they will
not start the update of ``k+1``); the RNG state is the snapshot taken when iteration
``k``'s optimizer update ended (:class:`~mindspeed_ha.checkpoint.state.IterationSnapshot`).

Failure (any exception in a phase, e.g. a full disk, or a saver's death): the controller
ends the job with EXIT(77) and every rank that took part removes the staging dir
(:func:`discard`, from the runtime's exit handler) unless its checkpoint validated (then
it is kept and the command that publishes it logged); the tracker is never touched and a
half-committed ``iter_XXXXXXX`` is moved back first (:func:`commit`).
"""

from __future__ import annotations

from typing import Optional

from mindspeed_ha.checkpoint import staging
from mindspeed_ha.checkpoint.commit import ENV_KEEP_FAILED_STAGING, commit, discard
from mindspeed_ha.checkpoint.formats import SaverRole, format_of
from mindspeed_ha.checkpoint.state import DyingContext, IterationSnapshot, staging_root
from mindspeed_ha.checkpoint.steps import gc_paused


def dump(ctx: DyingContext, iteration: int, snapshot: Optional[IterationSnapshot],
         write_shard: bool, write_model: bool, shard_digest: str = "", model_digest: str = "") -> str:
    """Phase 1 on one rank (garbage collection paused). Returns a one-line description of
    what was written, with the seconds of each step in brackets.

    ``shard_digest`` / ``model_digest``: the digests the policy trusted for this rank's
    shard / model (DumpPlan; "" = not verified). The bytes written are digested in memory,
    from the very buffers handed to the write, and must have them: the file then holds
    what the VERIFY round checked (finite, agreed by the majority) whatever the state did
    since. A mismatch fails the dump after the write; the staging dir is never
    published then (EXIT 77, :func:`discard`).

    Raises:
        RuntimeError: this rank has no snapshot for ``iteration`` (its state moved on).
        IntegrityError: what was written is not what was verified (the caller's action
            fails: EXIT 77, nothing published).
        ConfigError: an unknown ``--ckpt-format``.
    """
    if snapshot is None or snapshot.iteration != iteration:
        have = None if snapshot is None else snapshot.iteration
        raise RuntimeError(f"no consistent state for iteration {iteration} (snapshot at {have})")
    role = SaverRole(write_shard, write_model, shard_digest, model_digest)
    staging.create(ctx.args.save, iteration)  # with its owner marker, before the first write
    with gc_paused():
        return format_of(ctx.args).dump(ctx, iteration, snapshot, role)


def assemble(ctx: DyingContext, iteration: int) -> str:
    """Phase 2 on one rank per (TP, PP), after every saver (``torch``: ``distrib_optim.pt``
    checked complete and its CRC-32 fields set; ``torch_dist``: nothing, the parts are
    merged by :func:`commit`). Returns what was done.

    Raises:
        CheckpointError: the savers' writes are missing or do not tile the file.
    """
    return format_of(ctx.args).assemble(ctx, iteration)


__all__ = ["dump", "assemble", "commit", "discard", "staging_root", "ENV_KEEP_FAILED_STAGING"]
