"""The dying checkpoint's plan: which iteration, and who writes which part. Pure.

:func:`select_dying_checkpoint` picks the highest iteration k at which every shard has
a usable holder and names the savers, assemblers and the committer (:class:`DumpPlan`),
or says which shard is missing (:class:`NoCompleteData`). The controller runs it after
the stop round (and again after VERIFY, keeping only clean holders); without a
controller every rank runs it on the statuses all ranks exchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

from mindspeed_ha.control import integrity
from mindspeed_ha.control.state import OptimizerStatus, RankInfo, summarise_ranks
from mindspeed_ha.faults import FaultKind

ShardKey = Tuple[int, int, int]  # (tp_rank, pp_rank, shard_id)
ModelKey = Tuple[int, int]  # (tp_rank, pp_rank)


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

    def params_by_rank(self, save_dir: Optional[str], ranks: Iterable[int]) -> Dict[int, Dict[str, Any]]:
        """The DUMP / ASSEMBLE / COMMIT params each of ``ranks`` is sent: the plan's common
        part (iteration, ``save_dir``, committer, shards per instance, reason) and only the
        entries that name that rank (the shards and models it saves, what it assembles, their
        digests), so that a saver of a 16,384-rank job gets its own shard, not the 8,192 of
        everyone. :meth:`from_params` of it gives the rank the same :meth:`roles` and the
        same digests of its parts as the whole plan. O(plan + ranks)."""
        mine: Dict[int, Dict[str, list]] = {r: {"shard_savers": [], "model_savers": [], "assemblers": [],
                                                "shard_digests": [], "model_digests": []} for r in ranks}
        for (t, p, s), r in sorted(self.shard_savers.items()):
            if r in mine:
                mine[r]["shard_savers"].append([t, p, s, r])
                if (t, p, s) in self.shard_digests:
                    mine[r]["shard_digests"].append([t, p, s, self.shard_digests[(t, p, s)]])
        for (t, p), r in sorted(self.model_savers.items()):
            if r in mine:
                mine[r]["model_savers"].append([t, p, r])
                if (t, p) in self.model_digests:
                    mine[r]["model_digests"].append([t, p, self.model_digests[(t, p)]])
        for (t, p), r in sorted(self.assemblers.items()):
            if r in mine:
                mine[r]["assemblers"].append([t, p, r])
        common = {"iteration": self.iteration, "save_dir": save_dir, "committer": self.committer,
                  "shards_per_instance": self.shards_per_instance, "reason": self.reason}
        return {r: dict(common, **parts) for r, parts in mine.items()}

    def roles(self, rank: int) -> Dict[str, Any]:
        """What ``rank`` does: shards it saves, (tp,pp) models it saves/assembles, commit."""
        return {
            "shards": sorted(k for k, r in self.shard_savers.items() if r == rank),
            "models": sorted(k for k, r in self.model_savers.items() if r == rank),
            "assemble": sorted(k for k, r in self.assemblers.items() if r == rank),
            "commit": self.committer == rank,
        }


@dataclasses.dataclass(frozen=True)
class DumpOrder:
    """DUMP, ASSEMBLE or COMMIT of ``plan`` into ``save_dir`` (the three actions carry the
    same params: every target reads its role from the whole plan)."""

    plan: DumpPlan
    save_dir: Optional[str]

    def to_params(self) -> Dict[str, Any]:
        return self.plan.to_params(self.save_dir)


@dataclasses.dataclass(frozen=True)
class NoCompleteData:
    """No iteration has every shard held by a usable rank; ``reason`` names a missing shard."""

    reason: str


def holder_state(info: RankInfo, unavailable: Mapping[int, str]) -> str:
    """Why a holder is (not) usable, for the reasons of :class:`NoCompleteData`."""
    if not info.alive:
        return f"rank {info.rank} dead ({info.dead_reason or 'exited'})"
    if info.rank in unavailable:
        return f"rank {info.rank} unavailable ({unavailable[info.rank]})"
    if not info.stopped:
        return f"rank {info.rank} did not answer STOP"
    if info.fault is FaultKind.UCE:
        return f"rank {info.rank} has a device memory error"
    return f"rank {info.rank} {info.status.value}@{info.iteration}"


def usable(info: RankInfo, unavailable: Mapping[int, str]) -> bool:
    """A holder whose frozen state may be saved: alive, stopped, no UCE, UPDATED."""
    return (
        info.alive
        and info.stopped
        and info.rank not in unavailable
        and info.fault is not FaultKind.UCE
        and info.status is OptimizerStatus.UPDATED
    )


def select_dying_checkpoint(
    ranks: Mapping[int, RankInfo], unavailable: Optional[Mapping[int, str]] = None, verified: bool = False
) -> Union[DumpPlan, NoCompleteData]:
    """Choose the iteration and the savers of a dying checkpoint.

    A shard (tp_rank, pp_rank, shard_id) is held by ``replica_count`` ranks (one per
    optimizer instance). Picks the highest k such that every shard of every (tp, pp)
    has a usable holder (alive, answered STOP, no UCE, not in ``unavailable``) whose
    authoritative status is UPDATED at exactly k. UPDATING holders are dirty. With
    ``verified``, a holder that can verify must also be clean at k (see
    :mod:`mindspeed_ha.control.integrity`: finite, and its shard and model digests are
    the trusted ones); the plan then carries the trusted digests.

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
    table = getattr(ranks, "holders", None)  # a RankTable keeps its parts' holders (control/holders.py)
    found = table.grouped() if table is not None and len(table) == len(ranks) else None
    if found is None:
        found = _holders(ranks)
    if isinstance(found, NoCompleteData):
        return found
    holders, n_shards = found
    plan = _at_highest(holders, n_shards, unavailable, verified)
    if plan is not None:
        return plan
    return _choose(holders, n_shards, unavailable, verified)


def _at_highest(holders: Mapping[ShardKey, List[RankInfo]], n_shards: int, unavailable: Mapping[int, str],
                verified: bool) -> Optional[DumpPlan]:
    """The plan at the only iteration that can win, when it does: k = the lowest, over the
    parts, of the highest iteration of a usable holder of that part (a higher k misses
    that part). One pass over the holders, no sort of the ranks. None when some part has
    no usable holder at k (or no trustworthy one, ``verified``): :func:`_choose` then
    tries every candidate, as :func:`select_by_scan` does."""
    updated, uce = OptimizerStatus.UPDATED, FaultKind.UCE
    use: Dict[ShardKey, List[RankInfo]] = {}
    k = lowest = highest = None
    for key, hs in holders.items():
        u = [h for h in hs if h.alive and h.stopped and h.status is updated and h.fault is not uce
             and h.rank not in unavailable]
        if not u:
            return None
        its = [h.iteration for h in u]
        top, bottom = max(its), min(its)
        if k is None or top < k:
            k = top
        if lowest is None or bottom < lowest:
            lowest = bottom
        if highest is None or top > highest:
            highest = top
        use[key] = u
    if k is None:
        return None
    if lowest == highest:  # every usable holder is at k (the usual case): nothing to filter
        at_k = use
    else:
        at_k = {key: [h for h in u if h.iteration == k] for key, u in use.items()}
        if not all(at_k.values()):
            return None
    if not verified:
        return _plan(k, at_k, n_shards)
    verdict = integrity.screen(k, at_k)
    clean = {key: [h for h in hs if verdict.eligible(h)] for key, hs in at_k.items()}
    if all(clean.values()):
        return _plan(k, clean, n_shards, verdict)
    return None


def select_by_scan(
    ranks: Mapping[int, RankInfo], unavailable: Optional[Mapping[int, str]] = None, verified: bool = False
) -> Union[DumpPlan, NoCompleteData]:
    """:func:`select_dying_checkpoint` as it was before the holder table: the ranks grouped
    by part again at each call, every candidate iteration tried. Kept as the reference the
    tests compare the table's selection with (tests/test_holders.py); same arguments, same
    result, same rule (stated by :func:`select_dying_checkpoint`).

    Args:
        ranks: rank -> RankInfo of every registered rank.
        unavailable: rank -> reason for ranks to exclude (e.g. heartbeat silence).
        verified: apply the integrity rule (after the VERIFY round).

    Returns:
        DumpPlan, or NoCompleteData whose reason names a missing shard and its holders.
    """
    unavailable = dict(unavailable or {})
    found = _holders(ranks)
    if isinstance(found, NoCompleteData):
        return found
    holders, n_shards = found
    return _choose(holders, n_shards, unavailable, verified)


def _choose(holders: Mapping[ShardKey, List[RankInfo]], n_shards: int, unavailable: Mapping[int, str],
            verified: bool) -> Union[DumpPlan, NoCompleteData]:
    """Every candidate iteration, highest first (the rule of :func:`select_dying_checkpoint`)."""
    use = {k: [h for h in hs if usable(h, unavailable)] for k, hs in holders.items()}
    candidates = sorted({h.iteration for hs in use.values() for h in hs}, reverse=True)
    first_failure: Optional[str] = None
    for k in candidates:
        at_k = {key: [h for h in hs if h.iteration == k] for key, hs in use.items()}
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
    return _missing(holders, use, candidates, unavailable)


def _holders(ranks: Mapping[int, RankInfo]) -> Union[Tuple[Dict[ShardKey, List[RankInfo]], int], NoCompleteData]:
    """Every shard key of the one layout the ranks registered -> its holders; shards per (tp, pp)."""
    if not ranks:
        return NoCompleteData("no rank registered")
    layouts = {(i.layout.tp_size, i.layout.pp_size, i.layout.shards_per_instance) for i in ranks.values()}
    if len(layouts) != 1:
        return NoCompleteData(f"ranks registered inconsistent layouts (tp, pp, shards): {sorted(layouts)}")
    tp_size, pp_size, n_shards = layouts.pop()
    holders: Dict[ShardKey, List[RankInfo]] = {
        (t, p, s): [] for t in range(tp_size) for p in range(pp_size) for s in range(n_shards)}
    for info in ranks.values():
        key = info.layout.shard_key
        if key not in holders:
            return NoCompleteData(f"rank {info.rank} reports shard {key} outside the layout")
        holders[key].append(info)
    return holders, n_shards


def _missing(holders: Mapping[ShardKey, List[RankInfo]], use: Mapping[ShardKey, List[RankInfo]],
             candidates: List[int], unavailable: Mapping[int, str]) -> NoCompleteData:
    """For the best candidate iteration, name the first missing shard and its holders."""
    keys = list(holders)
    if not candidates:
        key = keys[0]
        why = "no healthy, stopped rank is in state UPDATED"
    else:
        k = candidates[0]
        key = next(key for key in keys if not any(h.iteration == k for h in use[key]))
        why = f"at iteration {k}"
    states = "; ".join(holder_state(h, unavailable) for h in sorted(holders[key], key=lambda h: h.rank))
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
        states.append(verdict.suspect[h.rank] if h.rank in screened else holder_state(h, unavailable))
    return (f"no complete data: shard (tp={key[0]}, pp={key[1]}, shard={key[2]}) has no trustworthy copy at "
            f"iteration {k}{''.join(f'; {g}' for g in groups if g)} (holders: {'; '.join(states)})")


def _plan(k: int, at_k: Dict[ShardKey, List[RankInfo]], n_shards: int,
          verdict: Optional["integrity.Verdict"] = None) -> DumpPlan:
    """The savers of iteration ``k`` (see :func:`select_dying_checkpoint`)."""
    coverage: Dict[int, int] = {}
    for hs in at_k.values():
        for inst in {h.layout.instance_id for h in hs}:
            coverage[inst] = coverage.get(inst, 0) + 1
    order = sorted(coverage, key=lambda inst: (-coverage[inst], inst))
    rank_of_inst = {inst: i for i, inst in enumerate(order)}
    shard_savers: Dict[ShardKey, int] = {}
    for key, hs in sorted(at_k.items()):  # the holder of the most preferred instance, then the lowest rank
        best = (len(order), 0)
        for h in hs:
            pref = (rank_of_inst[h.layout.instance_id], h.rank)
            if pref < best:
                best = pref
        shard_savers[key] = best[1]
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
        f"{len(shard_savers)} shards saved by ranks {summarise_ranks(used)} (instances preferred: {order}){checked}",
        shard_digests={key: trusted[("shard", key)] for key in shard_savers if ("shard", key) in trusted},
        model_digests={mk: trusted[("model", mk)] for mk in model_keys if ("model", mk) in trusted},
    )


__all__ = ["DumpOrder", "DumpPlan", "ModelKey", "NoCompleteData", "ShardKey", "holder_state",
           "select_by_scan", "select_dying_checkpoint", "usable"]
