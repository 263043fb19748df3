"""Fault schedules: many faults for one run, as a ``MINDSPEED_HA_INJECT`` value.

A soak run meets a fault of a mixed kind in iteration after iteration; a test that covers
several cases launches one job with a schedule instead of one job per case. Each fault
is a :class:`mindspeed_ha.faultspec.FaultSpec`; :func:`inject_value` joins them with ``;``.

:func:`random_schedule` draws a seeded schedule: at most one fault per iteration, in
iterations ``first .. first + count - 1``, each kind from :data:`KINDS` that the layout and
the run's features allow, on a random rank, and for a restarted rank (ARF) the spec
carries the incarnation the process will have then (``MINDSPEED_HA_INCARNATION``: 0 at
start, +1 per restart), so a spec fires in the process it was meant for.
"""

from __future__ import annotations

import random
from typing import Dict, List, Sequence

from mindspeed_ha.faultspec import FaultSpec

#: kind -> the (point, fault, what) a schedule may draw for it
KINDS: Dict[str, Sequence[tuple]] = {
    "uce": (("forward", "uce", "param"), ("backward", "uce", "exp_avg"), ("backward", "uce", "main_param"),
            ("optimizer", "uce", "exp_avg"), ("optimizer", "uce", "main_param"), ("optimizer", "uce", "exp_avg_sq")),
    "network": (("grad_sync", "network", ""), ("pp", "network", ""), ("tp", "network", "")),
    "kill": (("forward", "kill", ""), ("backward", "kill", ""), ("optimizer", "kill", "")),
    "hang": (("forward", "stop", ""), ("backward", "stop", "")),
}


def random_schedule(seed: int, count: int, world: int, *, tp: int = 1, pp: int = 1, first: int = 2,
                    weights: Dict[str, int]) -> List[FaultSpec]:
    """``count`` faults, one per iteration from ``first``, drawn with ``random.Random(seed)``.

    Args:
        world: ranks in the job (faults land on ranks ``0 .. world-1``).
        tp, pp: the layout: a ``tp`` network fault needs ``tp > 1``, a ``pp`` one ``pp > 1``.
        weights: kind -> relative weight (kinds of :data:`KINDS`; 0 or absent: never).
            ``kill`` and ``hang`` need ``--enable-worker-reboot`` in the run, ``uce``
            ``--enable-hbmfault-repair``.

    Raises:
        ValueError: an unknown kind, no kind with a weight > 0, ``count < 1``, ``world < 1``.
    """
    unknown = set(weights) - set(KINDS)
    if unknown:
        raise ValueError(f"random_schedule: unknown kind(s) {sorted(unknown)}; accepted: {sorted(KINDS)}")
    if count < 1 or world < 1:
        raise ValueError(f"random_schedule: count and world must be >= 1 (got {count}, {world})")
    kinds = [k for k in KINDS if weights.get(k, 0) > 0]
    if not kinds:
        raise ValueError("random_schedule: no kind has a weight > 0")
    rng = random.Random(seed)
    incarnation = [0] * world
    out = []
    for iteration in range(first, first + count):
        kind = rng.choices(kinds, [weights[k] for k in kinds])[0]
        choices = [c for c in KINDS[kind] if (c[0] != "tp" or tp > 1) and (c[0] != "pp" or pp > 1)]
        point, fault, what = rng.choice(choices)
        rank = rng.randrange(world)
        out.append(FaultSpec(rank=rank, iteration=iteration, point=point, fault=fault, what=what,
                             incarnation=incarnation[rank]))
        if kind in ("kill", "hang"):
            incarnation[rank] += 1  # the launcher restarts that process
    return out


def inject_value(specs: Sequence[FaultSpec]) -> str:
    """The ``MINDSPEED_HA_INJECT`` value of ``specs`` (``;``-joined, parsed back by the launcher)."""
    return ";".join(to_text(s) for s in specs)


def to_text(spec: FaultSpec) -> str:
    """``rank=R,iteration=K,point=P,fault=F[,what=W][,incarnation=N]``."""
    text = f"rank={spec.rank},iteration={spec.iteration},point={spec.point},fault={spec.fault}"
    if spec.what:
        text += f",what={spec.what}"
    if spec.how:
        text += f",how={spec.how}"
    if spec.incarnation:
        text += f",incarnation={spec.incarnation}"
    return text
