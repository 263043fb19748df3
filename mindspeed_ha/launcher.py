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
  signal falls back to torchrun's own shutdown (SIGTERM to every worker, SIGKILL after its
  shutdown timeout, 30 s by default); a third SIGKILLs every descendant at once. The
  launcher is a child subreaper and, once a signal stopped the job, ends whatever is left
  of its process tree before it exits (exit 128 + the signal's number). The same without
  the HA flag, from the first signal on.
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

Without the HA flag it behaves like torchrun, but for the signals (above) and the checks
below.

Bad input ends the launcher with one line naming the flag or variable and the accepted
range, exit 2, before anything starts: its own environment (``MINDSPEED_HA_LOG``,
``MINDSPEED_HA_DYING_GRACE_S``, ``MINDSPEED_HA_REPORT``, ``MINDSPEED_HA_LEASE_S``,
``MINDSPEED_HA_WARM_SPARES``, ``MINDSPEED_HA_CPU_BACKEND``, ``MINDSPEED_HA_DISABLE_PATCHES``,
``MINDSPEED_HA_INJECT``) before torch is imported, then torchrun's numeric flags, then the
HA flags and settings (``HAConfig``). A report that cannot be written at the end is a
warning; the exit status stays the job's.

The parts live in :mod:`mindspeed_ha.launch` (the agent-side state and torchrun patches,
controller failover, the report); this module parses, starts the control plane, runs
torchrun and closes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import os
import secrets
import signal
import socket
import sys
from typing import Dict, Optional

from mindspeed_ha import env as ha_env
from mindspeed_ha import faults
from mindspeed_ha.errors import ConfigError
from mindspeed_ha.launch import checks, proctree, report, standby, survivors
from mindspeed_ha.launch.survivors import EXIT_MARGIN_S, Survivors

log = logging.getLogger("mindspeed_ha.launcher")

#: seconds the survivors of a failure get to finish the dying checkpoint (default 600)
ENV_GRACE = checks.ENV_GRACE

_DESCRIPTION = (
    "mindspeed-ha launcher: torchrun's arguments and behaviour, plus, when the training "
    "arguments carry --enable-high-availability, the job's controller in this process and "
    f"a grace period ({ENV_GRACE}, default 600 s) for survivors to save the dying "
    "checkpoint. Exit codes: 75 dying checkpoint saved (rerun with --load), 76 nothing "
    "written (no complete copy / no completed iteration), 79 a rank failed before training "
    "started (start-up or resuming from --load; nothing to save), 2 bad arguments.")


def ha_args(script_args):
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
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                 "--expert-model-parallel-size", "--num-distributed-optimizer-instances"):
        parser.add_argument(flag, type=int, default=1)
    parser.add_argument("--use-custom-fsdp", action="store_true")
    ns, _ = parser.parse_known_args(script_args)
    return ns


def _check_before_start(targs, ns) -> None:
    """Everything about the HA job that can be checked before a worker starts (nothing can
    be lost yet).

    Raises:
        ConfigError: naming the flag / env var and the accepted range.
    """
    from mindspeed_ha.config import validate_ha_args

    validate_ha_args(ns, _world_size(targs), ns.tensor_model_parallel_size,
                     ns.pipeline_model_parallel_size, ns.context_parallel_size)
    if ns.save:
        checks.check_save_writable(ns.save)


def _is_local_address(addr: str) -> bool:
    if addr in ("", "127.0.0.1", "::1", "localhost", "0.0.0.0", "::"):
        return True
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
        return addr in {i[4][0] for i in infos}
    except OSError:
        return False


def _nnodes(targs) -> int:
    return checks.nnodes(targs)


def _world_size(targs) -> int:
    return checks.nnodes(targs) * checks.nproc(targs)


def _parse(argv):
    """torchrun's arguments, with the workers started through ``mindspeed_ha.boot``
    (which imports mindspeed_ha before the user's code); ``(targs, ha_ns)`` or None
    (the error printed) when the training script does not exist.

    Raises:
        ConfigError: a numeric torchrun flag out of range (:func:`mindspeed_ha.launch.checks.check_torchrun_args`).
    """
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "mindspeed-ha-run"
    parser.description = _DESCRIPTION
    targs = parser.parse_args(argv)
    checks.check_torchrun_args(targs)
    ns = ha_args(targs.training_script_args)
    if not targs.module and not targs.no_python and not os.path.isfile(targs.training_script):
        print(f"mindspeed-ha-run: error: training script {targs.training_script!r} not found",
              file=sys.stderr)
        return None
    if targs.module:
        targs.training_script_args = ["-m", targs.training_script] + list(targs.training_script_args)
    else:
        targs.training_script_args = [targs.training_script] + list(targs.training_script_args)
    targs.training_script, targs.module = "mindspeed_ha.boot", True
    return targs, ns


@dataclasses.dataclass
class _ControlPlane:
    """What this launcher runs of the control plane: the controller (node 0, or the
    ``TTP_ADDR`` node), else a link to it (``--enable-worker-reboot``), and the lease
    directory of controller failover (or None)."""

    config: object
    controller: object = None
    link: object = None
    lease: object = None


def _start_controller(targs, config, lease, term: int):
    """The controller thread of this launcher, listening; with failover, leading ``term``.

    Raises:
        ConfigError: another launcher took ``term`` (a second node 0).
    """
    from mindspeed_ha.control.controller import Controller

    controller = Controller(config, world_size=_world_size(targs), bind_addr=config.controller_addr,
                            port=config.controller_port)
    controller.start()
    os.environ[ha_env.CONTROLLER_HOSTED] = "1"
    os.environ[ha_env.TTP_PORT] = str(controller.port)  # the bound port (matters for port 0)
    if lease is not None:
        lease.drop_roster()  # an earlier run's: a successor must not take its ranks
        if not standby.lead(controller, lease, term, config.controller_addr, 0, int(targs.node_rank)):
            controller.stop()
            raise ConfigError(f"controller failover: term {term} in {lease.path} was taken by another "
                              "launcher: is a second node 0 running this job?")
    return controller


def _start_control_plane(targs, ns) -> _ControlPlane:
    """Check everything, then start the controller (or the link to it).

    Raises:
        ConfigError: before any worker starts (nothing is lost).
    """
    from mindspeed_ha.config import HAConfig

    if _nnodes(targs) > 1 and not os.environ.get(ha_env.AUTH_KEY):
        raise ConfigError("--nnodes > 1 with --enable-high-availability: set MINDSPEED_HA_AUTH_KEY (the same "
                          "hex key, e.g. from `python -c 'import secrets; print(secrets.token_hex(32))'`) in "
                          "every node's launcher environment: it authenticates the control plane")
    os.environ.setdefault(ha_env.AUTH_KEY, secrets.token_hex(32))
    _check_before_start(targs, ns)
    plane = _ControlPlane(HAConfig.from_args(ns))
    config = plane.config
    plane.lease = standby.lease_dir(_nnodes(targs), ns.save, config)
    if plane.lease is not None:
        os.environ.setdefault("TORCH_ELASTIC_WORKER_IDENTICAL", "1")  # ranks without the (maybe lost) store
        os.environ[ha_env.CONTROLLER_HOSTED] = "1"  # the launchers run the controllers
    primary = int(targs.node_rank) == 0 and _is_local_address(config.controller_addr)
    term: Optional[int] = 0
    if primary and plane.lease is not None:
        term = standby.first_term(plane.lease)  # None: a replacement node 0, the job runs on, led by a successor
        primary = term is not None
    if primary:
        plane.controller = _start_controller(targs, config, plane.lease, term)
    elif config.worker_reboot:
        from mindspeed_ha.control.agent_link import node_link

        plane.link = node_link(config, int(targs.node_rank), plane.lease)
    return plane


def _start_relay(targs, plane: _ControlPlane):
    """This node's relay (``control/relay.py``): its workers reach the controller through
    it, one CURVE connection per node instead of one per rank; its socket's path goes to
    the workers as ``MINDSPEED_HA_RELAY``. None (the workers connect directly) when that
    variable is ``0`` or the relay cannot start (logged)."""
    from mindspeed_ha.control.relay import NodeRelay

    if os.environ.get(ha_env.RELAY, "").strip() == "0":
        return None
    config = plane.config
    addr = config.controller_addr
    port = plane.controller.port if plane.controller is not None else config.controller_port
    cur = plane.lease.current() if plane.lease is not None else None
    if cur is not None:  # controller failover: the leader now (or a higher term's, followed until connected)
        addr, port = cur.host, cur.port
    try:
        relay = NodeRelay(config.max_message_bytes, config.auth_key, addr, port, int(targs.node_rank),
                          heartbeat_ms=int(config.heartbeat_interval_s * 1000),
                          timeout_ms=int(config.heartbeat_timeout_s * 500), lease=plane.lease,
                          term=cur.term if cur is not None else -1).open()
    except Exception as exc:  # noqa: BLE001 - the workers connect directly instead
        log.warning("node %s: no relay for the workers (%s); they connect to the controller directly",
                    targs.node_rank, exc)
        os.environ.pop(ha_env.RELAY, None)
        return None
    os.environ[ha_env.RELAY] = relay.path
    return relay


def _survivors(plane: _ControlPlane, targs) -> Survivors:
    state = Survivors(plane.controller, checks.grace_s(), plane.config.preemption_deadline_s, link=plane.link)
    state.lease = plane.lease
    if plane.lease is not None:
        from mindspeed_ha.control.agent_link import node_link

        state.relink = functools.partial(node_link, plane.config, int(targs.node_rank), plane.lease)
    return state


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


def _reboot_agent(targs, argv, state: Survivors):
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


def _run_job(targs, agent, plane: _ControlPlane, state: Survivors) -> int:
    """torchrun's run with the HA agent; the job's exit status (0, or from the workers'
    codes and the controller's verdict, the closing line printed)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    controller = plane.controller
    try:
        with _agent_class(agent):
            run(targs)
        return 0
    except ChildFailedError as exc:
        code = report.exit_code(f.exitcode for f in exc.failures.values())
        if controller is not None and code != faults.EXIT_DYING_CHECKPOINT_SAVED:
            controller.wait_done(2.0)  # every worker is gone: its verdict follows at once
            if controller.outcome().exit_code == faults.EXIT_FAILED_BEFORE_TRAINING:
                code = faults.EXIT_FAILED_BEFORE_TRAINING  # every worker ended on its own error at start-up
        if state.stop_killed and code not in (faults.EXIT_DYING_CHECKPOINT_SAVED, faults.EXIT_NO_COMPLETE_DATA):
            code = faults.EXIT_FAULT_UNRECOVERABLE  # graceful stop past its deadline: nothing committed
        print(f"mindspeed-ha-run: {report.outcome_text(controller, code)}", file=sys.stderr, flush=True)
        return code


def _close(state: Survivors, watch: Optional[standby.Standby]) -> None:
    """The end of the job: the standby stopped, the report written, the controller (this
    launcher's, or the one its standby started) stopped, its term given up when the job
    is over, every link closed."""
    if watch is not None:
        watch.stop()
    controller = state.controller or state.retired  # a standby may have taken over
    if controller is not None:
        if controller.leadership is not None and controller.stepped_down is None:
            controller.wait_done(EXIT_MARGIN_S)  # the other nodes' goodbyes may still be on their way
        report.write_report(controller)
        controller.stop()
        lead = controller.leadership
        if lead is not None:
            lead.stop()
            if controller.wait_done(0) is not None and controller.stepped_down is None:
                state.lease.clear()  # the job is over: nobody leads it any more
    for old in [state.link, *state.old_links]:
        if old is not None:
            old.close()


def _early_signal(signum, frame):
    """SIGTERM / SIGINT before torchrun's handler is in place (no worker exists yet)."""
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    """``mindspeed-ha-run``: torchrun's command line. Returns the exit status (see the
    description: 0, the workers' codes, 75/76/77/79, 2 for bad arguments, 128 + the
    signal's number when a signal stopped it without a graceful stop).

    Signals (SIGTERM, SIGINT; see :func:`mindspeed_ha.launch.survivors.on_termination_signal`):
    with the HA flag the first one starts a graceful stop; the next one (the first without
    the flag) torchrun's shutdown; any later one SIGKILLs every descendant at once. This
    process is a child subreaper (:func:`mindspeed_ha.launch.proctree.become_subreaper`)
    and, after a signal (a graceful stop too), ends whatever is left of its tree before it
    exits.
    """
    from mindspeed_ha.teardown import skip_final_collection

    skip_final_collection()  # first: it runs after every other exit handler
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        level = checks.log_level()
        checks.check_env()
    except ConfigError as exc:  # before torch is even imported: nothing started
        print(f"mindspeed-ha-run: error: {exc}", file=sys.stderr, flush=True)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _early_signal)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    proctree.become_subreaper()
    try:
        parsed = _parse(argv)
    except ConfigError as exc:
        print(f"mindspeed-ha-run: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if parsed is None:
        return 2
    from torch.distributed.elastic.multiprocessing.api import SignalException

    survivors.install_signals()
    try:
        return _launch(argv, *parsed)
    except SignalException as exc:
        survivors.say(f"stopped by {exc.sigval.name} (exit {128 + int(exc.sigval)})")
        return 128 + int(exc.sigval)
    finally:
        if survivors.signalled():  # whatever a worker left behind (it runs in a session of its own)
            left = proctree.end_tree()
            if left:
                survivors.say(f"processes {left} still there after SIGKILL (uninterruptible sleep?)")
            for sig in (signal.SIGTERM, signal.SIGINT):  # ending anyway: the exit status stays as it is
                signal.signal(sig, signal.SIG_IGN)  # (a Python handler is undone while the interpreter exits)


def _launch(argv, targs, ns) -> int:
    """The job: plain torchrun without the HA flag, else the control plane and torchrun
    with the HA agent; the exit status."""
    from mindspeed_ha.launch import forked

    with forked.forked_workers(_forkserver_wanted()):
        return _launch_job(argv, targs, ns)


def _forkserver_wanted() -> bool:
    """``MINDSPEED_HA_FORKSERVER=1`` (checked by ``check_env``) on a launcher that is a child
    subreaper (a forked worker must become its child); a warning when it is not."""
    if os.environ.get(ha_env.FORKSERVER, "").strip() != "1":
        return False
    if not proctree.is_subreaper():
        log.warning("%s=1: this launcher is not a child subreaper (not Linux?): workers start as torchrun "
                    "starts them", ha_env.FORKSERVER)
        return False
    return True


def _launch_job(argv, targs, ns) -> int:
    from mindspeed_ha.integrations.mindspeed_llm import ours

    try:
        ha = getattr(ns, "enable_high_availability", False) and ours()  # mindio_ttp chosen: plain torchrun
    except ConfigError as exc:  # MINDSPEED_HA_PROVIDER
        print(f"mindspeed-ha-run: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if not ha:
        from torch.distributed.run import run

        run(targs)
        return 0
    try:
        plane = _start_control_plane(targs, ns)
    except ConfigError as exc:  # before any worker starts: nothing is lost
        print(f"mindspeed-ha-run: error: {exc}", file=sys.stderr, flush=True)
        return 2
    state = _survivors(plane, targs)
    relay = _start_relay(targs, plane)
    watch = None
    if plane.lease is not None and plane.controller is None:
        watch = standby.Standby(state, plane.lease, plane.config, _world_size(targs), int(targs.node_rank))
    try:
        if plane.link is not None:
            try:
                state.first_incarnations = _hello(plane.link, targs, plane.config)
            except Exception as exc:  # AgentLinkError: refused / no controller; nothing started
                print(f"mindspeed-ha-run: error: {exc}", file=sys.stderr, flush=True)
                return 2
        agent = _reboot_agent(targs, argv, state) if plane.config.worker_reboot else None
        survivors.install(state)
        return _run_job(targs, agent, plane, state)
    finally:
        _close(state, watch)
        if relay is not None:
            relay.close()


if __name__ == "__main__":
    sys.exit(main())
