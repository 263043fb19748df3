"""The dying checkpoint's phases: STOPPING, VERIFYING, DUMPING, ASSEMBLING, COMMITTING,
EXITING. Pure.

STOPPING ends when every live rank answered STOPPED (or ``stop_timeout_s``: silent
ranks are unavailable); the selection (:func:`~.dying.select_dying_checkpoint`) then
picks the iteration, VERIFY screens the copies (when ranks can verify), and DUMP,
ASSEMBLE, COMMIT write it; any failure, lost target or ``action_timeout_s`` there is
EXIT(77), nothing committed. EXITING waits for every EXIT target to go.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Union

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control.policy.decision import (ActionKind, Decision, VerifyPlan, exit_all, live_targets,
                                                  noop)
from mindspeed_ha.control.policy.dying import (DumpOrder, DumpPlan, NoCompleteData, select_dying_checkpoint,
                                               usable)
from mindspeed_ha.control.state import ClusterState, OptimizerStatus, Phase, summarise_ranks
from mindspeed_ha.faults import (EXIT_DYING_CHECKPOINT_SAVED, EXIT_FAILED_BEFORE_TRAINING,
                                 EXIT_FAULT_UNRECOVERABLE, EXIT_NO_COMPLETE_DATA)

NOTHING_COMPLETED = "no iteration has completed yet: nothing to save; nothing written"


def update_settle_s(config: HAConfig) -> float:
    """How long the stop round waits for ranks caught inside an optimizer update, seconds."""
    return min(config.stop_timeout_s, config.heartbeat_timeout_s)


def stopping(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]) -> Decision:
    """STOPPING: wait for STOPPED from every live rank (up to ``stop_timeout_s``), then choose."""
    waiting = [r for r in live_targets(state, gone) if not state.ranks[r].stopped]
    elapsed = now - state.phase_since
    if waiting and elapsed < config.stop_timeout_s:
        return noop(f"waiting for STOPPED from ranks {summarise_ranks(waiting)}")
    unavailable = dict(gone)
    for r in waiting:
        unavailable[r] = f"no STOPPED within {config.stop_timeout_s} s"
    return after_stop(state, config, gone, unavailable, elapsed)


def after_stop(state: ClusterState, config: HAConfig, gone: Mapping[int, str], unavailable: Mapping[int, str],
               elapsed: float) -> Decision:
    """Every live rank is frozen (or given up on): choose the iteration, then VERIFY or DUMP."""
    if state.ranks and all(info.iteration < 0 for info in state.ranks.values()):
        # No rank reached its first train_step (none ever reported an optimizer status):
        # start-up or --load failed. Saying "no complete data" would blame training.
        first = "a rank failed"
        if state.fault is not None:  # the evidence, without "stopping all ranks for a dying checkpoint"
            first = state.fault.reason.split("; stopping all ranks")[0]
        return exit_all(state, EXIT_FAILED_BEFORE_TRAINING,
                        f"{first}, before training started (start-up, or resuming from --load): not a training "
                        "fault; nothing to save, nothing written, the checkpoint loaded is untouched; the failing "
                        "rank's own error says why")
    save_dir = state.save_dir or config.save_dir
    if not save_dir:
        return exit_all(state, EXIT_FAULT_UNRECOVERABLE, "no --save directory: a dying checkpoint cannot be written")
    choice = select_dying_checkpoint(state.ranks, unavailable)
    wait = _settle_wait(state, unavailable, choice, elapsed, config)
    if wait is not None:
        return wait
    if isinstance(choice, NoCompleteData):
        return exit_all(state, EXIT_NO_COMPLETE_DATA, choice.reason + "; nothing written")
    if choice.iteration == 0:
        return exit_all(state, EXIT_NO_COMPLETE_DATA, NOTHING_COMPLETED)
    verifiers = tuple(r for r, info in sorted(state.ranks.items())
                      if info.verifies and usable(info, unavailable))
    if verifiers:
        return Decision(ActionKind.VERIFY, f"iteration {choice.iteration} is complete; verifying the "
                        f"integrity of every usable copy (ranks {summarise_ranks(verifiers)})",
                        VerifyPlan(tuple(sorted(unavailable.items()))), verifiers, Phase.VERIFYING)
    return Decision(ActionKind.DUMP, choice.reason, DumpOrder(choice, save_dir), choice.savers(), Phase.DUMPING)


def _settle_wait(state: ClusterState, unavailable: Mapping[int, str], choice: Union[DumpPlan, NoCompleteData],
                 elapsed: float, config: HAConfig) -> Optional[Decision]:
    """NOOP while a frozen rank is still inside an optimizer update that could raise k.

    STOP freezes a rank against *starting* an update; one already running goes on and
    normally ends within milliseconds (its collectives stay inside its own optimizer
    instance). Deciding on the transient UPDATING status would lose that iteration, so
    the controller waits, up to :func:`update_settle_s`, but only if treating those ranks
    as UPDATED would give a higher iteration (a rank stuck forever in a collective with
    the dead peer then costs nothing when another replica already covers its shard).
    """
    settling = [r for r, info in state.ranks.items()
                if r not in unavailable and info.alive and info.stopped
                and info.status is OptimizerStatus.UPDATING]
    if not settling or elapsed >= update_settle_s(config):
        return None
    optimistic = {r: (dataclasses.replace(info, status=OptimizerStatus.UPDATED) if r in settling else info)
                  for r, info in state.ranks.items()}
    best = select_dying_checkpoint(optimistic, unavailable)
    if isinstance(best, NoCompleteData):
        return None
    if isinstance(choice, DumpPlan) and best.iteration <= choice.iteration:
        return None
    return noop(f"ranks {summarise_ranks(settling)} are finishing the optimizer update of iteration "
                f"{best.iteration}; waiting up to {update_settle_s(config)} s")


def verifying(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]) -> Decision:
    """VERIFYING: wait for the integrity reports, then choose among clean holders only.

    A target that fails, dies or stays silent past ``action_timeout_s`` is not fatal:
    its copy is just not used.
    """
    pending = state.pending
    if pending is None:
        return exit_all(state, EXIT_FAULT_UNRECOVERABLE, "verifying without a pending action")
    waiting = [t for t in pending.targets if t not in pending.results and t not in gone]
    if waiting and now - pending.sent_at <= config.action_timeout_s:
        return noop(f"verifying: waiting for ranks {summarise_ranks(waiting)}")
    unavailable = {int(r): str(why) for r, why in pending.params.get("unavailable", ())}
    unavailable.update(gone)
    for t in pending.targets:
        if t not in pending.results:
            unavailable.setdefault(t, f"no integrity report within {config.action_timeout_s} s")
        elif not pending.results[t][0]:
            unavailable.setdefault(t, f"verification failed: {pending.results[t][1]}")
    choice = select_dying_checkpoint(state.ranks, unavailable, verified=True)
    if isinstance(choice, NoCompleteData):
        return exit_all(state, EXIT_NO_COMPLETE_DATA, choice.reason + "; nothing written")
    if choice.iteration == 0:
        return exit_all(state, EXIT_NO_COMPLETE_DATA, NOTHING_COMPLETED)
    save_dir = state.save_dir or config.save_dir
    return Decision(ActionKind.DUMP, choice.reason, DumpOrder(choice, save_dir), choice.savers(), Phase.DUMPING)


def saving(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]) -> Decision:
    """DUMPING / ASSEMBLING / COMMITTING: collect the results, then the next step of the
    same plan (ASSEMBLE, COMMIT, EXIT(75)); a failure, a lost target or a timeout: EXIT(77)."""
    pending, plan, name = state.pending, state.plan, state.phase.value
    if pending is None or plan is None:
        return exit_all(state, EXIT_FAULT_UNRECOVERABLE, f"{name} without a pending action")
    if pending.failures:
        r, detail = sorted(pending.failures.items())[0]
        return exit_all(state, EXIT_FAULT_UNRECOVERABLE, f"{name} failed on rank {r}: {detail}; nothing committed")
    lost = [t for t in pending.targets if t in gone and t not in pending.results]
    if lost:
        return exit_all(state, EXIT_FAULT_UNRECOVERABLE,
                        f"rank {lost[0]} lost during {name} ({gone[lost[0]]}); nothing committed")
    if not pending.complete:
        missing = [t for t in pending.targets if t not in pending.results]
        if now - pending.sent_at > config.action_timeout_s:
            return exit_all(state, EXIT_FAULT_UNRECOVERABLE,
                            f"{name} timed out after {config.action_timeout_s} s waiting for ranks "
                            f"{summarise_ranks(missing)}; nothing committed")
        return noop(f"{name}: waiting for ranks {summarise_ranks(missing)}")
    order = DumpOrder(plan, pending.params.get("save_dir"))
    if state.phase is Phase.DUMPING:
        return Decision(ActionKind.ASSEMBLE, f"all shards of iteration {plan.iteration} saved; assembling",
                        order, tuple(sorted(set(plan.assemblers.values()))), Phase.ASSEMBLING)
    if state.phase is Phase.ASSEMBLING:
        return Decision(ActionKind.COMMIT, f"iteration {plan.iteration} assembled; committing",
                        order, (plan.committer,), Phase.COMMITTING)
    return exit_all(state, EXIT_DYING_CHECKPOINT_SAVED,
                    f"dying checkpoint of iteration {plan.iteration} committed to {order.save_dir}")


def exiting(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]) -> Decision:
    """EXITING: every EXIT target gone or said goodbye -> DONE; past ``stop_timeout_s`` the
    rest is left to the launcher (DONE too)."""
    pending = state.pending
    targets = pending.targets if pending is not None else tuple(state.ranks)
    remaining = [t for t in targets if t not in gone]
    if not remaining:
        return noop("every rank exited", Phase.DONE)
    sent = pending.sent_at if pending is not None else state.phase_since
    if now - sent > config.stop_timeout_s:
        return noop(f"ranks {summarise_ranks(remaining)} did not exit within {config.stop_timeout_s} s; leaving "
                    "them to the launcher", Phase.DONE)
    return noop(f"waiting for ranks {summarise_ranks(remaining)} to exit")


__all__ = ["NOTHING_COMPLETED", "after_stop", "exiting", "saving", "stopping", "update_settle_s", "verifying"]
