"""Pure decision functions of the controller. No I/O, no clocks, no torch.

:func:`decide` maps ``(now, ClusterState, HAConfig)`` to one :class:`Decision` (an
action, its targets and params, the next job phase and a human-readable reason).
The controller thread applies it; tests call it directly with a chosen ``now``.

Phases and what moves them (see ``state.Phase``)::

    RUNNING     a fault (rank dead: agent report, disconnect, GOODBYE != 0, heartbeat
                silence > heartbeat_timeout_s; or a FAULT report)      -> STOP_ALL, STOPPING
                every rank said GOODBYE(0)                              -> NOOP, DONE
                a graceful stop was requested (SIGTERM/SIGINT to the launcher or a rank)
                                                                        -> DRAIN(-1), DRAINING
    DRAINING    (graceful stop, see :func:`_draining`) round 1: every rank says after which
                iteration it will pause; K = :func:`agree_pause` -> DRAIN(K) to all; round 2:
                every rank paused after K (STOPPED pause_at=K) -> as STOPPING below, with no
                dead rank. A fault -> STOP_ALL, STOPPING. Half the preemption deadline passed
                -> STOP_ALL (freeze now: the iteration in progress is abandoned), STOPPING.
                Every rank said GOODBYE(0) (training ended meanwhile) -> DONE
    STOPPING    every live rank answered STOPPED, or stop_timeout_s passed (silent ranks
                are unavailable) -> no rank started training (start-up or --load
                failed): EXIT(79); no save dir: EXIT(77); no complete data: EXIT(76);
                else VERIFY to every usable rank that can verify       -> VERIFYING
                (none can: DUMP(plan) to shard/model savers            -> DUMPING)
    VERIFYING   every target answered (integrity report of its frozen state), died, or
                action_timeout_s passed (then it is unusable) -> selection again, keeping
                only clean holders (``integrity.screen``): no trustworthy copy of some
                shard or model: EXIT(76); else DUMP(plan with the trusted digests, which
                every saver re-checks in what it wrote)                 -> DUMPING
    DUMPING     all savers ok -> ASSEMBLE to assemblers                 -> ASSEMBLING
    ASSEMBLING  all assemblers ok -> COMMIT to the committer            -> COMMITTING
    COMMITTING  committer ok -> EXIT(75, checkpoint of iteration k)     -> EXITING
    (any failure, death of a target, or action_timeout_s in DUMPING..COMMITTING
     -> EXIT(77), nothing committed)
    EXITING     every EXIT target gone/goodbye, or stop_timeout_s        -> DONE
    (graceful stop: ``preemption_deadline_s`` after the request, any phase from STOPPING
     to ASSEMBLING -> EXIT(77): nothing committed, the previous checkpoint stays the latest)

Without a controller (it was lost and no standby took over) every rank runs the same
pure functions on the statuses all ranks exchanged: :func:`agree_pause`, then
:func:`plan_without_controller`.

In-place recovery (UCE repair, network retry; see :mod:`.recovery_plan`)::

    RUNNING     a UCE (--enable-hbmfault-repair) or network fault (--ha-network-retries > 0)
                reported by a live rank                  -> STOP_ALL (observe), RECOVERING
    RECOVERING  every rank STOPPED, all UPDATED at one iteration, or all inside one update
                with every unfinished rank faulty (or update_settle_s)
                                                         -> STOP_ALL(recover): abort every step;
                every rank parked in its fault handler -> plan_recovery: RETRY(plan) to all;
                every RETRY result ok                    -> RESUME (no message), RUNNING;
                no plan, a failure, a lost rank, a new fault, a timeout
                                                         -> STOP_ALL(recover), STOPPING (dying checkpoint)

ARF (worker restart) and PAUSE are declared but not chosen yet.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from mindspeed_ha.config import HAConfig
from mindspeed_ha.faults import (
    EXIT_CONTROLLER_LOST,
    EXIT_DYING_CHECKPOINT_SAVED,
    EXIT_FAILED_BEFORE_TRAINING,
    EXIT_FAULT_UNRECOVERABLE,
    EXIT_NO_COMPLETE_DATA,
    FaultKind,
)
from mindspeed_ha.control import integrity
from mindspeed_ha.control.recovery_plan import REJOIN, NoRecovery, in_place_possible, plan_recovery
from mindspeed_ha.control.state import ClusterState, OptimizerStatus, Phase, RankInfo

ShardKey = Tuple[int, int, int]  # (tp_rank, pp_rank, shard_id)
ModelKey = Tuple[int, int]  # (tp_rank, pp_rank)


class ActionKind(str, enum.Enum):
    NOOP = "noop"
    STOP_ALL = "stop_all"
    DUMP = "dump"
    ASSEMBLE = "assemble"
    COMMIT = "commit"
    EXIT = "exit"
    VERIFY = "verify"
    DRAIN = "drain"  # graceful stop: a DRAIN message (not an ACTION) with params {"until": k}
    # declared for the recovery paths; not chosen by decide() yet
    REPAIR = "repair"
    RETRY = "retry"
    PAUSE = "pause"
    RESUME = "resume"


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the controller must do now.

    Attributes:
        action: the action kind (NOOP: nothing to send).
        reason: one human-readable sentence (logged, recorded in events).
        params: ACTION params (msgpack-able: str keys, lists, scalars).
        targets: ranks the STOP / ACTION message goes to.
        next_phase: the job phase after applying, or None to stay.
    """

    action: ActionKind
    reason: str
    params: Dict[str, Any] = dataclasses.field(default_factory=dict)
    targets: Tuple[int, ...] = ()
    next_phase: Optional[Phase] = None


@dataclasses.dataclass(frozen=True)
class DumpPlan:
    """Who writes which part of the dying checkpoint of ``iteration``.

    Attributes:
        iteration: k, the common consistent iteration.
        shard_savers: (tp, pp, shard_id) -> rank writing that optimizer shard.
        model_savers: (tp, pp) -> rank writing ``model_optim_rng.pt`` (one of the shard savers).
        assemblers: (tp, pp) -> rank merging the shard files into ``distrib_optim.pt``.
        committer: the rank that validates, renames the temp dir and writes the tracker.
        shards_per_instance: shards per (tp, pp) (1: non-distributed optimizer).
        reason: why this plan.
        shard_digests / model_digests: the trusted digest of each shard / (tp, pp) model
            (empty when no saver could verify): a saver checks what it wrote against it.
    """

    iteration: int
    shard_savers: Dict[ShardKey, int]
    model_savers: Dict[ModelKey, int]
    assemblers: Dict[ModelKey, int]
    committer: int
    shards_per_instance: int = 1
    reason: str = ""
    shard_digests: Dict[ShardKey, str] = dataclasses.field(default_factory=dict)
    model_digests: Dict[ModelKey, str] = dataclasses.field(default_factory=dict)

    def savers(self) -> Tuple[int, ...]:
        return tuple(sorted(set(self.shard_savers.values()) | set(self.model_savers.values())))

    def to_params(self, save_dir: Optional[str] = None) -> Dict[str, Any]:
        """msgpack-able form sent in DUMP / ASSEMBLE / COMMIT actions."""
        return {
            "iteration": self.iteration,
            "save_dir": save_dir,
            "shard_savers": [[t, p, s, r] for (t, p, s), r in sorted(self.shard_savers.items())],
            "model_savers": [[t, p, r] for (t, p), r in sorted(self.model_savers.items())],
            "assemblers": [[t, p, r] for (t, p), r in sorted(self.assemblers.items())],
            "committer": self.committer,
            "shards_per_instance": self.shards_per_instance,
            "reason": self.reason,
            "shard_digests": [[t, p, s, d] for (t, p, s), d in sorted(self.shard_digests.items())],
            "model_digests": [[t, p, d] for (t, p), d in sorted(self.model_digests.items())],
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "DumpPlan":
        """Inverse of :meth:`to_params` (used by the rank runtime)."""
        return cls(
            iteration=int(params["iteration"]),
            shard_savers={(t, p, s): r for t, p, s, r in params["shard_savers"]},
            model_savers={(t, p): r for t, p, r in params["model_savers"]},
            assemblers={(t, p): r for t, p, r in params["assemblers"]},
            committer=int(params["committer"]),
            shards_per_instance=int(params.get("shards_per_instance", 1)),
            reason=str(params.get("reason", "")),
            shard_digests={(t, p, s): str(d) for t, p, s, d in params.get("shard_digests", ())},
            model_digests={(t, p): str(d) for t, p, d in params.get("model_digests", ())},
        )

    def roles(self, rank: int) -> Dict[str, Any]:
        """What ``rank`` does: shards it saves, (tp,pp) models it saves/assembles, commit."""
        return {
            "shards": sorted(k for k, r in self.shard_savers.items() if r == rank),
            "models": sorted(k for k, r in self.model_savers.items() if r == rank),
            "assemble": sorted(k for k, r in self.assemblers.items() if r == rank),
            "commit": self.committer == rank,
        }


@dataclasses.dataclass(frozen=True)
class NoCompleteData:
    """No iteration has every shard held by a usable rank; ``reason`` names a missing shard."""

    reason: str


def _holder_state(info: RankInfo, unavailable: Mapping[int, str]) -> str:
    if not info.alive:
        return f"rank {info.rank} dead ({info.dead_reason or 'exited'})"
    if info.rank in unavailable:
        return f"rank {info.rank} unavailable ({unavailable[info.rank]})"
    if not info.stopped:
        return f"rank {info.rank} did not answer STOP"
    if info.fault is FaultKind.UCE:
        return f"rank {info.rank} has a device memory error"
    return f"rank {info.rank} {info.status.value}@{info.iteration}"


def _usable(info: RankInfo, unavailable: Mapping[int, str]) -> bool:
    return (
        info.alive
        and info.stopped
        and info.rank not in unavailable
        and info.fault is not FaultKind.UCE
        and info.status is OptimizerStatus.UPDATED
    )


def update_settle_s(config: HAConfig) -> float:
    """How long the stop round waits for ranks caught inside an optimizer update, seconds."""
    return min(config.stop_timeout_s, config.heartbeat_timeout_s)


def _settle_wait(state: ClusterState, unavailable: Mapping[int, str], choice, elapsed: float,
                 config: HAConfig) -> Optional[Decision]:
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
    return Decision(ActionKind.NOOP, f"ranks {settling} are finishing the optimizer update of iteration "
                                     f"{best.iteration}; waiting up to {update_settle_s(config)} s")


def select_dying_checkpoint(
    ranks: Mapping[int, RankInfo], unavailable: Optional[Mapping[int, str]] = None, verified: bool = False
) -> Union[DumpPlan, NoCompleteData]:
    """Choose the iteration and the savers of a dying checkpoint.

    A shard (tp_rank, pp_rank, shard_id) is held by ``replica_count`` ranks (one per
    optimizer instance). Picks the highest k such that every shard of every (tp, pp)
    has a usable holder (alive, answered STOP, no UCE, not in ``unavailable``) whose
    authoritative status is UPDATED at exactly k. UPDATING holders are dirty. With
    ``verified``, a holder that can verify must also be clean at k (see
    :mod:`.integrity`: finite, and its shard and model digests are the trusted ones);
    the plan then carries the trusted digests.

    Savers: the instance covering the most shards at k is preferred (ties: lowest
    instance id), so each rank saves at most one shard when possible; otherwise the
    holder of the lowest instance id, then lowest rank. The model file of (tp, pp) is
    written by the saver of shard 0, the assembly by the saver of shard 1 (spreading
    load; shard 0 again if there is one shard), the commit by the model saver of (0, 0).

    Args:
        ranks: rank -> RankInfo of every registered rank.
        unavailable: rank -> reason for ranks to exclude (e.g. heartbeat silence).
        verified: apply the integrity rule (after the VERIFY round).

    Returns:
        DumpPlan, or NoCompleteData whose reason names a missing shard and its holders.
    """
    unavailable = dict(unavailable or {})
    if not ranks:
        return NoCompleteData("no rank registered")
    layouts = {(i.layout.tp_size, i.layout.pp_size, i.layout.shards_per_instance) for i in ranks.values()}
    if len(layouts) != 1:
        return NoCompleteData(f"ranks registered inconsistent layouts (tp, pp, shards): {sorted(layouts)}")
    tp_size, pp_size, n_shards = layouts.pop()
    keys: List[ShardKey] = [(t, p, s) for t in range(tp_size) for p in range(pp_size) for s in range(n_shards)]
    holders: Dict[ShardKey, List[RankInfo]] = {k: [] for k in keys}
    for info in ranks.values():
        key = info.layout.shard_key
        if key not in holders:
            return NoCompleteData(f"rank {info.rank} reports shard {key} outside the layout")
        holders[key].append(info)
    usable = {k: [h for h in hs if _usable(h, unavailable)] for k, hs in holders.items()}
    candidates = sorted({h.iteration for hs in usable.values() for h in hs}, reverse=True)
    first_failure: Optional[str] = None
    for k in candidates:
        at_k = {key: [h for h in hs if h.iteration == k] for key, hs in usable.items()}
        if not all(at_k.values()):
            continue
        if not verified:
            return _plan(k, at_k, n_shards)
        verdict = integrity.screen(k, at_k)
        clean = {key: [h for h in hs if verdict.eligible(h)] for key, hs in at_k.items()}
        if all(clean.values()):
            return _plan(k, clean, n_shards, verdict)
        if first_failure is None:
            first_failure = _untrustworthy(k, at_k, clean, verdict, holders, unavailable)
    if first_failure is not None:
        return NoCompleteData(first_failure)
    # explain: for the best candidate, name the first missing shard and its holders
    if not candidates:
        key = keys[0]
        why = "no healthy, stopped rank is in state UPDATED"
    else:
        k = candidates[0]
        key = next(key for key in keys if not any(h.iteration == k for h in usable[key]))
        why = f"at iteration {k}"
    states = "; ".join(_holder_state(h, unavailable) for h in sorted(holders[key], key=lambda h: h.rank))
    return NoCompleteData(
        f"no complete data: shard (tp={key[0]}, pp={key[1]}, shard={key[2]}) has no usable UPDATED holder "
        f"{why} (holders: {states or 'none registered'})"
    )


def _untrustworthy(k: int, at_k: Mapping[ShardKey, List[RankInfo]], clean: Mapping[ShardKey, List[RankInfo]],
                   verdict: "integrity.Verdict", holders: Mapping[ShardKey, List[RankInfo]],
                   unavailable: Mapping[int, str]) -> str:
    """Why iteration ``k`` has no trustworthy copy of some shard: the first such shard, its holders."""
    key = next(key for key in sorted(clean) if not clean[key])
    groups = [verdict.untrusted.get(("shard", key)), verdict.untrusted.get(("model", key[:2]))]
    states = []
    screened = {h.rank for h in at_k[key]} & set(verdict.suspect)
    for h in sorted(holders[key], key=lambda h: h.rank):
        states.append(verdict.suspect[h.rank] if h.rank in screened else _holder_state(h, unavailable))
    return (f"no complete data: shard (tp={key[0]}, pp={key[1]}, shard={key[2]}) has no trustworthy copy at "
            f"iteration {k}{''.join(f'; {g}' for g in groups if g)} (holders: {'; '.join(states)})")


def _plan(k: int, at_k: Dict[ShardKey, List[RankInfo]], n_shards: int,
          verdict: Optional["integrity.Verdict"] = None) -> DumpPlan:
    coverage: Dict[int, int] = {}
    for hs in at_k.values():
        for inst in {h.layout.instance_id for h in hs}:
            coverage[inst] = coverage.get(inst, 0) + 1
    order = sorted(coverage, key=lambda inst: (-coverage[inst], inst))
    rank_of_inst = {inst: i for i, inst in enumerate(order)}
    shard_savers = {
        key: min(hs, key=lambda h: (rank_of_inst[h.layout.instance_id], h.rank)).rank
        for key, hs in sorted(at_k.items())
    }
    model_keys = sorted({(t, p) for t, p, _ in shard_savers})
    model_savers = {mk: shard_savers[(mk[0], mk[1], 0)] for mk in model_keys}
    assemblers = {mk: shard_savers[(mk[0], mk[1], 1 % n_shards)] for mk in model_keys}
    committer = model_savers[model_keys[0]]
    used = sorted(set(shard_savers.values()))
    trusted = verdict.trusted if verdict is not None else {}
    checked = ""
    if verdict is not None:
        checked = (f"; integrity: {len(verdict.clean)} clean ranks"
                   + (f", excluded {dict(sorted(verdict.suspect.items()))}" if verdict.suspect else ""))
    return DumpPlan(
        iteration=k,
        shard_savers=shard_savers,
        model_savers=model_savers,
        assemblers=assemblers,
        committer=committer,
        shards_per_instance=n_shards,
        reason=f"iteration {k}: every shard has a healthy holder UPDATED at {k}; "
        f"{len(shard_savers)} shards saved by ranks {used} (instances preferred: {order}){checked}",
        shard_digests={key: trusted[("shard", key)] for key in shard_savers if ("shard", key) in trusted},
        model_digests={mk: trusted[("model", mk)] for mk in model_keys if ("model", mk) in trusted},
    )


# --------------------------------------------------------------------------- decide
def gone_ranks(now: float, state: ClusterState, config: HAConfig) -> Dict[int, str]:
    """Ranks that cannot take part any more, with the reason (dead, goodbye, silent)."""
    out: Dict[int, str] = {}
    for r, info in sorted(state.ranks.items()):
        if not info.alive:
            out[r] = info.dead_reason or f"exited with {info.exit_code}"
        elif info.exit_code is not None:
            out[r] = f"said goodbye ({info.exit_code})"
        elif now - info.last_heartbeat > config.heartbeat_timeout_s:
            out[r] = f"no heartbeat for {now - info.last_heartbeat:.3f} s > {config.heartbeat_timeout_s} s"
    return out


def detect_fault(now: float, state: ClusterState, config: HAConfig) -> Optional[Tuple[int, FaultKind, str, float]]:
    """The earliest fault evidence: (rank, kind, reason, evidence time) or None."""
    found: List[Tuple[float, int, FaultKind, str]] = []
    for r, info in sorted(state.ranks.items()):
        at = info.failed_at if info.failed_at is not None else info.last_heartbeat
        if info.fault is not None:
            found.append((at, r, info.fault, f"rank {r} reported {info.fault.value} fault in iteration "
                          f"{info.fault_iteration if info.fault_iteration >= 0 else info.iteration + 1}: "
                          f"{info.fault_message}"))
        elif not info.alive and info.exit_code != 0:
            found.append((at, r, FaultKind.PROCESS, f"rank {r} died: {info.dead_reason}"))
        elif info.alive and info.exit_code not in (None, 0):
            found.append((at, r, FaultKind.PROCESS, f"rank {r} exits with {info.exit_code}"))
        elif info.alive and info.exit_code is None and now - info.last_heartbeat > config.heartbeat_timeout_s:
            found.append((info.last_heartbeat, r, FaultKind.PROCESS,
                          f"rank {r} missed heartbeats for {now - info.last_heartbeat:.3f} s "
                          f"(> {config.heartbeat_timeout_s} s)"))
    for r, (code, why, at) in sorted(state.unregistered_exits.items()):
        if code != 0:
            found.append((at, r, FaultKind.PROCESS, f"rank {r} died before registering: {why}"))
    if not found:
        return None
    at, r, kind, reason = min(found)
    if len(found) > 1:
        reason += f" (+{len(found) - 1} more failed ranks: {sorted(f[1] for f in found if f[1] != r)})"
    return r, kind, reason, at


def _recover_in_place(state: ClusterState, rank: int, kind: FaultKind, config: HAConfig) -> bool:
    """Whether a fault reported by ``rank`` starts an in-place recovery (see
    :mod:`.recovery_plan`): a UCE or network error the flags allow, reported by a rank
    that is still alive. The full rules are checked once every rank is parked."""
    info = state.ranks.get(rank)
    return (info is not None and info.alive and info.exit_code is None and info.fault is kind
            and in_place_possible(kind, config) is None)


def _worker_restart(state: ClusterState, kind: FaultKind, config: HAConfig, gone: Mapping[int, str]) -> bool:
    """ARF: a process fault (a rank died, or a survivor saw its peer crash) with
    ``--enable-worker-reboot``, every gone rank being restarted by its agent
    (``rejoin_wait``; a survivor's report may come before the death's, the recovery
    round then waits for it)."""
    return (config.worker_reboot and kind is FaultKind.PROCESS and bool(gone or state.rejoin_wait)
            and all(r in state.rejoin_wait for r in gone))


def _fall_back(state: ClusterState, gone: Mapping[int, str], now: float, why: str) -> Decision:
    """In-place recovery is impossible or failed: abort every step again (a rank may be
    inside a recovery collective) and take the dying-checkpoint path (STOPPING)."""
    fault = state.fault
    targets = tuple(r for r in state.alive_ranks() if r not in gone)
    rank = fault.rank if fault is not None else -1
    kind = fault.kind.value if fault is not None else FaultKind.UNKNOWN.value
    return Decision(ActionKind.STOP_ALL, f"in-place recovery not possible: {why}; stopping all ranks for a dying "
                    "checkpoint", {"rank": rank, "kind": kind, "at": now, "recover": True}, targets, Phase.STOPPING)


def _parked_to_rejoin(state: ClusterState, rank: int, gone: Mapping[int, str]) -> bool:
    """The restarted process of ``rank`` registered and waits at its rejoin point."""
    info = state.ranks.get(rank)
    return (rank not in gone and info is not None and info.incarnation > 0 and info.stopped
            and info.fault_where == REJOIN)


def _inside_one_update(state: ClusterState, live, dead=()) -> bool:
    """Every rank is inside the optimizer update of the same iteration j (the commit
    barrier keeps them there, see patches/optimizer.py) and every rank still UPDATING
    reported a fault of its own or is a distributed-optimizer instance peer of a faulty
    one (blocked in that instance's parameter all-gather for good): the others finished
    it (UPDATED j) and wait. Any other rank still UPDATING (computing) may yet finish:
    the caller waits up to update_settle_s for it. ``dead``: ranks being restarted (ARF):
    they count as faulty ranks inside the update (their peers never see them finish)."""
    infos = [state.ranks[r] for r in live]
    its = {i.iteration for i in infos}
    if len(its) != 1:
        return False
    j = next(iter(its))
    faulty = [i for i in infos if i.status is OptimizerStatus.UPDATING and i.fault is not None]
    faulty += [state.ranks[r] for r in dead if r in state.ranks]

    def waits_for_a_faulty_peer(i: RankInfo) -> bool:
        # the distributed optimizer's parameter all-gather runs over one optimizer instance
        # (same tp, pp, instance): a peer of a faulty rank there never finishes its update
        return any(f.layout.replica_count < f.layout.dp_size and (f.layout.tp_rank, f.layout.pp_rank,
                   f.layout.instance_id) == (i.layout.tp_rank, i.layout.pp_rank, i.layout.instance_id)
                   for f in faulty)

    return bool(faulty) and all(
        i.step in (-1, j) and (i.status is OptimizerStatus.UPDATED or any(i is f for f in faulty)
                               or (i.status is OptimizerStatus.UPDATING and waits_for_a_faulty_peer(i)))
        for i in infos)


def _recovering(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]) -> Decision:
    """RECOVERING: wait until every rank is parked, send RETRY(plan), collect the results.

    RETRY's result comes from each rank's training thread once it has cleaned, rebuilt its
    process groups, been repaired and rolled back (just before it re-runs the step). All
    ok: RESUME (no message: the phase goes back to RUNNING). A failure, a lost rank, a new
    fault during recovery, or ``action_timeout_s``: the dying checkpoint (nothing loops).
    """
    pending = state.pending
    rejoin = state.rejoin_wait  # ARF: rank -> when its death was reported
    others = {r: why for r, why in gone.items() if r not in rejoin}
    if others:
        r = sorted(others)[0]
        return _fall_back(state, gone, now, f"rank {r} is gone ({others[r]})")
    late = sorted(r for r, since in rejoin.items() if now - since > config.action_timeout_s
                  and not _parked_to_rejoin(state, r, gone))
    if late:
        return _fall_back(state, gone, now, f"rank {late[0]} did not rejoin within {config.action_timeout_s} s of its "
                          "death (--enable-worker-reboot)")
    if pending is None or pending.kind != ActionKind.RETRY.value:
        live = [r for r in state.alive_ranks() if r not in gone and r not in rejoin]  # the survivors
        if state.abort_sent_at is None:
            # round 1 (observe, no freeze): ranks whose gradients are complete finish their
            # optimizer update (it needs no rank that faulted later), so the abort that follows
            # finds every rank at the end of the same iteration; a rank that cannot get there
            # (blocked before it) ends the wait after update_settle_s and the plan falls back
            elapsed = now - state.phase_since
            waiting = [r for r in live if not state.ranks[r].stopped]
            if waiting and elapsed < config.stop_timeout_s:
                return Decision(ActionKind.NOOP, f"recovering: waiting for STOPPED from ranks {waiting}")
            at = {(state.ranks[r].status, state.ranks[r].iteration) for r in live}
            settled = len(at) == 1 and next(iter(at))[0] is OptimizerStatus.UPDATED
            # ... and every rank out of step k (its tail after the update cannot be re-run),
            # inside step k+1 (steps -1: a processor that does not say)
            k = next(iter(at))[1]
            settled = settled and all(state.ranks[r].step in (-1, k + 1) for r in live)
            if not settled:
                settled = _inside_one_update(state, live, dead=tuple(rejoin))
            if not settled and elapsed < update_settle_s(config):
                return Decision(ActionKind.NOOP, "recovering: waiting for every rank to finish the same optimizer "
                                f"update and enter the next step (states "
                                f"{sorted(f'{s.value}@{i}' for s, i in at)}, steps "
                                f"{sorted({state.ranks[r].step for r in live})})")
            fault = state.fault
            return Decision(ActionKind.STOP_ALL, "recovering in place: every rank reported; aborting every step",
                            {"rank": fault.rank if fault else -1, "kind": fault.kind.value if fault else "unknown",
                             "at": fault.at if fault else now, "recover": True}, tuple(live))
        waiting = [r for r in live if state.ranks[r].fault is None or not state.ranks[r].stopped]
        elapsed = now - state.abort_sent_at
        if waiting and elapsed < config.stop_timeout_s:
            return Decision(ActionKind.NOOP, f"recovering: waiting for ranks {waiting} to leave their step")
        if waiting:
            return _fall_back(state, gone, now, f"ranks {waiting} did not leave their step within "
                              f"{config.stop_timeout_s} s")
        starting = sorted(r for r in rejoin if not _parked_to_rejoin(state, r, gone))
        if starting:  # bounded above (action_timeout_s from the death)
            return Decision(ActionKind.NOOP, f"recovering: waiting for the restarted ranks {starting} to rejoin")
        fault_rank = state.fault.rank if state.fault is not None else -1
        plan = plan_recovery(state.ranks, state.world_size, fault_rank, config, state.recoveries)
        if isinstance(plan, NoRecovery):
            return _fall_back(state, gone, now, plan.reason)
        return Decision(ActionKind.RETRY, plan.reason, plan.to_params(), tuple(sorted(live + list(rejoin))))
    if pending.failures:
        r, detail = sorted(pending.failures.items())[0]
        return _fall_back(state, gone, now, f"rank {r} failed to recover: {detail}")
    again = sorted(r for r, i in state.ranks.items() if i.fault_at is not None and i.fault_at > pending.sent_at
                   and r not in pending.results)
    if again:
        return _fall_back(state, gone, now, f"rank {again[0]} reported a fault during recovery: "
                          f"{state.ranks[again[0]].fault_message}")
    if not pending.complete:
        if now - pending.sent_at > config.action_timeout_s:
            missing = [t for t in pending.targets if t not in pending.results]
            return _fall_back(state, gone, now, f"ranks {missing} did not recover within {config.action_timeout_s} s")
        return Decision(ActionKind.NOOP, f"recovering: waiting for ranks "
                        f"{[t for t in pending.targets if t not in pending.results]}")
    it = int(pending.params["iteration"])
    what = (f"goes on with iteration {it} after its optimizer update" if pending.params.get("mode") == "forward"
            else f"re-runs iteration {it + 1}")
    return Decision(ActionKind.RESUME, f"every rank recovered in place and {what}", dict(pending.params), (),
                    Phase.RUNNING)


def _exit(state: ClusterState, gone: Mapping[int, str], code: int, reason: str) -> Decision:
    targets = tuple(r for r in state.alive_ranks() if state.ranks[r].exit_code is None)
    return Decision(ActionKind.EXIT, reason, {"code": code, "reason": reason}, targets, Phase.EXITING)


def _after_verify(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]) -> Decision:
    """VERIFYING: wait for the integrity reports, then choose among clean holders only.

    A target that fails, dies or stays silent past ``action_timeout_s`` is not fatal:
    its copy is just not used.
    """
    pending = state.pending
    if pending is None:
        return _exit(state, gone, EXIT_FAULT_UNRECOVERABLE, "verifying without a pending action")
    waiting = [t for t in pending.targets if t not in pending.results and t not in gone]
    if waiting and now - pending.sent_at <= config.action_timeout_s:
        return Decision(ActionKind.NOOP, f"verifying: waiting for ranks {waiting}")
    unavailable = {int(r): str(why) for r, why in pending.params.get("unavailable", ())}
    unavailable.update(gone)
    for t in pending.targets:
        if t not in pending.results:
            unavailable.setdefault(t, f"no integrity report within {config.action_timeout_s} s")
        elif not pending.results[t][0]:
            unavailable.setdefault(t, f"verification failed: {pending.results[t][1]}")
    choice = select_dying_checkpoint(state.ranks, unavailable, verified=True)
    if isinstance(choice, NoCompleteData):
        return _exit(state, gone, EXIT_NO_COMPLETE_DATA, choice.reason + "; nothing written")
    if choice.iteration == 0:
        return _exit(state, gone, EXIT_NO_COMPLETE_DATA,
                     "no iteration has completed yet: nothing to save; nothing written")
    save_dir = state.save_dir or config.save_dir
    return Decision(ActionKind.DUMP, choice.reason, choice.to_params(save_dir), choice.savers(), Phase.DUMPING)


def _after_stop(state: ClusterState, config: HAConfig, gone: Mapping[int, str], unavailable: Mapping[int, str],
                elapsed: float) -> Decision:
    """Every live rank is frozen (or given up on): choose the iteration, then VERIFY or DUMP."""
    if state.ranks and all(info.iteration < 0 for info in state.ranks.values()):
        # No rank reached its first train_step (none ever reported an optimizer status):
        # start-up or --load failed. Saying "no complete data" would blame training.
        first = "a rank failed"
        if state.fault is not None:  # the evidence, without "stopping all ranks for a dying checkpoint"
            first = state.fault.reason.split("; stopping all ranks")[0]
        return _exit(state, gone, EXIT_FAILED_BEFORE_TRAINING,
                     f"{first}, before training started (start-up, or resuming from --load): not a training "
                     "fault; nothing to save, nothing written, the checkpoint loaded is untouched; the failing "
                     "rank's own error says why")
    save_dir = state.save_dir or config.save_dir
    if not save_dir:
        return _exit(state, gone, EXIT_FAULT_UNRECOVERABLE,
                     "no --save directory: a dying checkpoint cannot be written")
    choice = select_dying_checkpoint(state.ranks, unavailable)
    wait = _settle_wait(state, unavailable, choice, elapsed, config)
    if wait is not None:
        return wait
    if isinstance(choice, NoCompleteData):
        return _exit(state, gone, EXIT_NO_COMPLETE_DATA, choice.reason + "; nothing written")
    if choice.iteration == 0:
        return _exit(state, gone, EXIT_NO_COMPLETE_DATA,
                     "no iteration has completed yet: nothing to save; nothing written")
    verifiers = tuple(r for r, info in sorted(state.ranks.items())
                      if info.verifies and _usable(info, unavailable))
    if verifiers:
        return Decision(ActionKind.VERIFY, f"iteration {choice.iteration} is complete; verifying the "
                        f"integrity of every usable copy (ranks {list(verifiers)})",
                        {"unavailable": [[r, why] for r, why in sorted(unavailable.items())]},
                        verifiers, Phase.VERIFYING)
    return Decision(ActionKind.DUMP, choice.reason, choice.to_params(save_dir), choice.savers(),
                    Phase.DUMPING)


# --------------------------------------------------------------------------- graceful stop
def drain_budget_s(config: HAConfig) -> float:
    """How long a graceful stop waits for every rank to finish its iteration, seconds:
    half the preemption deadline (the other half is for the save)."""
    return config.preemption_deadline_s / 2


def agree_pause(pause_at: Mapping[int, int]) -> Optional[int]:
    """The iteration every rank pauses after in a graceful stop: the highest announced.

    Each rank announces the iteration it is computing (or, between iterations, the next
    one), -1 before its first. The highest one is the only choice that needs no rank to
    undo anything: a rank cannot be made to stop before an iteration it already entered,
    because its peers in that iteration's collectives would wait for it forever; every
    rank behind can finish the iterations up to it, since their peers still have them to
    do too (they all exchange with each other in every iteration, so ranks are at most an
    iteration or so apart). Pure; used by the controller and, when it is lost, by every
    rank on the statuses all ranks exchanged.

    Args:
        pause_at: rank -> announced iteration (-1: not started).

    Returns:
        The iteration K (>= 1), or None when no rank has started an iteration (nothing
        was trained since the start: nothing to save).
    """
    started = [k for k in pause_at.values() if k >= 1]
    return max(started) if started else None


def _draining(now: float, state: ClusterState, config: HAConfig, gone: Mapping[int, str]) -> Decision:
    """DRAINING: the graceful stop's two rounds (see the module docstring).

    A rank that exits 0 meanwhile finished training (its pause would have come after the
    last iteration): when every rank did, the job is DONE like any finished run.
    """
    req = state.stop_request
    if state.ranks and len(state.ranks) >= state.world_size and all(i.exit_code == 0 for i in state.ranks.values()):
        return Decision(ActionKind.NOOP, "every rank finished training during the graceful stop (GOODBYE 0)",
                        next_phase=Phase.DONE)
    fault = detect_fault(now, state, config)
    if fault is not None:
        rank, kind, reason, at = fault
        targets = tuple(r for r in state.alive_ranks() if r not in gone)
        return Decision(ActionKind.STOP_ALL, reason + "; during the graceful stop: stopping all ranks for a dying "
                        "checkpoint", {"rank": rank, "kind": kind.value, "at": at}, targets, Phase.STOPPING)
    elapsed = now - req.at if req is not None else now - state.phase_since
    budget = drain_budget_s(config)
    live = [r for r in state.alive_ranks() if r not in gone]
    if state.drain_until is None:
        waiting = [r for r in live if state.ranks[r].pause_at is None]
        unregistered = state.world_size - len(state.ranks)
        if (waiting or unregistered > 0) and elapsed < budget:
            return Decision(ActionKind.NOOP, f"graceful stop: waiting for ranks {waiting} to say where they pause"
                            + (f" and for {unregistered} ranks to register" if unregistered > 0 else ""))
        if waiting or unregistered > 0:
            if not any((state.ranks[r].pause_at or -1) >= 1 for r in live):
                return _exit(state, gone, EXIT_NO_COMPLETE_DATA, "graceful stop before any rank started its first "
                             "iteration (ranks still starting): nothing to save (a checkpoint it loaded is "
                             "untouched); nothing written")
            return _abandon(state, gone, f"ranks {waiting} did not answer DRAIN within {budget:g} s")
        k = agree_pause({r: state.ranks[r].pause_at for r in live})
        if k is None:
            return _exit(state, gone, EXIT_NO_COMPLETE_DATA, "graceful stop before any rank started its first "
                         "iteration: nothing to save (a checkpoint it loaded is untouched); nothing written")
        return Decision(ActionKind.DRAIN, f"graceful stop: every rank finishes iteration {k} and pauses after it",
                        {"until": k}, tuple(live))
    k = state.drain_until
    waiting = [r for r in live if not state.ranks[r].stopped]
    if waiting and elapsed < budget:
        return Decision(ActionKind.NOOP, f"graceful stop: waiting for ranks {waiting} to pause after iteration {k}")
    if waiting:
        return _abandon(state, gone, f"ranks {waiting} did not finish iteration {k} within {budget:g} s")
    return _after_stop(state, config, gone, dict(gone), elapsed)


def _abandon(state: ClusterState, gone: Mapping[int, str], why: str) -> Decision:
    """Graceful stop past its drain budget: freeze now; the iteration in progress is abandoned
    and the last one every shard holds completely is saved (a classic stop round)."""
    targets = tuple(r for r in state.alive_ranks() if r not in gone)
    return Decision(ActionKind.STOP_ALL, f"graceful stop: {why}; abandoning the iteration in progress "
                    "(freeze now, save the last completed one)", {"graceful": True}, targets, Phase.STOPPING)


def _past_preemption_deadline(now: float, state: ClusterState, config: HAConfig,
                              gone: Mapping[int, str]) -> Optional[Decision]:
    """EXIT(77) once a graceful stop's checkpoint is not committed within the deadline.

    What the deadline protects: the scheduler SIGKILLs everything after its grace period;
    a save cut there leaves a staging directory behind and no exit status. Ending first
    gives a clean 77 (staging removed by the savers, tracker untouched, so the latest
    regular checkpoint stays the resume point). A fault round (no request) has no deadline
    beyond ``action_timeout_s``.
    """
    req = state.stop_request
    # Not in COMMITTING: the commit (validate, rename, tracker) is short and once started
    # may publish the checkpoint; an EXIT(77) racing it would misreport a saved one.
    if req is None or state.phase not in (Phase.STOPPING, Phase.VERIFYING, Phase.DUMPING, Phase.ASSEMBLING):
        return None
    if now - req.at <= config.preemption_deadline_s:
        return None
    return _exit(state, gone, EXIT_FAULT_UNRECOVERABLE,
                 f"graceful stop ({req.reason}): no checkpoint committed within the preemption deadline "
                 f"of {config.preemption_deadline_s:g} s (--ha-preemption-deadline); nothing committed, "
                 "the latest checkpoint is unchanged")


def plan_without_controller(ranks: Mapping[int, RankInfo], save_dir: Optional[str], world_size: int,
                            verified: bool = False) -> Union[DumpPlan, Tuple[int, str]]:
    """The dying checkpoint the ranks write themselves when the controller is lost.

    Every rank runs this on the same input (every rank's status, exchanged over a
    process group made for this at start-up), so every rank gets the same plan without
    anyone deciding for the others. Every rank must be there: the exchange is a
    collective, and without a controller nothing else can say which ranks are gone.

    Args:
        ranks: rank -> RankInfo (layout, status, iteration; ``stopped`` set for ranks
            paused at the agreed iteration; ``integrity`` when it verified).
        save_dir: ``--save`` (None: nothing can be written).
        world_size: ranks in the job.
        verified: apply the integrity rule (every rank that can verify sent a report).

    Returns:
        The DumpPlan, or ``(exit code, reason)``: 77 without ``--save``; 78 when a rank is
        missing; 76 when no complete data or no iteration completed.
    """
    if not save_dir:
        return EXIT_FAULT_UNRECOVERABLE, "no --save directory: a checkpoint cannot be written; nothing written"
    missing = sorted(set(range(world_size)) - set(ranks))
    if missing:
        return EXIT_CONTROLLER_LOST, f"ranks {missing} did not take part; nothing written"
    choice = select_dying_checkpoint(ranks, None, verified=verified)
    if isinstance(choice, NoCompleteData):
        return EXIT_NO_COMPLETE_DATA, choice.reason + "; nothing written"
    if choice.iteration == 0:
        return EXIT_NO_COMPLETE_DATA, "no iteration has completed yet: nothing to save; nothing written"
    return choice


def decide(now: float, state: ClusterState, config: HAConfig) -> Decision:
    """The controller's next step. Pure: reads ``state`` and ``config`` only.

    Args:
        now: monotonic time, seconds (same clock as RankInfo.last_heartbeat).
        state: the cluster state (not mutated).
        config: the job's HAConfig.

    Returns:
        A Decision; NOOP with ``next_phase=None`` when nothing is to be done.
    """
    phase = state.phase
    gone = gone_ranks(now, state, config)
    if phase is Phase.DONE:
        return Decision(ActionKind.NOOP, "job done")

    if phase is Phase.RUNNING:
        infos = state.ranks.values()
        if (state.ranks and len(state.ranks) >= state.world_size
                and all(i.exit_code == 0 for i in infos)):
            return Decision(ActionKind.NOOP, "every rank finished (GOODBYE 0)", next_phase=Phase.DONE)
        fault = detect_fault(now, state, config)
        if fault is None and state.stop_request is not None:
            req = state.stop_request
            targets = tuple(r for r in state.alive_ranks() if r not in gone)
            return Decision(ActionKind.DRAIN, f"graceful stop requested ({req.reason}): every rank finishes the "
                            "iteration in progress, then the checkpoint of the last one is written",
                            {"until": -1}, targets, Phase.DRAINING)
        if fault is None:
            return Decision(ActionKind.NOOP, "running")
        rank, kind, reason, at = fault
        targets = tuple(r for r in state.alive_ranks() if r not in gone and r not in state.rejoin_wait)
        if _recover_in_place(state, rank, kind, config) and not gone:
            return Decision(ActionKind.STOP_ALL, reason + "; recovering in place: every rank reports its state",
                            {"rank": rank, "kind": kind.value, "at": at, "in_place": True}, targets,
                            Phase.RECOVERING)
        if _worker_restart(state, kind, config, gone):
            return Decision(ActionKind.STOP_ALL, reason + "; the dead worker is restarted (--enable-worker-reboot): "
                            "the others report their state and wait for it to rejoin",
                            {"rank": rank, "kind": kind.value, "at": at, "in_place": True}, targets,
                            Phase.RECOVERING)
        return Decision(ActionKind.STOP_ALL, reason + "; stopping all ranks for a dying checkpoint",
                        {"rank": rank, "kind": kind.value, "at": at}, targets, Phase.STOPPING)

    if phase is Phase.RECOVERING:
        return _recovering(now, state, config, gone)

    if phase is Phase.DRAINING:
        return _draining(now, state, config, gone)

    late = _past_preemption_deadline(now, state, config, gone)
    if late is not None:
        return late

    if phase is Phase.STOPPING:
        live = [r for r in state.alive_ranks() if r not in gone]
        waiting = [r for r in live if not state.ranks[r].stopped]
        elapsed = now - state.phase_since
        if waiting and elapsed < config.stop_timeout_s:
            return Decision(ActionKind.NOOP, f"waiting for STOPPED from ranks {waiting}")
        unavailable = dict(gone)
        for r in waiting:
            unavailable[r] = f"no STOPPED within {config.stop_timeout_s} s"
        return _after_stop(state, config, gone, unavailable, elapsed)

    if phase is Phase.VERIFYING:
        return _after_verify(now, state, config, gone)

    if phase in (Phase.DUMPING, Phase.ASSEMBLING, Phase.COMMITTING):
        pending = state.pending
        plan: Optional[DumpPlan] = state.plan
        if pending is None or plan is None:
            return _exit(state, gone, EXIT_FAULT_UNRECOVERABLE, f"{phase.value} without a pending action")
        name = phase.value
        if pending.failures:
            r, detail = sorted(pending.failures.items())[0]
            return _exit(state, gone, EXIT_FAULT_UNRECOVERABLE,
                         f"{name} failed on rank {r}: {detail}; nothing committed")
        lost = [t for t in pending.targets if t in gone and t not in pending.results]
        if lost:
            return _exit(state, gone, EXIT_FAULT_UNRECOVERABLE,
                         f"rank {lost[0]} lost during {name} ({gone[lost[0]]}); nothing committed")
        if not pending.complete:
            if now - pending.sent_at > config.action_timeout_s:
                missing = [t for t in pending.targets if t not in pending.results]
                return _exit(state, gone, EXIT_FAULT_UNRECOVERABLE,
                             f"{name} timed out after {config.action_timeout_s} s waiting for ranks {missing}; "
                             "nothing committed")
            return Decision(ActionKind.NOOP, f"{name}: waiting for ranks "
                            f"{[t for t in pending.targets if t not in pending.results]}")
        params = dict(pending.params)
        if phase is Phase.DUMPING:
            targets = tuple(sorted(set(plan.assemblers.values())))
            return Decision(ActionKind.ASSEMBLE, f"all shards of iteration {plan.iteration} saved; assembling",
                            params, targets, Phase.ASSEMBLING)
        if phase is Phase.ASSEMBLING:
            return Decision(ActionKind.COMMIT, f"iteration {plan.iteration} assembled; committing",
                            params, (plan.committer,), Phase.COMMITTING)
        return _exit(state, gone, EXIT_DYING_CHECKPOINT_SAVED,
                     f"dying checkpoint of iteration {plan.iteration} committed to {params.get('save_dir')}")

    if phase is Phase.EXITING:
        pending = state.pending
        targets = pending.targets if pending is not None else tuple(state.ranks)
        remaining = [t for t in targets if t not in gone]
        if not remaining:
            return Decision(ActionKind.NOOP, "every rank exited", next_phase=Phase.DONE)
        sent = pending.sent_at if pending is not None else state.phase_since
        if now - sent > config.stop_timeout_s:
            return Decision(ActionKind.NOOP, f"ranks {remaining} did not exit within {config.stop_timeout_s} s; "
                            "leaving them to the launcher", next_phase=Phase.DONE)
        return Decision(ActionKind.NOOP, f"waiting for ranks {remaining} to exit")

    return Decision(ActionKind.NOOP, f"unhandled phase {phase}")  # pragma: no cover


__all__ = [
    "ActionKind", "Decision", "DumpPlan", "NoCompleteData", "select_dying_checkpoint", "decide",
    "gone_ranks", "detect_fault", "agree_pause", "plan_without_controller", "drain_budget_s",
]
