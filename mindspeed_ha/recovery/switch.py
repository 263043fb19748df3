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
comes from the rank itself.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, Tuple

log = logging.getLogger("mindspeed_ha.runtime")


def on_switch(rt, params: Dict[str, Any]) -> Tuple[bool, str]:
    """ACTION ``switch`` (action thread of a paused rank): rebuild with the new processes
    (:data:`stages.IN_PLACE` ``"switch"``), or, on a switched rank, hand its state over
    (:data:`stages.SWITCH_OUT`); see the module doc.

    Returns:
        (True, JSON of the seconds per stage): the result the controller waits for.

    Raises:
        Whatever a stage raised (the action thread answers it as a failed result).
    """
    from mindspeed_ha.control.recovery_plan import RecoveryPlan
    from mindspeed_ha.recovery import stages
    from mindspeed_ha.recovery.executor import run_stages

    plan = RecoveryPlan.from_params(params)
    ctx = rt.ctx
    c = stages.RecoveryContext(rt, plan, model=ctx.model if ctx is not None else None,
                               optimizer=ctx.optimizer if ctx is not None else None)
    outgoing = rt.rank in plan.rejoin
    times = run_stages(stages.SWITCH_OUT if outgoing else stages.IN_PLACE["switch"], c, rt.events)
    log.warning("rank %d: hot switch of ranks %s at iteration %d: %s %s", rt.rank, list(plan.rejoin),
                plan.iteration, "handed over" if outgoing else "groups rebuilt", times)
    return True, json.dumps(dict(times, rank=rt.rank, outgoing=outgoing, generation=plan.generation),
                            sort_keys=True)


__all__ = ["on_switch"]
