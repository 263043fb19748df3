"""The launcher's agent-side state and the two torchrun patches it needs.

* ``SubprocessContext._poll`` (:func:`poll_lets_survivors_finish`): when a worker fails,
  torchrun's agent would stop every other worker at once; instead the failure is told to
  the controller and the survivors get up to ``MINDSPEED_HA_DYING_GRACE_S`` seconds to write
  the dying checkpoint and exit by themselves. Every poll also supervises: it SIGKILLs the
  workers the controller gave up on for silence and, past the preemption deadline, the
  workers still running.
* ``_terminate_process_handler`` (:func:`on_termination_signal`): the first SIGTERM or
  SIGINT starts a graceful stop (the controller's, or the local workers' on a node without
  it) instead of torchrun's kill; the next one torchrun's shutdown; any later one SIGKILLs
  every descendant at once (installed without the HA flag too, :func:`install_signals`).

Both patches read the one :class:`Survivors` that :func:`install` made current; they are
installed once per process (``mindspeed-ha-run`` only, never in a worker).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from typing import Dict, List, Optional, Set, Tuple

import wrapt

log = logging.getLogger("mindspeed_ha.launcher")

#: seconds after the preemption deadline before the launcher SIGKILLs the workers left
#: (the controller's EXIT(77) at the deadline normally ends them first)
PREEMPT_KILL_MARGIN_S = 5.0
#: seconds workers get to exit by themselves once the controller is DONE (they said goodbye)
EXIT_MARGIN_S = 5.0


class Survivors:
    """State of the agent-side patch: which failures were reported, since when; and the
    hooks of :class:`mindspeed_ha.agent.WorkerRebootAgent` (``RestartHooks``) for
    ``--enable-worker-reboot``.

    Args:
        controller: the controller running in this launcher, or None (it runs elsewhere).
        grace_s: seconds the survivors of a failure get to finish by themselves.
        preemption_deadline_s: ``--ha-preemption-deadline``, seconds.
        link: the agent's link to the controller on a node without it
            (``--enable-worker-reboot``), else None.
    """

    def __init__(self, controller, grace_s: float, preemption_deadline_s: float = 20.0, link=None):
        self.controller = controller
        self.link = link
        #: global rank -> incarnation its first process of this launcher starts as (AGENT_WELCOME)
        self.first_incarnations: Dict[int, int] = {}
        self.grace_s = grace_s
        self.first_failure: Optional[float] = None
        self.reported: Dict[int, int] = {}
        self.killed: Set[int] = set()  # pids of workers ended for silence
        self.preemption_deadline_s = preemption_deadline_s
        self.pcontext = None  # torchrun's SubprocessContext, once workers run
        self.stop_at: Optional[float] = None  # graceful stop: when the signal came
        self.stop_signal: Optional[int] = None
        self.stop_killed = False  # the preemption backstop SIGKILLed workers
        self.done_at: Optional[float] = None  # when the controller was first seen DONE
        self.lease = None  # the job's LeaseDir (controller failover), or None
        self.relink = None  # () -> an AgentLink to the leader (controller failover)
        self.old_links: List = []  # links replaced by an in-process controller, closed at the end
        self.retired = None  # this launcher's controller once it stepped down

    # --enable-worker-reboot: the hooks of mindspeed_ha.agent.WorkerRebootAgent (RestartHooks)
    def restart_refused(self, rank: int, exitcode: int) -> Optional[str]:
        """None if ``rank`` may be restarted: no graceful stop under way, and the controller
        has not begun a verdict on the job (see ``Controller.restart_refused``)."""
        if self.stop_at is not None:
            return "a graceful stop (signal to the launcher) is under way"
        controller, link = self.controller, self.link  # a standby may swap them (its thread)
        if controller is not None:
            return controller.restart_refused(rank)
        if link is not None:
            return link.restart_refused(rank, exitcode)
        return None

    def restarted(self, rank: int, incarnation: int, pid: int, exitcode: int) -> None:
        controller, link = self.controller, self.link
        if controller is not None:
            controller.report_rank_restart(rank, incarnation, pid, exitcode)
        elif link is not None:
            link.report_rank_restart(rank, incarnation, pid, exitcode)

    def supervise(self, pcontext) -> None:
        supervise(pcontext, self)

    def spare_changed(self, pid: Optional[int]) -> None:
        """This node's warm spare (``mindspeed-ha status`` lists it; a hot switch of this
        node's ranks needs it): to the controller in process, or over the agent link."""
        controller, link = self.controller, self.link
        if controller is not None:
            controller.spares = [] if pid is None else [{"host": socket.gethostname(), "pid": int(pid)}]
        elif link is not None:
            link.report_spare(pid)

    def switch_wanted(self) -> Dict[int, str]:
        """Hot switch: what this launcher's agent does per rank (the controller's switch desk
        in process, or the last SWITCH_VIEW over the agent link)."""
        controller, link = self.controller, self.link
        if controller is not None:
            return controller.operators.switches.agent_wanted()
        return link.switch_view() if link is not None else {}

    def switch_report(self, what: str, rank: int, value) -> None:
        controller, link = self.controller, self.link
        if controller is not None:
            controller.operators.switches.agent_report(what, rank, value)
        elif link is not None:
            link.report_switch(what, rank, value)

    def abandoned(self, rank: int, why: str) -> None:
        controller, link = self.controller, self.link
        if controller is not None:
            controller.report_restart_abandoned(rank, why)
        elif link is not None:
            link.report_restart_abandoned(rank, why)

    def first_incarnation(self, rank: int) -> int:
        return self.first_incarnations.get(rank, 0)

    def skip_exit_barrier(self) -> Optional[str]:
        if self.lease is not None:
            return ("controller failover is on: torchrun's store (node 0's agent) may be gone; the controller "
                    "saw every worker end")
        return None

    def report_exit(self, rank: int, code: int) -> None:
        """Tell the controller (in process or over the link) that ``rank`` exited with ``code``."""
        controller, link = self.controller, self.link
        if controller is not None:
            controller.report_rank_exit(rank, code)
        elif link is not None:
            link.report_rank_exit(rank, code)


_current: Optional[Survivors] = None
_installed = False
_signals_installed = False
#: the signal that began torchrun's shutdown (SignalException raised), or None
shutdown_signal: Optional[int] = None


def install(state: Survivors) -> None:
    """Make ``state`` the one the torchrun patches act on, patching torchrun's
    ``SubprocessContext._poll`` (and ``_terminate_process_handler``, :func:`install_signals`)
    on the first call."""
    global _current, _installed
    _current = state
    install_signals()
    if _installed:
        return
    wrapt.wrap_function_wrapper("torch.distributed.elastic.multiprocessing.api", "SubprocessContext._poll",
                                poll_lets_survivors_finish)
    _installed = True


def install_signals() -> None:
    """Patch torchrun's ``_terminate_process_handler`` (once) and make it this process's
    SIGTERM / SIGINT handler now, so a signal before the workers start (torchrun registers
    its handler only when it starts them) ends the launcher the same way."""
    global _signals_installed
    if not _signals_installed:
        wrapt.wrap_function_wrapper("torch.distributed.elastic.multiprocessing.api", "_terminate_process_handler",
                                    on_termination_signal)
        _signals_installed = True
    import torch.distributed.elastic.multiprocessing.api as mp_api

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, mp_api._terminate_process_handler)


def signalled() -> bool:
    """Whether SIGTERM / SIGINT reached this launcher (a graceful stop or torchrun's shutdown)."""
    return shutdown_signal is not None or (_current is not None and _current.stop_at is not None)


def say(text: str) -> None:
    """One line to stderr without logging's locks (safe in a signal handler)."""
    try:
        os.write(2, f"mindspeed-ha-run: {text}\n".encode())
    except OSError:
        pass


def on_termination_signal(wrapped, instance, args, kwargs):
    """torchrun's handler for SIGTERM/SIGINT/SIGHUP/SIGQUIT, which raises ``SignalException``
    (its shutdown: SIGTERM to every worker, SIGKILL ``shutdown_timeout`` (30 s) later).

    * The first SIGTERM or SIGINT once workers run, with the HA flag, starts a graceful stop
      instead and returns.
    * Otherwise the first signal (or the second, after a graceful stop began) goes to
      torchrun: its shutdown.
    * Any signal once torchrun's shutdown began ends every descendant at once (SIGKILL,
      :func:`mindspeed_ha.launch.proctree.end_tree`) and returns: raised again, it would
      break off torchrun's shutdown between its SIGTERM and its SIGKILL and leave the
      workers running when the launcher exits.
    """
    global shutdown_signal
    signum = args[0]
    name = signal.Signals(signum).name
    if shutdown_signal is not None:
        from mindspeed_ha.launch import proctree

        say(f"{name} during the shutdown: SIGKILL to every worker")
        left = proctree.end_tree()
        if left:
            say(f"processes {left} still there after SIGKILL (uninterruptible sleep?)")
        return None
    state = _current
    if (state is None or state.pcontext is None or state.stop_at is not None
            or signum not in (signal.SIGTERM, signal.SIGINT)):
        shutdown_signal = signum
        say(f"{name}: stopping every worker (torchrun's shutdown: SIGTERM, SIGKILL after its shutdown timeout; "
            "another signal: SIGKILL now)")
        return wrapped(*args, **kwargs)
    state.stop_at, state.stop_signal = time.monotonic(), signum
    if state.controller is not None:
        state.controller.request_stop(f"{name} to the launcher (pid {os.getpid()})")
        say(f"{name}: graceful stop: every rank finishes its iteration, then the checkpoint of the last one "
            f"is written (deadline {state.preemption_deadline_s:g} s; a second signal stops at once)")
    else:  # the controller runs on another node: the local workers ask it themselves
        for handler in state.pcontext.subprocess_handlers.values():
            try:
                os.kill(handler.proc.pid, signum)
            except ProcessLookupError:
                pass
        say(f"{name}: passed on to the local workers for a graceful stop (deadline "
            f"{state.preemption_deadline_s:g} s; a second signal stops at once)")
    return None


def _global_rank(pcontext, local_rank: int) -> int:
    return int(pcontext.envs[local_rank].get("RANK", local_rank))


def preemption_backstop(pcontext, state: Survivors) -> None:
    """SIGKILL the workers still running ``PREEMPT_KILL_MARGIN_S`` after the preemption deadline."""
    if state.stop_at is None or state.stop_killed:
        return
    if time.monotonic() - state.stop_at <= state.preemption_deadline_s + PREEMPT_KILL_MARGIN_S:
        return
    for local_rank, handler in pcontext.subprocess_handlers.items():
        if handler.proc.poll() is None:
            state.stop_killed = True
            log.error("worker rank %d (pid %d) still running %.0f s after the preemption deadline: SIGKILL",
                      _global_rank(pcontext, local_rank), handler.proc.pid, PREEMPT_KILL_MARGIN_S)
            handler.close(death_sig=signal.SIGKILL)


def end_unresponsive_workers(pcontext, state: Survivors) -> None:
    """SIGKILL the workers the controller gave up on for silence (hung, e.g. SIGSTOPped).

    The controller has already left them out of the dying checkpoint. A stopped process
    cannot act on the SIGTERM torchrun would send when the job ends, so torchrun would
    wait its 30 s before SIGKILL; end it now (its process group, as torchrun does) and
    let the next poll report its exit to the controller like any other death.
    """
    _end_workers(pcontext, state, state.controller.unresponsive_ranks())


def end_workers_asked_by_link(pcontext, state: Survivors) -> None:
    """On a node without the controller: SIGKILL the workers the controller declared hung
    (END_WORKER over the agent's link, ``--enable-worker-reboot``); the agent's next poll
    sees the death and restarts the worker like any crash (ARF)."""
    ends = state.link.end_requests()
    if ends:
        _end_workers(pcontext, state, {e.rank: (e.pid, e.detail) for e in ends})


def _end_workers(pcontext, state: Survivors, hung: Dict[int, Tuple[int, str]]) -> None:
    """SIGKILL each worker of ``hung`` (rank -> (pid, why)) if that pid is still this launcher's worker of the rank."""
    if not hung:
        return
    for local_rank, handler in pcontext.subprocess_handlers.items():
        rank = _global_rank(pcontext, local_rank)
        pid, why = hung.get(rank, (0, ""))
        if (rank not in hung or pid not in (0, handler.proc.pid) or handler.proc.pid in state.killed
                or handler.proc.poll() is not None):
            continue  # not listed, a newer process of the rank (ARF), ended already
        log.warning("worker rank %d (pid %d) is unresponsive (%s): SIGKILL", rank, handler.proc.pid, why)
        state.killed.add(handler.proc.pid)
        handler.close(death_sig=signal.SIGKILL)
        try:
            handler.proc.wait(5)
        except subprocess.TimeoutExpired:  # e.g. uninterruptible sleep: torchrun's teardown retries
            log.error("worker rank %d (pid %d) still there after SIGKILL", rank, handler.proc.pid)


def supervise(pcontext, state: Survivors) -> None:
    """Every monitor turn: remember the process context (for the signal handler), follow
    the leader if this launcher's controller stepped down, the preemption backstop, and
    the end of the workers the controller gave up on."""
    state.pcontext = pcontext
    if state.controller is not None:
        state.controller.hosted_ranks = frozenset(_global_rank(pcontext, lr) for lr in pcontext.subprocess_handlers)
    if state.controller is not None and state.controller.stepped_down is not None and state.relink is not None:
        # controller failover: this launcher's controller stepped down; its agent asks the leader
        log.warning("this launcher's controller stepped down (%s): its agent follows the leader",
                    state.controller.stepped_down)
        state.retired, state.controller, state.link = state.controller, None, state.relink()
    preemption_backstop(pcontext, state)
    if state.controller is not None:
        end_unresponsive_workers(pcontext, state)
    elif state.link is not None:
        end_workers_asked_by_link(pcontext, state)


def _report_failures(pcontext, state: Survivors, failed: Dict[int, int], running: int) -> None:
    """Tell the controller of each worker failure once (global rank, exit code)."""
    for local_rank, code in failed.items():
        rank = _global_rank(pcontext, local_rank)
        if rank in state.reported:
            continue
        state.reported[rank] = code
        if state.first_failure is None:
            state.first_failure = time.monotonic()
        log.warning("worker rank %d exited with %d; %d still running", rank, code, running)
        state.report_exit(rank, code)


def poll_lets_survivors_finish(wrapped, instance, args, kwargs):
    """torchrun's poll, deferred while survivors may still be writing the dying checkpoint
    (a worker failed, others run, the controller is not done, within the grace period)
    and for ``EXIT_MARGIN_S`` after the controller is done (the workers are exiting)."""
    state = _current
    if state is None:
        return wrapped(*args, **kwargs)
    supervise(instance, state)
    running, failed = [], {}
    for local_rank, handler in instance.subprocess_handlers.items():
        code = handler.proc.poll()
        if code is None:
            running.append(local_rank)
        elif code != 0:
            failed[local_rank] = code
    _report_failures(instance, state, failed, len(running))
    controller_done = state.controller is not None and state.controller.wait_done(0) is not None
    if failed and running and not controller_done and time.monotonic() - state.first_failure < state.grace_s:
        return None  # keep waiting: survivors are saving the dying checkpoint
    if controller_done and running:
        # the controller saw every rank it ended say goodbye: their processes are exiting now;
        # give them EXIT_MARGIN_S before torchrun's shutdown signals them
        if state.done_at is None:
            state.done_at = time.monotonic()
        if time.monotonic() - state.done_at < EXIT_MARGIN_S:
            return None
    return wrapped(*args, **kwargs)
