"""Hot switch, the ranks' side: the SWITCH action of the paused ranks and the new process's handoff.

The controller (control/switch_desk.py) sends the switch plan once every rank holds after
iteration K (graceful pause) and the new process of each switched rank R is parked at its
rejoin point:

* every rank gets ACTION ``switch`` (:func:`on_switch`, on its action thread: its training
  thread holds in the pause point, touching no group): a rank that stays rebuilds every
  process group with generation ``plan.generation`` (:data:`stages.IN_PLACE` ``"switch"``),
  together with the new process of R, which takes R's place in them; the outgoing R does
  not: it sends its state to its new process over a :class:`~.pair_link.PairLink`
  (parameters, optimizer shard and host state, :func:`transfer.send_state`; the progress:
  counters, scheduler, RNG at the entry of K+1, :func:`handover.at_pause`;
  :func:`stages.send_handoff`) and answers;
  the controller then ends it with EXIT 0.
* the new process gets RETRY(plan mode ``switch``) at its rejoin point
  (:data:`stages.REJOINING` ``"switch"``): the rebuild with the others, then
  :func:`stages.receive_handoff` from the outgoing process; its training loop starts at K+1 like a
  rejoined process's.

The handoff needs no replica (``--distributed-optimizer-no-replica`` included): the state
comes from the rank itself. Where the outgoing process dies in the middle of it and a
replica holder of its state lives, the controller sends a second plan (mode
``switch_repair``, the replica fallback; the groups stay as rebuilt): ACTION ``switch`` to
the staying ranks (:data:`stages.IN_PLACE` ``"switch_repair"``: each holder sends the state
and the progress at the pause) and RETRY to the new process, parked again at its rejoin
point after its failed handoff (:data:`stages.REJOINING` ``"switch_repair"``: it receives
them as a restarted process does in ARF's rejoin).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, Tuple

log = logging.getLogger("mindspeed_ha.runtime")

#: the plan modes of ACTION ``switch``: the switch's own, its replica fallback's
SWITCH_MODES = ("switch", "switch_repair")


def on_switch(rt, params: Dict[str, Any]) -> Tuple[bool, str]:
    """ACTION ``switch`` (action thread of a paused rank): rebuild with the new processes
    (:data:`stages.IN_PLACE` ``"switch"``), or, on a switched rank, hand its state over
    (:data:`stages.SWITCH_OUT`); the replica fallback's plan: :data:`stages.IN_PLACE`
    ``"switch_repair"``; see the module doc.

    Returns:
        (True, JSON of the seconds per stage): the result the controller waits for.

    Raises:
        ValueError: the plan's mode is not one of :data:`SWITCH_MODES`.
        Whatever a stage raised (the action thread answers it as a failed result).
    """
    from mindspeed_ha.control.recovery_plan import RecoveryPlan
    from mindspeed_ha.recovery import stages
    from mindspeed_ha.recovery.executor import run_stages

    plan = RecoveryPlan.from_params(params)
    if plan.mode not in SWITCH_MODES:
        raise ValueError(f"rank {rt.rank}: ACTION switch with a {plan.mode} plan (expected one of {SWITCH_MODES})")
    ctx = rt.ctx
    c = stages.RecoveryContext(rt, plan, model=ctx.model if ctx is not None else None,
                               optimizer=ctx.optimizer if ctx is not None else None)
    outgoing = rt.rank in plan.rejoin
    times = run_stages(stages.SWITCH_OUT if outgoing else stages.IN_PLACE[plan.mode], c, rt.events)
    log.warning("rank %d: hot switch of ranks %s at iteration %d: %s %s", rt.rank, list(plan.rejoin),
                plan.iteration, "handed over" if outgoing else "groups rebuilt" if plan.mode == "switch" else
                "replica fallback", times)
    return True, json.dumps(dict(times, rank=rt.rank, outgoing=outgoing, generation=plan.generation),
                            sort_keys=True)


__all__ = ["SWITCH_MODES", "on_switch"]
