"""The verdicts of the pause tasks (``mindspeed-ha check | relink``): pure functions of the
ranks' results. No I/O, no clock: :mod:`mindspeed_ha.control.pause_tasks` calls them once
every rank answered or the budget passed.

Result codes (the reference's stress test, MindIO TFT ``stress_detect``: 0 ok, 1 not run ->
resume, 2 fault, 3/4 -> restart; here 3 is "timeout: budget exceeded"). A job-wide code
is the worst of the ranks under test, in the order 2 > 3 > 1 > 0.

The online check's silent-data-corruption screen: every rank multiplies the same seeded
matrices, so the DP replicas of one (tp, pp, cp) position -- same model shard, same kind of
device -- must produce bitwise equal products. Within each such group the digest held by
most members is the reference; a tie (two replicas, two digests) is broken by the count of
each digest over the whole job (every rank ran the same inputs); a tie there too names
every member of the group. Speed: each rank's GEMM seconds against the median of all ranks
that ran it; slower than ``slow_factor`` times the median is reported (``slow``), not a fault.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

OK, NOT_RUN, FAULT, TIMEOUT = 0, 1, 2, 3
#: worst first
SEVERITY = (FAULT, TIMEOUT, NOT_RUN, OK)
CODE_NAMES = {OK: "ok", NOT_RUN: "not run", FAULT: "fault", TIMEOUT: "timeout"}
CHECK_TESTS = ("gemm", "memory", "p2p", "allreduce")
#: a rank whose GEMM takes longer than this many times the median is reported slow
SLOW_FACTOR = 2.0


def worst(codes: Iterable[int]) -> int:
    """The worst code of ``codes`` (2 > 3 > 1 > 0); 1 (not run) when there is none."""
    seen = set(codes)
    for c in SEVERITY:
        if c in seen:
            return c
    return NOT_RUN


@dataclasses.dataclass
class Verdict:
    """A pause task's outcome: ``code`` and a line for the operator; ``ranks``: per rank its
    code, reasons and details (the operator reply's and ``--json``'s ``result.ranks``)."""

    code: int
    detail: str
    ranks: Dict[int, Dict[str, Any]]

    @property
    def faulty(self) -> List[int]:
        return sorted(r for r, v in self.ranks.items() if v["code"] == FAULT)

    def to_result(self) -> Dict[str, Any]:
        return {"code": self.code, "faulty": self.faulty,
                "ranks": {str(r): v for r, v in sorted(self.ranks.items())}}


def _position(layout: Any) -> Tuple[int, int, int]:
    return (int(getattr(layout, "tp_rank", 0)), int(getattr(layout, "pp_rank", 0)), int(getattr(layout, "cp_rank", 0)))


def odd_gemm_ranks(digests: Mapping[int, str], layouts: Mapping[int, Any]) -> Dict[int, str]:
    """rank -> why, for each rank whose GEMM digest differs from its DP replicas' reference
    (see the module doc)."""
    job = collections.Counter(digests.values())
    groups: Dict[Tuple[int, int, int], List[int]] = collections.defaultdict(list)
    for r in digests:
        groups[_position(layouts.get(r))].append(r)
    odd: Dict[int, str] = {}
    for pos, members in groups.items():
        counts = collections.Counter(digests[r] for r in members)
        if len(counts) <= 1:
            continue
        ranked = sorted(counts, key=lambda d: (counts[d], job[d]), reverse=True)
        best, second = ranked[0], ranked[1]
        if (counts[best], job[best]) == (counts[second], job[second]):
            for r in members:
                odd[r] = (f"GEMM result differs among the DP replicas of (tp, pp, cp) {pos}; no majority "
                          f"names the corrupt one")
            continue
        for r in members:
            if digests[r] != best:
                others = sorted(m for m in members if digests[m] == best)
                odd[r] = f"GEMM result differs bitwise from its DP replicas {others} (tp, pp, cp) {pos}"
    return odd


def check_verdict(results: Mapping[int, Tuple[int, str, Mapping[str, Any]]], layouts: Mapping[int, Any],
                  under_test: Sequence[int], missing: Iterable[int] = (),
                  slow_factor: float = SLOW_FACTOR) -> Verdict:
    """The online check's verdict.

    Args:
        results: rank -> (its own code, detail, result dict with ``tests`` -> name -> dict;
            ``gemm`` carries ``digest`` and ``seconds``). Every rank that ran (references).
        layouts: rank -> Layout (tp_rank, pp_rank, cp_rank), for the replica groups.
        under_test: the ranks the operator named; only they can be named faulty.
        missing: ranks that sent no result before the budget passed (timeout).
        slow_factor: GEMM seconds over this many times the median: ``slow`` (reported).
    """
    digests, seconds = {}, {}
    for r, (_, _, res) in results.items():
        gemm = (res.get("tests") or {}).get("gemm") or {}  # product_seconds: one product (the speed compared)
        if gemm.get("code") == OK and gemm.get("digest"):
            digests[r] = str(gemm["digest"])
            seconds[r] = float(gemm.get("product_seconds", gemm.get("seconds", 0.0)))
    odd = odd_gemm_ranks(digests, layouts)
    median = statistics.median(seconds.values()) if seconds else 0.0
    ranks: Dict[int, Dict[str, Any]] = {}
    gone = set(missing)
    for r in sorted(set(under_test)):
        if r in gone or r not in results:
            ranks[r] = {"code": TIMEOUT if r in gone else NOT_RUN,
                        "reasons": ["no result within the budget" if r in gone else "no result"], "tests": {}}
            continue
        code, detail, res = results[r]
        reasons = [detail] if detail else []
        codes = [int(code)]
        if r in odd:
            codes.append(FAULT)
            reasons.append(odd[r])
        row: Dict[str, Any] = {"tests": dict(res.get("tests") or {})}
        for key in ("state_unchanged", "device", "seconds"):
            if key in res:
                row[key] = res[key]
        if r in seconds and median > 0:
            row["gemm_vs_median"] = round(seconds[r] / median, 3)
            row["slow"] = seconds[r] > slow_factor * median
            if row["slow"]:
                reasons.append(f"GEMM {seconds[r] / median:.2f}x the median of {len(seconds)} ranks (slow)")
        row["code"], row["reasons"] = worst(codes), reasons
        ranks[r] = row
    code = worst(v["code"] for v in ranks.values()) if ranks else NOT_RUN
    bad = [r for r, v in ranks.items() if v["code"] == code] if code != OK else []
    detail = f"check {CODE_NAMES[code]}" + (f" on ranks {bad}" if bad else f" on {len(ranks)} ranks")
    why = [f"rank {r}: {'; '.join(ranks[r]['reasons'])}" for r in bad if ranks[r]["reasons"]]
    return Verdict(code, detail + (": " + " | ".join(why) if why else ""), ranks)


def relink_verdict(results: Mapping[int, Tuple[int, str, Mapping[str, Any]]], targets: Sequence[int],
                   world: Sequence[int], missing: Iterable[int] = ()) -> Verdict:
    """The relink's verdict: every rank rebuilt its groups (0); a rank failed (2; the ranks
    switched back by themselves: ``switched_back`` in its result); no answer (3)."""
    gone = set(missing)
    ranks: Dict[int, Dict[str, Any]] = {}
    for r in world:
        if r in gone or r not in results:
            ranks[r] = {"code": TIMEOUT if r in gone else NOT_RUN, "reasons": ["no result"]}
            continue
        code, detail, res = results[r]
        ranks[r] = {"code": int(code), "reasons": [detail] if detail else [], **dict(res)}
    code = worst(v["code"] for v in ranks.values()) if ranks else NOT_RUN
    back = sorted(r for r, v in ranks.items() if v.get("switched_back"))
    bound = {r: ranks[r].get("bound") for r in targets if r in ranks}
    if code == OK:
        detail = "relink done: " + ", ".join(f"rank {r} bound to {b or 'its original address'}"
                                             for r, b in sorted(bound.items()))
    else:
        bad = sorted(r for r, v in ranks.items() if v["code"] == code)
        reasons = "; ".join(f"rank {r}: {' '.join(ranks[r]['reasons'])}" for r in bad[:4])
        detail = (f"relink {CODE_NAMES[code]} on ranks {bad}: {reasons}"
                  + (f"; switched back by itself on ranks {back}" if back else ""))
    return Verdict(code, detail, ranks)


__all__ = ["CHECK_TESTS", "CODE_NAMES", "FAULT", "NOT_RUN", "OK", "SLOW_FACTOR", "TIMEOUT", "Verdict",
           "check_verdict", "odd_gemm_ranks", "relink_verdict", "worst"]
