"""The dying checkpoint's action handlers (VERIFY, DUMP, ASSEMBLE, COMMIT) and the EXIT
handler, run by the processor's action thread on the rank's frozen state."""

from __future__ import annotations

import logging

from mindspeed_ha.checkpoint import dying
from mindspeed_ha.checkpoint.formats import checkpoint_format
from mindspeed_ha.checkpoint.integrity import verify_state
from mindspeed_ha.control.integrity import short_digest
from mindspeed_ha.faults import EXIT_DYING_CHECKPOINT_SAVED
from mindspeed_ha.recovery import switch

log = logging.getLogger("mindspeed_ha.runtime")


def _roles(rt, params: dict):
    from mindspeed_ha.control.policy import DumpPlan

    plan = DumpPlan.from_params(params)
    return plan, plan.roles(rt.rank)


def on_verify(rt, params: dict):
    """VERIFY: report the integrity of the frozen state (digests, finiteness) to the controller.

    Runs once per fault, in the action thread, while this rank is frozen at UPDATED(k):
    no optimizer update can start, so the state hashed is the state a dump would write.
    """
    from mindspeed_ha.control.state import OptimizerStatus

    status, k = rt.processor.status()
    if status is not OptimizerStatus.UPDATED or not rt.processor.frozen:
        return False, f"rank {rt.rank}: not frozen at a completed update ({status.value}@{k})"
    if rt.ctx is None or rt.snapshot is None or rt.snapshot.iteration != k:
        return False, f"rank {rt.rank}: no consistent state for iteration {k}"
    report = verify_state(rt.ctx, k)
    rt.processor.report_integrity(report)
    verdict = "ok" if report.shard_ok and report.model_ok else f"CORRUPT ({report.detail})"
    return True, (f"rank {rt.rank}: iteration {k} {verdict}, shard {short_digest(report.shard_digest)}, "
                  f"model {short_digest(report.model_digest)}")


def on_dump(rt, params: dict):
    """DUMP: write this rank's part (shard and / or model) of the dying checkpoint."""
    plan, roles = _roles(rt, params)
    rt.staged = plan.iteration  # before the first write: a failure below is cleaned up too
    rt.injector.fire("dying", plan.iteration, rt.ctx)
    shard_key = (rt.layout.tp_rank, rt.layout.pp_rank, rt.layout.shard_id) if rt.layout else None
    model_key = shard_key[:2] if shard_key else None
    detail = dying.dump(rt.ctx, plan.iteration, rt.snapshot,
                        write_shard=bool(roles["shards"]), write_model=bool(roles["models"]),
                        shard_digest=plan.shard_digests.get(shard_key, "") if roles["shards"] else "",
                        model_digest=plan.model_digests.get(model_key, "") if roles["models"] else "")
    return True, f"rank {rt.rank}: {detail}"


def on_assemble(rt, params: dict):
    """ASSEMBLE: merge the parts this rank assembles (if any)."""
    plan, roles = _roles(rt, params)
    if not roles["assemble"]:
        return True, "nothing to assemble"
    return True, f"rank {rt.rank}: {dying.assemble(rt.ctx, plan.iteration)}"


def on_commit(rt, params: dict):
    """COMMIT: publish the dying checkpoint (rename, tracker)."""
    plan, _ = _roles(rt, params)
    fmt = checkpoint_format(rt.ctx.args if rt.ctx is not None else rt.args)
    return True, f"rank {rt.rank}: {dying.commit(rt.args.save, plan.iteration, fmt)}"


def on_exit(rt, code: int, reason: str) -> None:
    """The controller's EXIT (processor action thread): clean up, then end the process.

    A failed dying checkpoint (any exit code but 75) leaves its staging dir behind
    unless someone removes it. Who, and when: the controller sends EXIT to every
    survivor as soon as one saver fails, while other savers may still be writing,
    so a single remover (say the committer) could run before the last write and leave
    files behind. But the processor runs one action at a time, so on each rank this
    EXIT runs only after that rank's own DUMP/ASSEMBLE/COMMIT has returned. Hence
    every rank that took part (got DUMP; assemblers and the committer are savers
    too) removes the whole staging dir here, after its own last write: the last
    removal follows every write, and the partial files of a saver that died go with
    it. Removal is idempotent and moves the dir away before deleting it
    (:func:`mindspeed_ha.checkpoint.commit.discard`), so concurrent removals, and a commit the controller
    timed out, are harmless.
    """
    from mindspeed_ha.control.processor import default_exit_handler

    if rt.staged is not None and code != EXIT_DYING_CHECKPOINT_SAVED:
        try:
            log.warning("rank %d: dying checkpoint failed: %s", rt.rank, dying.discard(rt.args.save, rt.staged))
        except Exception:  # noqa: BLE001 - the exit must happen whatever cleanup did
            log.exception("rank %d: removing the dying checkpoint's staging dir failed", rt.rank)
    default_exit_handler(code, reason)


#: action kind -> handler(rt, params), registered on the processor at start-up
HANDLERS = {"verify": on_verify, "dump": on_dump, "assemble": on_assemble, "commit": on_commit,
            "switch": switch.on_switch}
