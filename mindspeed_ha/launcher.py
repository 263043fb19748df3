"""``mindspeed-ha-run``: torchrun with the controller thread and dying-checkpoint grace.

Usage is torchrun's (``torch.distributed.run``)::

    mindspeed-ha-run --nproc-per-node 8 pretrain_gpt.py ... --enable-high-availability
    mindspeed-ha-run --standalone --nproc-per-node 4 -m mindspeed_ha.testing.trainer.pretrain_gpt ...

What it adds when the training arguments carry ``--enable-high-availability``:

* Workers start through ``python -m mindspeed_ha.boot``, which imports ``mindspeed_ha``
  first, so an unmodified Megatron-LM ``pretrain_gpt.py`` is patched.
* A random job auth key (``MINDSPEED_HA_AUTH_KEY``) for the controller port.
* On the controller node (node rank 0, or the node whose address is ``TTP_ADDR``) the
  controller runs as a thread of this agent process: a worker's death, rank 0's
  included, cannot take it down, and the agent tells it at once which rank exited.
* The elastic agent no longer kills every worker when one fails: it lets the survivors
  finish the dying checkpoint and exit by themselves, for at most
  ``MINDSPEED_HA_DYING_GRACE_S`` seconds (default 600), then stops the rest as torchrun
  would. (The reference asks users to edit torchrun for this; here it is a patch of
  ``SubprocessContext._poll``, installed only in this process.)
* A worker the controller gave up on for missed heartbeats (hung, e.g. SIGSTOPped) is
  SIGKILLed as soon as the controller acts on the fault: a stopped process cannot act
  on the SIGTERM torchrun sends at the end, which would cost torchrun's 30 s wait.
* SIGTERM / SIGINT (a scheduler's preemption, Ctrl-C) start a graceful stop instead of
  torchrun's kill: the controller has every rank finish the iteration in progress and
  pause after the same one, the checkpoint of that iteration is written (a dying
  checkpoint with no dead rank) and the job exits 75, within ``--ha-preemption-deadline``
  (default 20 s). Past the deadline the controller abandons the save (77: nothing
  published, the tracker untouched) and workers still running ``PREEMPT_KILL_MARGIN_S``
  later are SIGKILLed; the launcher then exits 77. On a node without the controller the
  signal is passed on to the local workers, which ask the controller themselves. A second
  signal falls back to torchrun's own shutdown.
* ``MINDSPEED_HA_REPORT=FILE`` writes the controller's event log and outcome as JSON.
* ``--enable-worker-reboot`` (in the training arguments): a worker that dies (non-zero
  exit or a signal) is started again alone, same rank and env plus
  ``MINDSPEED_HA_INCARNATION``, the others keep running (``mindspeed_ha.agent``); the
  controller records each restart (report: ``restarts``). ``--max-restarts`` is the limit
  per rank (default 3 when not given: torchrun's 0 would make the flag a no-op); past it,
  or when the controller refuses (its verdict on the job under way), the path above.
  Every node's agent does this: the one hosting the controller asks it in process, the
  others over an authenticated link (``mindspeed_ha.control.agent_link``). Before its
  workers start, a launcher on another node asks the controller which incarnation they
  start as: a replacement launcher started after its node was lost (same command) gets
  n >= 1, and its workers rejoin the running job instead of starting a new one.
  ``--nnodes`` > 1 needs the same ``MINDSPEED_HA_AUTH_KEY`` in every launcher's env.
  Only on the controller's node: other nodes' workers are not restarted yet.

Without the HA flag it behaves exactly like torchrun.
"""

from __future__ import annotations

from mindspeed_ha import env as ha_env
import argparse
import contextlib
import datetime
import functools
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, Optional, Set

import wrapt

log = logging.getLogger("mindspeed_ha.launcher")

ENV_GRACE = ha_env.DYING_GRACE_S
ENV_REPORT = ha_env.REPORT
#: directory under which a multi-node job keeps its controller lease (default: <--save>/.mindspeed_ha)
ENV_LEASE_ROOT = ha_env.LEASE_ROOT
#: the address this node's launcher advertises when it takes over as the controller
ENV_NODE_ADDR = ha_env.NODE_ADDR
#: seconds after the preemption deadline before the launcher SIGKILLs the workers left
#: (the controller's EXIT(77) at the deadline normally ends them first)
PREEMPT_KILL_MARGIN_S = 5.0
#: seconds workers get to exit by themselves once the controller is DONE (they said goodbye)
EXIT_MARGIN_S = 5.0


class _Survivors:
    """State of the agent-side patch: which failures were reported, since when."""

    def __init__(self, controller, grace_s: float, preemption_deadline_s: float = 20.0, link=None):
        self.controller = controller
        #: the agent's link to the controller on a node without it (--enable-worker-reboot), else None
        self.link = link
        #: global rank -> incarnation its first process of this launcher starts as (AGENT_WELCOME)
        self.first_incarnations: Dict[int, int] = {}
        self.grace_s = grace_s
        self.first_failure: Optional[float] = None
        self.reported: Dict[int, int] = {}
        self.killed: Set[int] = set()
        self.preemption_deadline_s = preemption_deadline_s
        self.pcontext = None  # torchrun's SubprocessContext, once workers run
        self.stop_at: Optional[float] = None  # graceful stop: when the signal came
        self.stop_signal: Optional[int] = None
        self.stop_killed = False  # the preemption backstop SIGKILLed workers
        self.done_at: Optional[float] = None  # when the controller was first seen DONE
        self.lease = None  # the job's LeaseDir (controller failover), or None
        self.relink = None  # () -> an AgentLink to the leader (controller failover)
        self.old_links = []  # links replaced by an in-process controller, closed at the end
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
        _supervise(pcontext, self)

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


def _say(text: str) -> None:
    """One line to stderr without logging's locks (safe in a signal handler)."""
    try:
        os.write(2, f"mindspeed-ha-run: {text}\n".encode())
    except OSError:
        pass


def _on_termination_signal(wrapped, instance, args, kwargs):
    """torchrun's handler for SIGTERM/SIGINT/SIGHUP/SIGQUIT, which raises ``SignalException``
    (its shutdown: SIGTERM to every worker, SIGKILL 30 s later). The first SIGTERM or
    SIGINT once workers run starts a graceful stop instead and returns; anything else,
    or a second signal, goes to torchrun."""
    import signal

    signum = args[0]
    state = _survivors
    if (state is None or state.pcontext is None or state.stop_at is not None
            or signum not in (signal.SIGTERM, signal.SIGINT)):
        return wrapped(*args, **kwargs)
    state.stop_at, state.stop_signal = time.monotonic(), signum
    name = signal.Signals(signum).name
    if state.controller is not None:
        state.controller.request_stop(f"{name} to the launcher (pid {os.getpid()})")
        _say(f"{name}: graceful stop: every rank finishes its iteration, then the checkpoint of the last one "
             f"is written (deadline {state.preemption_deadline_s:g} s; a second signal stops at once)")
    else:  # the controller runs on another node: the local workers ask it themselves
        for handler in state.pcontext.subprocess_handlers.values():
            try:
                os.kill(handler.proc.pid, signum)
            except ProcessLookupError:
                pass
        _say(f"{name}: passed on to the local workers for a graceful stop (deadline "
             f"{state.preemption_deadline_s:g} s; a second signal stops at once)")
    return None


def _preemption_backstop(instance, state: "_Survivors") -> None:
    """SIGKILL the workers still running ``PREEMPT_KILL_MARGIN_S`` after the preemption deadline."""
    if state.stop_at is None or state.stop_killed:
        return
    if time.monotonic() - state.stop_at <= state.preemption_deadline_s + PREEMPT_KILL_MARGIN_S:
        return
    for local_rank, handler in instance.subprocess_handlers.items():
        if handler.proc.poll() is None:
            state.stop_killed = True
            rank = int(instance.envs[local_rank].get("RANK", local_rank))
            log.error("worker rank %d (pid %d) still running %.0f s after the preemption deadline: SIGKILL", rank,
                      handler.proc.pid, PREEMPT_KILL_MARGIN_S)
            handler.close(death_sig=signal.SIGKILL)


_survivors: Optional[_Survivors] = None


def _end_unresponsive_workers(instance, state: _Survivors) -> None:
    """SIGKILL the workers the controller gave up on for silence (hung, e.g. SIGSTOPped).

    The controller has already left them out of the dying checkpoint. A stopped process
    cannot act on the SIGTERM torchrun would send when the job ends, so torchrun would
    wait its 30 s before SIGKILL; end it now (its process group, as torchrun does) and
    let the next poll report its exit to the controller like any other death.
    """
    hung = state.controller.unresponsive_ranks()
    if not hung:
        return
    for local_rank, handler in instance.subprocess_handlers.items():
        rank = int(instance.envs[local_rank].get("RANK", local_rank))
        if rank not in hung or rank in state.killed or handler.proc.poll() is not None:
            continue
        log.warning("worker rank %d (pid %d) is unresponsive (%s): SIGKILL", rank, handler.proc.pid, hung[rank])
        state.killed.add(rank)
        handler.close(death_sig=signal.SIGKILL)
        try:
            handler.proc.wait(5)
        except subprocess.TimeoutExpired:  # e.g. uninterruptible sleep: torchrun's teardown retries
            log.error("worker rank %d (pid %d) still there after SIGKILL", rank, handler.proc.pid)


def _supervise(instance, state: _Survivors) -> None:
    """Every monitor turn: remember the process context (for the signal handler), the
    preemption backstop, and the end of the workers the controller gave up on."""
    state.pcontext = instance
    if state.controller is not None and state.controller.stepped_down is not None and state.relink is not None:
        # controller failover: this launcher's controller stepped down; its agent asks the leader
        log.warning("this launcher's controller stepped down (%s): its agent follows the leader",
                    state.controller.stepped_down)
        state.retired, state.controller, state.link = state.controller, None, state.relink()
    _preemption_backstop(instance, state)
    if state.controller is not None:
        _end_unresponsive_workers(instance, state)


def _poll_lets_survivors_finish(wrapped, instance, args, kwargs):
    state = _survivors
    if state is None:
        return wrapped(*args, **kwargs)
    _supervise(instance, state)
    running, failed = [], {}
    for local_rank, handler in instance.subprocess_handlers.items():
        code = handler.proc.poll()
        if code is None:
            running.append(local_rank)
        elif code != 0:
            failed[local_rank] = code
    for local_rank, code in failed.items():
        rank = int(instance.envs[local_rank].get("RANK", local_rank))
        if rank not in state.reported:
            state.reported[rank] = code
            if state.first_failure is None:
                state.first_failure = time.monotonic()
            log.warning("worker rank %d exited with %d; %d still running", rank, code, len(running))
            controller, link = state.controller, state.link
            if controller is not None:
                controller.report_rank_exit(rank, code)
            elif link is not None:
                link.report_rank_exit(rank, code)
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


def _ha_args(script_args):
    """The HA flags, and the Megatron flags they are checked against, among the training
    arguments (other flags ignored)."""
    from mindspeed_ha.config import add_ha_arguments

    # allow_abbrev=False as in Megatron-LM's own parser: otherwise "--num-layers 4" would be
    # read as --num-layers-per-virtual-pipeline-stage 4.
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_ha_arguments(parser)
    parser.add_argument("--save", default=None)
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--ckpt-format", default="torch_dist")  # Megatron-LM core_v0.12.1 default
    parser.add_argument("--no-ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save",
                        action="store_false")
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    parser.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        parser.add_argument(flag, type=int, default=1)
    ns, _ = parser.parse_known_args(script_args)
    return ns


def _check_before_start(targs, ns) -> None:
    """Everything that can be checked before a worker starts (nothing can be lost yet).

    Raises:
        ConfigError: naming the flag / env var and the accepted range.
    """
    from mindspeed_ha.config import ConfigError, validate_ha_args

    validate_ha_args(ns, _world_size(targs), ns.tensor_model_parallel_size,
                     ns.pipeline_model_parallel_size, ns.context_parallel_size)
    raw = os.environ.get(ENV_GRACE, "600")
    try:
        grace = float(raw)
    except ValueError:
        grace = -1.0
    if not grace > 0:
        raise ConfigError(f"{ENV_GRACE}={raw!r}: expected seconds > 0 (default 600)")
    if ns.save:
        _check_save_writable(ns.save)
    if os.environ.get(ha_env.INJECT):  # a bad test spec: say so once, before 4 tracebacks
        from mindspeed_ha.testing.injector import parse_env

        try:
            parse_env(os.environ[ha_env.INJECT])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _check_save_writable(save: str) -> None:
    """--save must be a directory we can create or write, checked without creating it.

    Raises:
        ConfigError: naming --save.
    """
    from mindspeed_ha.config import ConfigError

    path = os.path.abspath(save)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--save {save!r} is not a writable directory ({path!r} is not a writable directory)")


def _is_local_address(addr: str) -> bool:
    if addr in ("", "127.0.0.1", "::1", "localhost", "0.0.0.0", "::"):
        return True
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
        return addr in {i[4][0] for i in infos}
    except OSError:
        return False


def _world_size(targs) -> int:
    return _nnodes(targs) * int(targs.nproc_per_node)


def main(argv=None) -> int:
    logging.basicConfig(level=os.environ.get(ha_env.LOG, "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.prog = "mindspeed-ha-run"
    parser.description = (
        "mindspeed-ha launcher: torchrun's arguments and behaviour, plus, when the training "
        "arguments carry --enable-high-availability, the job's controller in this process and "
        f"a grace period ({ENV_GRACE}, default 600 s) for survivors to save the dying "
        "checkpoint. Exit codes: 75 dying checkpoint saved (rerun with --load), 76 nothing "
        "written (no complete copy / no completed iteration), 79 a rank failed before training "
        "started (start-up or resuming from --load; nothing to save), 2 bad arguments.")
    targs = parser.parse_args(argv)
    ns = _ha_args(targs.training_script_args)
    if not targs.module and not targs.no_python and not os.path.isfile(targs.training_script):
        print(f"mindspeed-ha-run: error: training script {targs.training_script!r} not found",
              file=sys.stderr)
        return 2
    # Workers import mindspeed_ha before the user's code.
    if targs.module:
        targs.training_script_args = ["-m", targs.training_script] + list(targs.training_script_args)
    else:
        targs.training_script_args = [targs.training_script] + list(targs.training_script_args)
    targs.training_script, targs.module = "mindspeed_ha.boot", True
    if not getattr(ns, "enable_high_availability", False):
        run(targs)
        return 0

    global _survivors
    from mindspeed_ha.config import HAConfig

    from mindspeed_ha.config import ConfigError

    controller = link = lease = None
    try:
        if _nnodes(targs) > 1 and not os.environ.get(ha_env.AUTH_KEY):
            raise ConfigError("--nnodes > 1 with --enable-high-availability: set MINDSPEED_HA_AUTH_KEY (the same "
                              "hex key, e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`) in "
                              "every node's launcher environment: it authenticates the control plane")
        os.environ.setdefault(ha_env.AUTH_KEY, secrets.token_hex(32))
        _check_before_start(targs, ns)
        config = HAConfig.from_args(ns)
        lease = _lease_dir(targs, ns, config)
        if lease is not None:
            os.environ.setdefault("TORCH_ELASTIC_WORKER_IDENTICAL", "1")  # ranks without the (maybe lost) store
            os.environ[ha_env.CONTROLLER_HOSTED] = "1"  # the launchers run the controllers
        primary = int(targs.node_rank) == 0 and _is_local_address(config.controller_addr)
        first_term = 0
        if primary and lease is not None and lease.current() is not None and not _leader_alive(lease):
            first_term = lease.current().term + 1  # a term left by an earlier run: never reuse a term
        elif primary and lease is not None and lease.current() is not None:
            primary = False  # a replacement node 0: the job runs on, led by a successor
            log.warning("node 0: the job is led by the controller of term %d (node %d): this launcher joins it",
                        lease.current().term, lease.current().node_rank)
        if primary:
            from mindspeed_ha.control.controller import Controller

            controller = Controller(config, world_size=_world_size(targs),
                                    bind_addr=config.controller_addr, port=config.controller_port)
            controller.start()
            os.environ[ha_env.CONTROLLER_HOSTED] = "1"
            os.environ[ha_env.TTP_PORT] = str(controller.port)  # the bound port (matters for port 0)
            if lease is not None:
                lease.drop_roster()  # an earlier run's: a successor must not take its ranks
                if not _lead(controller, lease, first_term, config.controller_addr, 0, int(targs.node_rank)):
                    controller.stop()
                    raise ConfigError(f"controller failover: term {first_term} in {lease.path} was taken by another "
                                      "launcher: is a second node 0 running this job?")
        elif config.worker_reboot:
            from mindspeed_ha.control.agent_link import node_link

            link = node_link(config, int(targs.node_rank), lease)
    except ConfigError as exc:  # before any worker starts: nothing is lost
        print(f"mindspeed-ha-run: error: {exc}", file=sys.stderr, flush=True)
        return 2
    _survivors = _Survivors(controller, float(os.environ.get(ENV_GRACE, "600")), config.preemption_deadline_s,
                            link=link)
    _survivors.lease = lease
    if lease is not None:
        from mindspeed_ha.control.agent_link import node_link

        _survivors.relink = functools.partial(node_link, config, int(targs.node_rank), lease)
    standby = None
    if lease is not None and controller is None:
        standby = _Standby(_survivors, lease, config, targs)
    try:
        if link is not None:
            _survivors.first_incarnations = _hello(link, targs, config)
    except Exception as exc:  # AgentLinkError: refused / no controller; nothing started
        print(f"mindspeed-ha-run: error: {exc}", file=sys.stderr, flush=True)
        link.close()
        return 2
    agent = _reboot_agent(targs, argv, _survivors) if config.worker_reboot else None
    wrapt.wrap_function_wrapper(
        "torch.distributed.elastic.multiprocessing.api", "SubprocessContext._poll", _poll_lets_survivors_finish
    )
    wrapt.wrap_function_wrapper(
        "torch.distributed.elastic.multiprocessing.api", "_terminate_process_handler", _on_termination_signal
    )
    code = 0
    try:
        with _agent_class(agent):
            run(targs)
    except ChildFailedError as exc:
        codes = {f.exitcode for f in exc.failures.values()}
        code = _exit_code(codes)
        if controller is not None and code != 75:
            from mindspeed_ha.faults import EXIT_FAILED_BEFORE_TRAINING

            controller.wait_done(2.0)  # every worker is gone: its verdict follows at once
            if controller.outcome().exit_code == EXIT_FAILED_BEFORE_TRAINING:
                code = EXIT_FAILED_BEFORE_TRAINING  # every worker ended on its own error at start-up
        if _survivors.stop_killed and code not in (75, 76):  # graceful stop past its deadline: nothing committed
            from mindspeed_ha.faults import EXIT_FAULT_UNRECOVERABLE

            code = EXIT_FAULT_UNRECOVERABLE
        print(f"mindspeed-ha-run: {_outcome_text(controller, code)}", file=sys.stderr, flush=True)
    finally:
        if standby is not None:
            standby.stop()
        controller = _survivors.controller or _survivors.retired  # a standby may have taken over
        if controller is not None:
            if controller.leadership is not None and controller.stepped_down is None:
                controller.wait_done(EXIT_MARGIN_S)  # the other nodes' goodbyes may still be on their way
            _write_report(controller)
            controller.stop()
            lead = controller.leadership
            if lead is not None:
                lead.stop()
                if controller.wait_done(0) is not None and controller.stepped_down is None:
                    lease.clear()  # the job is over: nobody leads it any more
        for old in [_survivors.link, *_survivors.old_links]:
            if old is not None:
                old.close()
    return code


def _hello(link, targs, config) -> Dict[int, int]:
    """Ask the controller which incarnation this node's workers start as (0: the job's
    first start; n >= 1: a replacement launcher whose workers rejoin the running job).

    torchrun's static rendezvous (its default with ``--master-addr``/``--node-rank``) gives
    node ``k`` the global ranks ``k * nproc .. k * nproc + nproc - 1`` (torch 2.13
    ``SimpleElasticAgent._assign_worker_ranks``: the sum of the lower nodes' local world
    sizes, every node having ``--nproc-per-node`` workers).
    """
    nproc = int(targs.nproc_per_node)
    ranks = [int(targs.node_rank) * nproc + i for i in range(nproc)]
    first = link.hello(ranks, config.connect_timeout_s)
    if any(first.values()):
        log.warning("node %s: the job is running; ranks %s start as incarnations %s and rejoin it", targs.node_rank,
                    ranks, [first[r] for r in ranks])
    return first


def _lease_dir(targs, ns, config):
    """The job's lease directory (controller failover, :mod:`mindspeed_ha.control.lease`),
    or None: only with ``--nnodes`` > 1 and ``--enable-worker-reboot``, under
    ``MINDSPEED_HA_LEASE_ROOT`` or else ``<--save>/.mindspeed_ha``; exported to the workers
    as ``MINDSPEED_HA_LEASE_DIR``."""
    from mindspeed_ha.control.lease import ENV_LEASE_DIR, LeaseDir, lease_dir, lease_seconds

    root = os.environ.get(ENV_LEASE_ROOT) or (os.path.join(ns.save, ".mindspeed_ha") if ns.save else None)
    os.environ.pop(ENV_LEASE_DIR, None)  # never an inherited one
    if _nnodes(targs) < 2 or not config.worker_reboot:
        return None
    if root is None:
        log.warning("--nnodes %s without --save or %s: no controller failover (losing node 0 ends the job)",
                    targs.nnodes, ENV_LEASE_ROOT)
        return None
    try:
        lease_seconds()
    except ValueError as exc:
        from mindspeed_ha.config import ConfigError

        raise ConfigError(str(exc)) from None
    path = lease_dir(os.path.abspath(root), config.auth_key)
    os.environ[ENV_LEASE_DIR] = path
    return LeaseDir(path)


def _leader_alive(lease) -> bool:
    """Whether the highest term of ``lease`` has a live leader: its counter moves, or a
    successor takes the next term, within three leases (a standby takes over about one
    lease after the leader's last renewal). A term left by an earlier run of the same job
    (nothing moves) is not: the new run leads the next term (terms are never reused or
    removed while a job may run)."""
    from mindspeed_ha.control.lease import lease_seconds

    first = lease.current()
    if first is None:
        return False
    lease_s, beat = lease_seconds(), lease.beat(first.term)
    end = time.monotonic() + 3 * lease_s
    while time.monotonic() < end:
        time.sleep(lease_s / 8)  # polling a file the leader rewrites: nothing to wait on
        cur = lease.current()
        if cur is not None and (cur.term != first.term or lease.beat(cur.term) != beat):
            return True
    log.warning("lease directory %s: term %d was left by an earlier run (its lease did not move for %.1f s): "
                "this run leads the next term", lease.path, first.term, 3 * lease_s)
    return False


def _lead(controller, lease, term: int, host: str, store_port: int, node_rank: int) -> bool:
    """Take ``term`` for ``controller`` (listening on ``host``); False if someone else has."""
    from mindspeed_ha.control.lease import Leadership, Term, lease_seconds

    t = Term(term, host, controller.port, store_port, node_rank, os.getpid())
    if not lease.take(t):
        return False
    controller.lease = lease
    controller.leadership = Leadership(lease, t, lease_seconds())
    log.warning("controller failover: this launcher (node %d) leads term %d at %s:%d", node_rank, term, host,
                controller.port)
    return True


class _Standby(threading.Thread):
    """A launcher without the controller watches the leader's lease and, when it runs out,
    tries to take the next term: a TCPStore for the process-group rebuilds (the first
    one lived in node 0's agent) and a successor controller that takes over the roster;
    on success the launcher's hooks use it in process instead of the link."""

    def __init__(self, state: _Survivors, lease, config, targs):
        super().__init__(name="mindspeed-ha-standby", daemon=True)
        from mindspeed_ha.control.lease import Watch, lease_seconds

        self.state, self.lease, self.config, self.targs = state, lease, config, targs
        self.watch = Watch(lease, lease_seconds())
        self.store = None
        self._halt = threading.Event()
        self.start()

    def stop(self) -> None:
        self._halt.set()
        self.join()  # a takeover in progress finishes (its term is then this launcher's to end)

    def run(self) -> None:
        from mindspeed_ha.control.lease import lease_seconds

        while not self._halt.wait(lease_seconds() / 8):
            expired = self.watch.expired()
            if expired is None or self._halt.is_set():
                continue
            try:
                if self._take_over(expired.term + 1):
                    return
            except Exception:  # noqa: BLE001 - log it and keep watching: the next term may be ours
                log.exception("controller failover: taking term %d failed", expired.term + 1)

    def _take_over(self, term: int) -> bool:
        import torch.distributed as dist

        from mindspeed_ha.control.controller import Controller

        host = os.environ.get(ENV_NODE_ADDR) or ("127.0.0.1" if self.config.controller_addr in ("127.0.0.1",
                                                                                              "localhost")
                                                 else socket.gethostname())
        store = dist.TCPStore(host, 0, None, True, datetime.timedelta(seconds=300), wait_for_workers=False)
        controller = Controller(self.config, world_size=_world_size(self.targs), bind_addr=host, port=0)
        controller.take_over(self.lease.read_roster())
        controller.rebuild_store = f"{host}:{store.port}"
        controller.start()
        try:
            led = _lead(controller, self.lease, term, host, store.port, int(self.targs.node_rank))
        except BaseException:
            controller.stop()
            raise
        if not led:
            controller.stop()
            return False
        self.store = store  # kept alive with the launcher
        # the main thread may be inside a request on the link: it is closed at the launcher's end
        self.state.controller = controller
        self.state.old_links.append(self.state.link)
        self.state.link = None
        return True


def _nnodes(targs) -> int:
    return int(str(targs.nnodes).split(":")[-1])


def _reboot_agent(targs, argv, state: _Survivors):
    """``--enable-worker-reboot``: torchrun's agent replaced by ``WorkerRebootAgent`` (a
    factory with the launcher's settings), or None (with a warning) where it cannot act.

    ``--max-restarts`` (or torchrun's ``PET_MAX_RESTARTS``) becomes the limit per rank;
    when neither is given the limit is ``DEFAULT_RESTARTS_PER_RANK`` (3). On a node
    without the controller the agent asks it over ``state.link`` whether a restart is
    still wanted (a new process must not register into a dying-checkpoint round).
    """
    from torch.distributed.elastic.multiprocessing import Std
    from torch.distributed.run import get_args_parser

    from mindspeed_ha.agent import DEFAULT_RESTARTS_PER_RANK, WorkerRebootAgent

    if state.controller is None and state.link is None:
        log.warning("--enable-worker-reboot: no link to the controller; this node's workers are not restarted (a "
                    "failure takes the dying-checkpoint path)")
        return None
    if _nnodes(targs) > 1 and targs.rdzv_backend not in ("static", ""):
        log.warning("--enable-worker-reboot with --rdzv-backend %s: a replacement node joining later makes torchrun "
                    "restart every node's workers; use the static rendezvous (--master-addr/--master-port/"
                    "--node-rank) to restart only a lost node's", targs.rdzv_backend)
    probe = get_args_parser()
    probe.set_defaults(max_restarts=None)
    given = probe.parse_args(argv).max_restarts is not None or os.environ.get("PET_MAX_RESTARTS")
    limit = int(targs.max_restarts) if given else DEFAULT_RESTARTS_PER_RANK
    if limit == 0:
        log.warning("--enable-worker-reboot with --max-restarts 0: no worker is restarted")
    try:
        ranks = set(map(int, targs.local_ranks_filter.split(","))) if targs.local_ranks_filter else None
    except ValueError:  # torchrun says so itself
        ranks = None
    log.info("worker reboot: a dead worker is restarted alone, at most %d times per rank", limit)
    return functools.partial(WorkerRebootAgent, restarts_per_rank=limit, hooks=state, tee=Std.from_str(targs.tee),
                             local_ranks_filter=ranks)


@contextlib.contextmanager
def _agent_class(factory):
    """torchrun's ``launch_agent`` (torch 2.13 ``torch/distributed/launcher/api.py``) builds
    its agent by the module-level name ``LocalElasticAgent``, with no option for another
    class: that name is bound to ``factory`` while the job runs (nothing when None)."""
    if factory is None:
        yield
        return
    import torch.distributed.launcher.api as launcher_api

    saved = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = factory
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = saved


def _exit_code(codes) -> int:
    """The job's exit status from the workers' (signals are negative).

    75 when the dying checkpoint was saved; 79 when training never started (start-up or
    ``--load`` failed: the workers' own errors are that failure); otherwise a worker's own
    error (a plain non-zero exit, e.g. a traceback) wins over the controller's 76/77/78
    verdicts, which only follow from it.
    """
    from mindspeed_ha import faults

    if faults.EXIT_DYING_CHECKPOINT_SAVED in codes:
        return faults.EXIT_DYING_CHECKPOINT_SAVED
    if faults.EXIT_FAILED_BEFORE_TRAINING in codes:  # start-up / --load failed: the errors are that
        return faults.EXIT_FAILED_BEFORE_TRAINING
    ha_codes = {faults.EXIT_NO_COMPLETE_DATA, faults.EXIT_FAULT_UNRECOVERABLE, faults.EXIT_CONTROLLER_LOST}
    own = sorted(c for c in codes if c > 0 and c not in ha_codes)
    if own:
        return own[0]
    for c in (faults.EXIT_NO_COMPLETE_DATA, faults.EXIT_FAULT_UNRECOVERABLE, faults.EXIT_CONTROLLER_LOST):
        if c in codes:
            return c
    return 1


def _outcome_text(controller, code: int) -> str:
    from mindspeed_ha import faults

    if controller is None:
        return f"workers failed (exit {code}); the controller runs on another node"
    o = controller.outcome()
    req = o.stop_request
    if req is not None and o.fault_rank is None:
        if code == faults.EXIT_DYING_CHECKPOINT_SAVED:
            return (f"graceful stop ({req.reason}); {o.reason}. Rerun the same command with --load to continue "
                    f"from iteration {o.iteration}.")
        return f"graceful stop ({req.reason}) ended with exit {code}: {o.reason or o.phase.value}"
    if code == faults.EXIT_DYING_CHECKPOINT_SAVED:
        return (f"rank {o.fault_rank} failed ({o.fault_kind.value if o.fault_kind else 'fault'}); {o.reason}. "
                f"Rerun the same command with --load to continue from iteration {o.iteration}.")
    return f"workers failed (exit {code}); controller: {o.reason or o.phase.value}"


def _json_or_text(detail: str):
    try:
        return json.loads(detail)
    except ValueError:
        return detail


def _write_report(controller) -> None:
    """``MINDSPEED_HA_REPORT``: the controller's outcome as JSON (times in seconds)."""
    path = os.environ.get(ENV_REPORT)
    if not path:
        return
    o = controller.outcome()
    to_wall = time.time() - controller.clock()  # controller clock -> wall clock
    fault_at = None if o.fault_rank is None else controller.state.fault.at
    first = {}
    for e in o.events:
        first.setdefault(e.action.value, e.t)
    report = {
        "phase": o.phase.value, "exit_code": o.exit_code, "reason": o.reason, "iteration": o.iteration,
        "fault_rank": o.fault_rank, "fault_kind": o.fault_kind.value if o.fault_kind else None,
        "stop_request": None if o.stop_request is None else {
            "rank": o.stop_request.rank, "reason": o.stop_request.reason, "t_wall": o.stop_request.at + to_wall},
        "phase_seconds": o.timings,
        "fault_wall": None if fault_at is None else fault_at + to_wall,
        "exit_wall": None if "exit" not in first else first["exit"] + to_wall,
        "events": [{"t_wall": e.t + to_wall, "phase": e.phase.value, "action": e.action.value, "reason": e.reason}
                   for e in o.events],
        # in-place recoveries: controller times as wall clock, each rank's RETRY result (its stage seconds)
        "recoveries": [dict({k: v for k, v in r.items() if not k.endswith("_at")},
                            **{k.replace("_at", "_wall"): (None if v is None else v + to_wall)
                               for k, v in r.items() if k.endswith("_at")},
                            ranks={str(rank): _json_or_text(d) for rank, d in r["ranks"].items()})
                       for r in o.recoveries],
        # --enable-worker-reboot: each restart of a worker (rank, incarnation, new pid, previous exit code)
        "restarts": [dict({k: v for k, v in r.items() if k != "at"}, t_wall=r["at"] + to_wall) for r in o.restarts],
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
