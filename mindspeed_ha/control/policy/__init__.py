"""Pure decision functions of the controller. No I/O, no clocks, no torch.

:func:`decide` maps ``(now, ClusterState, HAConfig)`` to one :class:`Decision` (an
action, its typed plan, its targets, the next job phase and a human-readable reason;
``Decision.params`` is the plan's wire form). The controller thread applies it; tests
call it directly with a chosen ``now``. ``decide`` is a table phase -> function
(:data:`~.table.PHASES`); one module per decision family:

=========================  ==========================================================
module                     decides
=========================  ==========================================================
:mod:`.table`              ``decide``: the phase -> function table
:mod:`.detect`             RUNNING: gone ranks, the first fault, which path it takes
:mod:`.recovering`         RECOVERING: the in-place / ARF rounds (observe, abort, RETRY)
:mod:`.in_place`           ``plan_recovery``: the in-place plan (UCE, network)
:mod:`.arf`                worker restart (ARF): when, and the rejoin plan
:mod:`.recovery`           RecoveryPlan, RecoveryMode, NoRecovery and the shared rules
:mod:`.drain`              DRAINING: the graceful stop, ``agree_pause``, the deadline
:mod:`.pause`              PAUSING / PAUSED: the operator's graceful pause, resume, ``--max``
:mod:`.save`               STOPPING .. EXITING: the dying checkpoint's phases
:mod:`.dying`              ``select_dying_checkpoint``: DumpPlan / NoCompleteData
:mod:`.without_controller` ``plan_without_controller``: the ranks' own dying checkpoint
:mod:`.decision`           ActionKind, Decision and the typed plans of each action
=========================  ==========================================================

Phases and what moves them (see ``state.Phase``)::

    RUNNING     a fault (rank dead: agent report, disconnect, GOODBYE != 0, heartbeat
                silence > heartbeat_timeout_s; or a FAULT report)      -> STOP_ALL, STOPPING
                (in place or ARF: RECOVERING, below)
                every rank said GOODBYE(0)                              -> NOOP, DONE
                a graceful stop was requested (SIGTERM/SIGINT to the launcher or a rank)
                                                                        -> DRAIN(-1), DRAINING
                the operator asked for a graceful pause                 -> PAUSE(-1), PAUSING
    PAUSING     (see :mod:`.pause`) the graceful stop's two rounds with ``hold``; every rank
    PAUSED      paused after K -> PAUSED; resume or ``--max`` -> RELEASE, RUNNING; a stop
                -> DRAINING (the ranks hold at K already); a fault -> STOP_ALL, STOPPING
    DRAINING    (graceful stop, see :mod:`.drain`) round 1: every rank says after which
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

In-place recovery (UCE repair, network retry; see :mod:`.recovery`) and worker restart
(ARF, ``--enable-worker-reboot``; see :mod:`.arf`)::

    RUNNING     a UCE (--enable-hbmfault-repair) or network fault (--ha-network-retries > 0)
                reported by a live rank, or a process fault whose gone ranks are all being
                restarted by their agents (ARF)
                                                         -> STOP_ALL (observe), RECOVERING
    RECOVERING  every rank STOPPED, all UPDATED at one iteration, or all inside one update
                with every unfinished rank faulty (or update_settle_s)
                                                         -> STOP_ALL(recover): abort every step;
                every rank parked in its fault handler (a restarted one at its rejoin point)
                                                         -> plan_recovery: RETRY(plan) to all;
                every RETRY result ok                    -> RESUME (no message), RUNNING;
                no plan, a failure, a lost rank, a new fault, a timeout, a restarted rank
                not back within action_timeout_s
                                                         -> STOP_ALL(recover), STOPPING (dying checkpoint)
"""

from mindspeed_ha.control.policy.arf import parked_to_rejoin, plan_rejoin, worker_restart
from mindspeed_ha.control.policy.decision import (ActionKind, ActionPlan, Decision, DrainPlan, ExitPlan, StopPlan,
                                                  VerifyPlan)
from mindspeed_ha.control.policy.detect import detect_fault, gone_ranks
from mindspeed_ha.control.policy.drain import agree_pause, drain_budget_s
from mindspeed_ha.control.policy.dying import (DumpOrder, DumpPlan, ModelKey, NoCompleteData, ShardKey,
                                               select_dying_checkpoint)
from mindspeed_ha.control.policy.in_place import plan_recovery
from mindspeed_ha.control.policy.recovery import NoRecovery, RecoveryMode, RecoveryPlan
from mindspeed_ha.control.policy.save import update_settle_s
from mindspeed_ha.control.policy.table import PHASES, decide
from mindspeed_ha.control.policy.without_controller import plan_without_controller

__all__ = [
    "ActionKind", "ActionPlan", "Decision", "DrainPlan", "DumpOrder", "DumpPlan", "ExitPlan", "ModelKey",
    "NoCompleteData", "NoRecovery", "PHASES", "RecoveryMode", "RecoveryPlan", "ShardKey", "StopPlan", "VerifyPlan",
    "agree_pause", "decide", "detect_fault", "drain_budget_s", "gone_ranks", "parked_to_rejoin",
    "plan_recovery", "plan_rejoin", "plan_without_controller", "select_dying_checkpoint", "update_settle_s",
    "worker_restart",
]
