"""Which copies of the frozen state may be trusted: the pure integrity rule. No torch.

After a fault the controller asks every usable rank that can verify (``RankInfo.verifies``)
for an :class:`IntegrityReport` of its frozen state (ACTION ``verify``): per part, whether
every value is finite and the layout is the expected one (``*_ok``), and a digest of the
bytes (``*_digest``; computed by :func:`mindspeed_ha.checkpoint.integrity.verify_state`, the same function
that re-verifies what a saver wrote). Two parts per rank:

* ``shard``: its optimizer shard (fp32 main params, ``exp_avg``, ``exp_avg_sq``), held by the
  ``replica_count`` ranks of the same (tp, pp, shard_id);
* ``model``: its model parameters, held by every DP rank of the same (tp, pp).

The rule (:func:`screen`), for one iteration k, per group of holders of the same part:

1. a holder whose part is not finite or not of the expected layout is corrupt;
2. among the others, the *trusted* digest is the one held by a strict majority
   (:func:`majority`); a holder with another digest is corrupt. One finite holder is
   trusted alone (nothing to compare it with: a finite bit flip in the only copy left
   cannot be seen). Two finite holders that differ, or any split without a strict
   majority, leave the group with no trustworthy copy;
3. a rank is *clean* when both its parts are finite and equal to the trusted digests of
   their groups. Only clean ranks save anything (a rank found corrupt in one part is
   suspect in all). A rank that can verify but sent no report for k is never clean.

Ranks that cannot verify (test doubles without a model) are screened out of nothing: they
neither vote nor are excluded.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Dict, FrozenSet, Hashable, List, Mapping, Optional, Sequence, Tuple

from mindspeed_ha.control.state import RankInfo

ShardKey = Tuple[int, int, int]  # (tp_rank, pp_rank, shard_id)
ModelKey = Tuple[int, int]  # (tp_rank, pp_rank)
PARTS = ("shard", "model")


@dataclasses.dataclass(frozen=True)
class IntegrityReport:
    """One rank's verification of its frozen state at ``iteration`` (sent in INTEGRITY).

    Attributes:
        iteration: the UPDATED iteration the digests describe.
        shard_ok / model_ok: every value finite and the layout as expected.
        shard_digest / model_digest: hex digest of the part's bytes, shapes and dtypes
            ("" when the rank holds no such part, e.g. no distributed optimizer).
        detail: what was wrong, or a summary.
    """

    iteration: int
    shard_ok: bool
    shard_digest: str
    model_ok: bool
    model_digest: str
    detail: str = ""

    def ok(self, part: str) -> bool:
        return bool(getattr(self, f"{part}_ok"))

    def digest(self, part: str) -> str:
        return str(getattr(self, f"{part}_digest"))


def majority(digests: Sequence[str]) -> Optional[str]:
    """The digest held by more than half of ``digests``; None if empty or no strict majority."""
    if not digests:
        return None
    value, count = collections.Counter(digests).most_common(1)[0]
    return value if 2 * count > len(digests) else None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of :func:`screen` for one iteration.

    Attributes:
        clean: ranks fit to save (verified, both parts finite and trusted).
        suspect: rank -> why it may not save (corrupt, disagreeing, unreported).
        trusted: (part, group key) -> the trusted digest.
        untrusted: (part, group key) -> why the group has no trustworthy copy.
    """

    clean: FrozenSet[int]
    suspect: Dict[int, str]
    trusted: Dict[Tuple[str, Hashable], str]
    untrusted: Dict[Tuple[str, Hashable], str]

    def eligible(self, info: RankInfo) -> bool:
        """May ``info`` save? Ranks that cannot verify are not screened."""
        return not info.verifies or info.rank in self.clean


#: the digest algorithm of this version; every digest is ``"<algorithm>:<hex>"``. Before
#: issue 21 the digest was an untagged blake2b-128 (32 hex digits): such a digest, or one
#: tagged with another algorithm, is refused by a saver (:func:`foreign_digest`; within one
#: job every rank runs one version: the wire's schema version refuses the others)
DIGEST_ALGORITHM = "xxh3-128"


def tag_digest(hexdigest: str) -> str:
    """``hexdigest`` of :data:`DIGEST_ALGORITHM`, tagged with its algorithm."""
    return f"{DIGEST_ALGORITHM}:{hexdigest}"


def foreign_digest(digest: str) -> Optional[str]:
    """None if ``digest`` is empty (no such part) or of :data:`DIGEST_ALGORITHM`, else why
    it cannot be compared: computed by another mindspeed-ha version (untagged: blake2b-128
    of the versions before issue 21; tagged: another algorithm)."""
    if not digest or digest.startswith(DIGEST_ALGORITHM + ":"):
        return None
    algo = digest.split(":", 1)[0] if ":" in digest else "untagged (blake2b-128, mindspeed-ha before issue 21)"
    return (f"digest of algorithm {algo}, not {DIGEST_ALGORITHM}: computed by another mindspeed-ha version, "
            "not comparable (run every rank on one version)")


def short_digest(digest: str) -> str:
    """The first 12 hex digits of ``digest`` (its algorithm tag left out), "-" if empty."""
    return digest.split(":", 1)[-1][:12] if digest else "-"


_short = short_digest


def screen(k: int, at_k: Mapping[ShardKey, Sequence[RankInfo]]) -> Verdict:
    """Apply the rule of this module to the usable holders at iteration ``k``.

    Args:
        k: the candidate iteration.
        at_k: shard key -> the usable holders whose status is UPDATED at ``k``.

    Returns:
        The Verdict; groups are the shard keys and, for the model part, their (tp, pp).
    """
    groups: Dict[Tuple[str, Hashable], List[RankInfo]] = collections.defaultdict(list)
    suspect: Dict[int, str] = {}
    reports: Dict[int, IntegrityReport] = {}
    for key, holders in at_k.items():
        for h in holders:
            if not h.verifies:
                continue
            rep = h.integrity
            if rep is None or rep.iteration != k:
                have = "none" if rep is None else f"iteration {rep.iteration}"
                suspect[h.rank] = f"rank {h.rank} sent no integrity report for iteration {k} (has {have})"
                continue
            reports[h.rank] = rep
            groups[("shard", key)].append(h)
            groups[("model", key[:2])].append(h)
    trusted: Dict[Tuple[str, Hashable], str] = {}
    untrusted: Dict[Tuple[str, Hashable], str] = {}
    for (part, key), holders in groups.items():
        holders = sorted(holders, key=lambda h: h.rank)
        finite = []
        for h in holders:
            rep = reports[h.rank]
            if rep.ok(part):
                finite.append(h)
            else:
                suspect.setdefault(h.rank, f"rank {h.rank} corrupt {part}: {rep.detail or 'not finite'}")
        digest = majority([reports[h.rank].digest(part) for h in finite])
        if digest is None:
            if finite:
                seen = ", ".join(f"rank {h.rank} {_short(reports[h.rank].digest(part))}" for h in finite)
                untrusted[(part, key)] = f"{part} digests disagree with no majority ({seen})"
                for h in finite:
                    suspect.setdefault(h.rank, f"rank {h.rank} {part} digest not confirmed by a majority")
            else:
                untrusted[(part, key)] = f"no finite {part} among {len(holders)} holder(s)"
            continue
        trusted[(part, key)] = digest
        for h in finite:
            got = reports[h.rank].digest(part)
            if got != digest:
                suspect.setdefault(h.rank, f"rank {h.rank} {part} digest {_short(got)} differs from "
                                           f"{_short(digest)} of the majority of {len(finite)} finite holders")
    clean = frozenset(r for r in reports if r not in suspect)
    return Verdict(clean, suspect, trusted, untrusted)


__all__ = ["IntegrityReport", "Verdict", "majority", "screen", "PARTS"]
