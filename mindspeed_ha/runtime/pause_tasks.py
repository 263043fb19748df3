"""The rank's side of the pause tasks: PAUSE_TASK kind -> the function the training thread
runs at its pause point (registered as the processor's ``pause_task`` hook,
``runtime/bootstrap.py``; the control plane's side is :mod:`mindspeed_ha.control.pause_tasks`).

``check``: :func:`mindspeed_ha.runtime.online_check.run_check` (the injector's
``point=check`` counts this process's checks: the first is 1). ``relink``:
:func:`mindspeed_ha.recovery.link_switch.switch_links` (the start-up fallback group kept).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Tuple

from mindspeed_ha.control import wire
from mindspeed_ha.control.policy.pause_task import NOT_RUN

log = logging.getLogger("mindspeed_ha.runtime")

_COUNT: Dict[str, int] = {"check": 0}


def _check(rt, params: Dict[str, Any], budget_s: float) -> Tuple[int, str, Dict[str, Any]]:
    from mindspeed_ha.runtime import online_check

    _COUNT["check"] += 1
    n = _COUNT["check"]
    flip = None
    injector = getattr(rt, "injector", None)
    if injector is not None and injector.armed("check", n) is not None:
        def flip(result, n=n):  # the test double: one bit of this rank's GEMM result
            injector.fire("check", n, result)
    rank = rt.rank if rt is not None else 0
    return online_check.run_check(params, budget_s, rank, getattr(rt, "ctx", None), flip)


def _relink(rt, params: Dict[str, Any], budget_s: float) -> Tuple[int, str, Dict[str, Any]]:
    from mindspeed_ha.recovery import link_switch

    binding = None
    if not params.get("back"):
        binding = {k: str(params[k]) for k in ("addr", "iface", "hca") if params.get(k)}
    exclude = [g for g in (getattr(rt, "fallback_group", None),) if g is not None]
    rank = rt.rank if rt is not None else 0
    return link_switch.switch_links(rank, params.get("ranks") or (), binding, int(params["generation"]),
                                    exclude=exclude, timeout_s=budget_s)


KINDS: Dict[str, Callable[[Any, Dict[str, Any], float], Tuple[int, str, Dict[str, Any]]]] = {
    "check": _check,
    "relink": _relink,
}


def run(rt, task: wire.PauseTask) -> wire.PauseTaskResult:
    """The processor's ``pause_task`` hook (training thread, paused): run ``task.kind`` for
    the runtime ``rt`` (its rank, model and optimizer, injector, fallback group)."""
    fn = KINDS.get(task.kind)
    if fn is None:
        return wire.PauseTaskResult(task.task_id, -1, NOT_RUN, f"not run: unknown pause task {task.kind!r}")
    code, detail, result = fn(rt, dict(task.params), float(task.budget_s))
    return wire.PauseTaskResult(task.task_id, -1, int(code), detail, result)


__all__ = ["KINDS", "run"]
