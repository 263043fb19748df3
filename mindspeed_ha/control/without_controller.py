"""The dying checkpoint without the controller: what the ranks do when it is lost.

Runs on its own thread of each rank; every rank runs the same steps, and each exchange
is a collective over a process group every rank made at start-up
(``Processor.on_controller_lost``):

1. each rank announces where it will pause (its drain limit if a graceful stop was
   under way, else the iteration in progress); K = :func:`policy.agree_pause`; every
   training thread pauses after iteration K (``pause_point``);
2. each rank verifies its state (if it can) and announces status, layout and integrity
   report; every rank runs :func:`policy.plan_without_controller` on the same records
   and gets the same plan;
3. dump, assemble, commit (the handlers the rank registered for those actions), each
   followed by an exchange of the results (a barrier).

Exit codes: 75 committed; 76 nothing complete; 77 a write failed (staging removed by
the savers' exit handler); 78 the ranks could not agree (a rank is gone or silent: no
exchange without every rank), or this rank was waiting for the controller's action on a
fault of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from mindspeed_ha.control.integrity import IntegrityReport
from mindspeed_ha.control.policy import ActionKind, DumpPlan, agree_pause, plan_without_controller
from mindspeed_ha.control.state import Layout, OptimizerStatus, RankInfo
from mindspeed_ha.faults import (
    EXIT_CONTROLLER_LOST,
    EXIT_DYING_CHECKPOINT_SAVED,
    EXIT_FAULT_UNRECOVERABLE,
    EXIT_NO_COMPLETE_DATA,
    describe,
)

#: the processor's logger: every line of the rank's control plane keeps the name operators and tests filter on
log = logging.getLogger("mindspeed_ha.control.processor")

#: all-gather of one JSON-able dict per rank over a process group every rank made at
#: start-up; returns the list in rank order; raises when a rank is gone or silent
Exchange = Callable[[Dict[str, Any]], List[Dict[str, Any]]]


def rank_info(record: Dict[str, Any]) -> RankInfo:
    """A rank's exchanged record as the policy reads it (paused, so stopped and authoritative)."""
    integ = record.get("integrity")
    return RankInfo(rank=int(record["rank"]), layout=Layout(**record["layout"]), stopped=True,
                    status=OptimizerStatus(record["status"]), iteration=int(record["iteration"]),
                    save_dir=record.get("save_dir"), verifies=bool(record.get("verifies")),
                    integrity=None if integ is None else IntegrityReport(**integ))


class WithoutController:
    """One rank's part of the checkpoint without the controller (see the module doc).

    Args:
        rank / layout / save_dir / world_size: the rank's identity, as it registered.
        proto: the rank's :class:`~mindspeed_ha.control.protocol.StepProtocol`.
        actions: the rank's :class:`~mindspeed_ha.control.actions.ActionRunner` (the
            VERIFY, DUMP, ASSEMBLE and COMMIT handlers).
        action_timeout_s: how long the training thread may take to reach the agreed pause.
        end: ``end(code, reason)``: ends the rank (the processor's exit path).
    """

    def __init__(self, rank: int, layout: Layout, save_dir: Optional[str], world_size: int, proto, actions,
                 action_timeout_s: float, end: Callable[[int, str], None]):
        self.rank, self.layout, self.save_dir, self.world_size = rank, layout, save_dir, world_size
        self._proto, self._actions = proto, actions
        self._action_timeout_s = action_timeout_s
        self._end = end
        self.exchange: Optional[Exchange] = None
        #: the last integrity report of this rank's frozen state (the VERIFY handler sends it)
        self.integrity: Optional[IntegrityReport] = None
        self.thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """The controller is lost: run the checkpoint on its own thread, then end the rank."""
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"mindspeed-ha-no-controller-{self.rank}")
        self.thread.start()

    def _run(self) -> None:
        try:
            code, reason = self._checkpoint()
        except Exception as exc:  # noqa: BLE001 - any failure ends the rank with a clear code
            log.exception("rank %d: checkpoint without the controller failed", self.rank)
            code, reason = EXIT_CONTROLLER_LOST, f"controller lost; the ranks could not finish without it: " \
                                                 f"{describe(exc)}"
        self._end(code, reason)

    def _checkpoint(self) -> Tuple[int, str]:
        exchange = self.exchange
        if exchange is None:
            return EXIT_CONTROLLER_LOST, "controller lost (no process group to agree without it)"
        mine, why = self._proto.pause_without_controller()
        if mine is None:
            return EXIT_CONTROLLER_LOST, why
        records = exchange({"rank": self.rank, "pause_at": mine})
        k = agree_pause({int(r["rank"]): int(r["pause_at"]) for r in records})
        if k is None:
            return EXIT_NO_COMPLETE_DATA, "controller lost before any rank started an iteration; nothing written"
        log.warning("rank %d: without the controller: every rank pauses after iteration %d", self.rank, k)
        if not self._proto.pause_after(k, self._action_timeout_s):
            return EXIT_CONTROLLER_LOST, f"controller lost; this rank did not reach iteration {k} within " \
                                         f"{self._action_timeout_s} s"
        records = exchange(self._status_record())
        ranks = {int(r["rank"]): rank_info(r) for r in records}
        save_dir = next((r["save_dir"] for r in records if r.get("save_dir")), None)
        verified = any(info.verifies for info in ranks.values())
        plan = plan_without_controller(ranks, save_dir, self.world_size, verified=verified)
        if not isinstance(plan, DumpPlan):
            return plan
        log.warning("rank %d: without the controller: %s", self.rank, plan.reason)
        params = plan.to_params(save_dir)
        for kind, targets in ((ActionKind.DUMP, plan.savers()), (ActionKind.ASSEMBLE, plan.assemblers.values()),
                              (ActionKind.COMMIT, (plan.committer,))):
            failed = self._step(exchange, kind, targets, params)
            if failed:
                return EXIT_FAULT_UNRECOVERABLE, (f"controller lost; {kind.value} failed on rank {failed[0]['rank']}: "
                                                  f"{failed[0]['detail']}; nothing committed")
        return EXIT_DYING_CHECKPOINT_SAVED, (f"controller lost; the ranks committed the checkpoint of iteration "
                                             f"{plan.iteration} to {save_dir} themselves")

    def _step(self, exchange: Exchange, kind: ActionKind, targets: Iterable[int],
              params: Dict[str, Any]) -> List[Dict[str, Any]]:
        """Run ``kind`` here if this rank is a target, exchange the results; the failed ones."""
        ok, detail = True, "nothing to do"
        if self.rank in set(targets):
            handler = self._actions.handler(kind)
            try:
                ok, detail = handler(dict(params)) if handler else (False, f"no handler for {kind.value}")
            except Exception as exc:  # noqa: BLE001 - a failed step is a result
                log.exception("rank %d: %s without the controller failed", self.rank, kind.value)
                ok, detail = False, describe(exc)
        return [r for r in exchange({"rank": self.rank, "ok": bool(ok), "detail": str(detail)[:500]}) if not r["ok"]]

    def _status_record(self) -> Dict[str, Any]:
        """This rank's paused state for the exchange: status, layout, --save, integrity."""
        verify = self._actions.handler(ActionKind.VERIFY)
        report = None
        if verify is not None:
            self.integrity = None
            ok, detail = verify({})
            report = self.integrity if ok else None
            if not ok:
                log.error("rank %d: verification failed: %s", self.rank, detail)
        st, it = self._proto.status()
        return {"rank": self.rank, "status": st.value, "iteration": it, "save_dir": self.save_dir,
                "layout": dataclasses.asdict(self.layout), "verifies": verify is not None,
                "integrity": None if report is None else dict(dataclasses.asdict(report), detail=report.detail[:300])}
