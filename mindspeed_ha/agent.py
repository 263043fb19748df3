"""The elastic agent of ``mindspeed-ha-run --enable-worker-reboot``: restart only the worker that died.

torchrun restarts the whole local worker group when one worker fails
(torch 2.13 ``torch/distributed/elastic/agent/server/api.py``,
``SimpleElasticAgent._invoke_run``: a FAILED or UNHEALTHY group goes through
``_restart_workers``, which is ``_stop_workers`` (``LocalElasticAgent._shutdown``:
SIGTERM to every worker, SIGKILL after ``shutdown_timeout``) then a new rendezvous and
``_start_workers``, while ``--max-restarts`` is left, every new worker having
``TORCHELASTIC_RESTART_COUNT`` + 1). Its process context cannot restart one process:
``start_processes`` (``torch/distributed/elastic/multiprocessing/__init__.py``) starts all
local workers of an attempt at once, and ``SubprocessContext._poll``
(``multiprocessing/api.py``) closes every worker as soon as one failed.

:class:`WorkerRebootAgent` keeps torch's agent and process context for everything but
the restart of one worker:

* The group starts as torchrun's does (``LocalElasticAgent._start_workers``: same env,
  same log files, same ``SubprocessContext``).
* :meth:`WorkerRebootAgent._monitor_workers` polls each worker's process itself (it does
  not call the context's ``_poll`` while it may still restart a worker: that poll would
  record the dead worker as the group's failure and close the others). A worker that
  exited non-zero or by a signal is started again, alone, with torch's own
  ``get_subprocess_handler`` (``multiprocessing/subprocess_handler/handlers.py``, the
  ``Popen`` wrapper ``SubprocessContext`` uses: its own session, the parent's environment
  plus the worker's): the same argv, the same env (``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, every ``TORCHELASTIC_*``) plus
  ``MINDSPEED_HA_INCARNATION=n`` (1 for the first restart); stdout/stderr go where
  torchrun sent the dead worker's, ``stdout.log`` becoming ``stdout.incarnation<n>.log``
  (same for ``stderr.log`` and ``error.json``; the console stays the console), and a
  ``--tee``'d stream is tailed to the console with torch's ``TailLog`` and the same line
  prefix. The other workers are not touched: their PIDs do not change.
* The replacement's handler takes the dead one's place in the context's public
  ``subprocess_handlers`` / ``envs`` / ``stdouts`` / ``stderrs`` / ``error_files`` maps
  (and ``Worker.id``). So everything torch does with the context afterwards applies to
  the current processes unchanged: ``pids()``, ``close()`` (SIGTERM, ``shutdown_timeout``,
  SIGKILL, in ``_shutdown`` on success, failure or a signal), the failure record and
  error file of a final failure. (Starting each worker in its own one-process context
  instead would not work with ``DefaultLogsSpecs.reify``, which names and empties the
  log directories per context.)
* Restarts are bounded per rank (``restarts_per_rank``, the launcher's reading of
  ``--max-restarts``). When a dead worker may not be restarted (limit reached, a
  mindspeed-ha verdict exit code 75..79, or the owner's hooks refuse: the controller
  decided the dying checkpoint, a graceful stop is under way) the agent hands over to
  torch's own monitoring for the rest of the attempt: the context's ``_poll`` (in
  ``mindspeed-ha-run``, its dying-checkpoint patch: the survivors finish and exit 75)
  and, once it reports the failure, no group restart (``_remaining_restarts`` is set to
  0, as torch itself does for a worker stuck in uninterruptible sleep).

``_invoke_run`` and ``_restart_workers`` stay torch's: the loop still sleeps
``monitor_interval`` (torchrun's ``--monitor-interval``, default 0.1 s) and calls
``_monitor_workers``; a restart of one worker happens inside ``_monitor_workers``, which
then reports HEALTHY, so ``_invoke_run`` never sees that failure. torch's group restarts
for membership changes (``num_nodes_waiting`` on a multi-node
job) still happen; they start a new context, and the incarnation count starts again.

What a restarted process finds (for the rejoin): the env of the worker it replaces,
``TORCHELASTIC_RESTART_COUNT`` included (it counts torch's group attempts, not
restarts), plus ``MINDSPEED_HA_INCARNATION`` >= 1 and its own ``TORCHELASTIC_ERROR_FILE``;
the launcher's env (``MINDSPEED_HA_AUTH_KEY``, ``TTP_PORT``). With
``TORCHELASTIC_USE_AGENT_STORE=True`` (torchrun's c10d and static rendezvous) the TCPStore
at ``MASTER_ADDR:MASTER_PORT`` is hosted by node 0's agent and still holds the keys the
first ``init_process_group`` wrote (torch 2.13 ``torch/distributed/rendezvous.py``,
``_create_c10d_store``: every worker is a client): joining again needs new, per-generation
group names / store prefixes, not a second plain ``init_process_group``.

Only binary entrypoints (torchrun's ``python -u ...``: a ``SubprocessContext``) can be
restarted one by one; a function entrypoint (``MultiprocessContext``) runs as torchrun
would, with a warning.

Warm spare (``MINDSPEED_HA_WARM_SPARES=1`` in the launcher's env): when the workers start
the agent also starts ONE parked ``python -u -m mindspeed_ha.spare`` per node (see that
module: it has imported torch, torch.distributed, megatron.core and mindspeed_ha's patches,
not the user's script, and waits for one length-prefixed JSON message on its stdin). A
restart then sends the spare the dead worker's ``mindspeed_ha.boot`` argv, its complete env
(the agent's env plus the worker's, as torch's ``SubprocessHandler`` builds it, with the new
``MINDSPEED_HA_INCARNATION`` and error file) and its per-incarnation log files (created by
the agent, as torch's handler opens them); the spare's process becomes the worker's, in
the context's maps like any replacement (:class:`SpareHandler` has torch's handler shape:
``.proc``, ``.close(death_sig)``), and a new spare is started for the next restart. No
live spare (not started yet, died, or disabled): the restart starts a new process as
above. The spare is ended (SIGKILL to its process group) by ``_shutdown`` and, should the
agent die, ends itself on EOF of its stdin. Spares are only used when the workers run
``python [-u] -m mindspeed_ha.boot`` (``mindspeed-ha-run``) without NUMA binding.
"""

from __future__ import annotations

from mindspeed_ha import env as ha_env
import logging
import os
import signal
import subprocess
import sys
from string import Template
from typing import Any, Dict, List, Optional, Set, Tuple, Union

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.events import EventSource, record
from torch.distributed.elastic.multiprocessing import Std, SubprocessContext, to_map
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
from torch.distributed.elastic.multiprocessing.tail_log import TailLog

from mindspeed_ha import faults, spare
from mindspeed_ha.launch import forked
from mindspeed_ha.spare import BOOT_MODULE, boot_argv

log = logging.getLogger("mindspeed_ha.agent")

#: the worker's incarnation: unset (0) for the workers torchrun started, n for the n-th restart of its rank
ENV_INCARNATION = ha_env.INCARNATION
#: ``1`` in the launcher's env: keep one warm spare process per node (see the module docstring)
ENV_WARM_SPARES = ha_env.WARM_SPARES
#: the module every worker of ``mindspeed-ha-run`` runs
#: restarts per rank when ``--max-restarts`` is not given (torchrun's default, 0, would make
#: ``--enable-worker-reboot`` a no-op)
DEFAULT_RESTARTS_PER_RANK = 3
#: exit codes that are mindspeed-ha's verdicts on the job, never restarted
HA_VERDICTS = frozenset({faults.EXIT_DYING_CHECKPOINT_SAVED, faults.EXIT_NO_COMPLETE_DATA,
                         faults.EXIT_FAULT_UNRECOVERABLE, faults.EXIT_CONTROLLER_LOST,
                         faults.EXIT_FAILED_BEFORE_TRAINING})


#: the exit code told to the hooks (``RestartHooks.restarted``) for a rank whose process was
#: lost with its node and is started by a replacement launcher (its exit was never seen)
LOST_EXITCODE = -1


class RestartHooks:
    """What :class:`WorkerRebootAgent` asks and tells its owner. These defaults refuse
    nothing and tell no one; ``mindspeed-ha-run`` passes its own (duck-typed: any object
    with these methods)."""

    def restart_refused(self, rank: int, exitcode: int) -> Optional[str]:
        """None if global ``rank``, which exited with ``exitcode``, may be restarted, else why not."""
        return None

    def restarted(self, rank: int, incarnation: int, pid: int, exitcode: int) -> None:
        """``rank`` runs again as ``pid``, its ``incarnation``-th restart (the previous
        process exited with ``exitcode``; ``LOST_EXITCODE``: never seen, lost with its node)."""

    def supervise(self, pcontext: SubprocessContext) -> None:
        """Called at every monitor turn while restarts are possible, before the workers are polled."""

    def skip_exit_barrier(self) -> Optional[str]:
        """Why the agent should not wait in torch's exit barrier, or None (it waits)."""
        return None

    def first_incarnation(self, rank: int) -> int:
        """The incarnation the first process of global ``rank`` in this agent starts as
        (0; n >= 1 for a replacement launcher's workers, which rejoin a running job)."""
        return 0

    def abandoned(self, rank: int, why: str) -> None:
        """Dead ``rank`` will not be restarted, for the reason ``why`` (the agent hands over
        to torch's monitoring)."""

    def spare_changed(self, pid: Optional[int]) -> None:
        """This node's warm spare is now process ``pid`` (None: none parked: adopted, ended)."""

    def switch_wanted(self) -> Dict[int, str]:
        """Hot switch: global rank -> ``start`` (start its new process), ``keep`` (keep it),
        ``commit`` (it takes the old process's place once that one exited 0); a rank not
        listed: end its new process. None here."""
        return {}

    def switch_report(self, what: str, rank: int, value: Any) -> None:
        """Hot switch: the new process of ``rank`` ``started`` (value: pid), is ``gone``
        (value: why) or ``switched`` (value: pid; it took the old process's place)."""


def incarnation_path(path: str, incarnation: int) -> str:
    """``.../1/stdout.log`` -> ``.../1/stdout.incarnation2.log``; the console (``""``) and
    ``os.devnull`` stay as they are."""
    if not path or path == os.devnull or incarnation == 0:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.incarnation{incarnation}{ext}"


class SpareHandler(SubprocessHandler):
    """A parked ``python -u -m mindspeed_ha.spare`` process, in the shape of torch's
    ``SubprocessHandler`` (``.proc``, ``.local_rank_id``, ``.close(death_sig)``) so that,
    once adopted, the process context treats it as any worker's.

    Args:
        entrypoint: the workers' interpreter (torchrun's ``sys.executable``).
        sys_path: directory put first on the spare's ``sys.path`` (the script's), or None.

    Its stdout/stderr are the agent's until :meth:`adopt` (the spare redirects them itself);
    its env is the agent's; its own session, as torch's workers.
    """

    def __init__(self, entrypoint: str, sys_path: Optional[str] = None):  # noqa: D107 (torch's __init__ starts a worker)
        self._stdout = self._stderr = None
        self.local_rank_id = -1
        cmd = [entrypoint, "-u", "-m", "mindspeed_ha.spare"] + (["--sys-path", sys_path] if sys_path else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True)

    def adopt(self, local_rank: int, message: bytes) -> None:
        """Make the spare local rank ``local_rank`` with ``message`` (:func:`mindspeed_ha.spare.encode`).

        Raises:
            OSError: the spare is gone (BrokenPipeError) or its pipe cannot be written.
        """
        self.local_rank_id = local_rank
        stdin = self.proc.stdin
        try:
            stdin.write(message)
            stdin.flush()
        finally:
            self._close_stdin()

    def close(self, death_sig: Optional[signal.Signals] = None) -> None:
        self._close_stdin()
        super().close(death_sig)

    def _close_stdin(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:  # a broken pipe while flushing: the spare is gone
            pass


class WorkerRebootAgent(LocalElasticAgent):
    """torchrun's ``LocalElasticAgent`` that restarts a dead worker alone (see the module docstring).

    Args:
        spec, logs_specs, **kwargs: as ``LocalElasticAgent`` (torchrun's ``launch_agent``
            passes them).
        restarts_per_rank: restarts of each rank before the agent gives up (>= 0).
        hooks: see :class:`RestartHooks` (default: refuse nothing, tell no one).
        tee: torchrun's ``--tee`` (``Std`` or a map local rank -> ``Std``): which
            streams of a replacement are tailed to the console.
        local_ranks_filter: torchrun's ``--local-ranks-filter`` (None: every local rank).
        warm_spares: keep one warm spare process (see the module docstring); None (default):
            ``MINDSPEED_HA_WARM_SPARES=1`` in the environment.

    Raises:
        ValueError: ``restarts_per_rank`` < 0.
    """

    def __init__(self, spec, logs_specs, *, restarts_per_rank: int = DEFAULT_RESTARTS_PER_RANK,
                 hooks: Optional[Any] = None, tee: Union[Std, Dict[int, Std]] = Std.NONE,
                 local_ranks_filter: Optional[Set[int]] = None, warm_spares: Optional[bool] = None, **kwargs):
        if restarts_per_rank < 0:
            raise ValueError(f"restarts_per_rank={restarts_per_rank}: expected >= 0 (--max-restarts)")
        super().__init__(spec, logs_specs, **kwargs)
        self.restarts_per_rank = restarts_per_rank
        self.hooks = hooks if hooks is not None else RestartHooks()
        self._tee = to_map(tee, spec.local_world_size)
        self._local_ranks_filter = local_ranks_filter
        self._incarnation: Dict[int, int] = {}  # local rank -> incarnation of its current process
        self._first: Dict[int, int] = {}  # local rank -> incarnation its first process starts as
        self._tails: List[TailLog] = []
        self._handed_over = False
        if warm_spares is None:
            warm_spares = os.environ.get(ENV_WARM_SPARES, "").strip() == "1"
        self.warm_spares = warm_spares
        self._spare: Optional[SpareHandler] = None
        #: hot switch: local rank -> (its new process's handler, incarnation, env, stdout, stderr, error file)
        self._incoming: Dict[int, Tuple[Any, int, Dict[str, str], str, str, str]] = {}
        self._switched: Dict[int, int] = {}  # local rank -> incarnations taken by hot switches (not restarts)

    # ------------------------------------------------------------------ torch's hooks
    def _start_workers(self, worker_group: WorkerGroup) -> Dict[int, Any]:
        """torch's start of the whole group (a new attempt): incarnations start again at 0."""
        self._stop_tails()
        self._first = {w.local_rank: int(self.hooks.first_incarnation(w.global_rank)) for w in worker_group.workers}
        pids = super()._start_workers(worker_group)
        self._incarnation = {local_rank: self._first.get(local_rank, 0) for local_rank in pids}
        for w in worker_group.workers:  # a replacement launcher's workers: restarts of a lost node's ranks
            n = self._incarnation.get(w.local_rank, 0)
            if n > 0:
                self.hooks.restarted(w.global_rank, n, pids[w.local_rank], LOST_EXITCODE)
        self._handed_over = not isinstance(self._pcontext, SubprocessContext)
        if self._handed_over:
            log.warning("--enable-worker-reboot: workers of a function entrypoint (%s) cannot be restarted one "
                        "by one; a failure ends the group as in torchrun", type(self._pcontext).__name__)
        elif self.warm_spares:
            self._start_spare(worker_group)
        return pids

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """torch's rendezvous; under torchrun's static rendezvous node 0's agent makes the
        store torch would (torch 2.13 ``StaticTCPRendezvous.next_rendezvous``: ``TCPStore(
        master_addr, master_port, world_size, True, timeout, multi_tenant=True)``) but
        listening on ``--master-addr`` only, not on every interface
        (:func:`mindspeed_ha.launch.stores.tcp_store`). For a replacement launcher of node 0
        (its workers rejoin a running job, ``RestartHooks.first_incarnation`` > 0) it is made
        without waiting for the other agents to connect: they connected to the lost one
        once and never come again, so it would wait out the rendezvous timeout."""
        handler = worker_group.spec.rdzv_handler
        lws = worker_group.spec.local_world_size
        if (type(handler).__name__ == "StaticTCPRendezvous" and getattr(handler, "rank", None) == 0
                and getattr(handler, "_store", "absent") is None):  # node 0: ranks 0..lws-1
            from mindspeed_ha.launch.stores import tcp_store

            rejoining = any(self.hooks.first_incarnation(i) for i in range(lws))
            handler._store = tcp_store(handler.master_addr, handler.master_port, handler.world_size,
                                       handler.timeout, multi_tenant=True, wait_for_workers=not rejoining)
        super()._rendezvous(worker_group)

    def _exit_barrier(self) -> None:
        """torch's exit barrier (every agent waits for the others in the rendezvous store),
        unless the owner's hooks say why not (``RestartHooks.skip_exit_barrier``)."""
        why = self.hooks.skip_exit_barrier()
        if why:
            log.info("exit barrier skipped: %s", why)
            return
        super()._exit_barrier()

    def _set_local_rank_env(self, worker_env, local_rank: int, spec) -> None:
        """torch's per-worker env, plus ``MINDSPEED_HA_INCARNATION`` for a worker that
        starts as a rejoining incarnation (``RestartHooks.first_incarnation``)."""
        super()._set_local_rank_env(worker_env, local_rank, spec)
        if self._first.get(local_rank, 0) > 0:
            worker_env[ENV_INCARNATION] = str(self._first[local_rank])

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """HEALTHY while every worker runs or was restarted; otherwise torch's own result."""
        pc = self._pcontext
        if self._handed_over:
            return self._torch_monitor(worker_group)
        self.hooks.supervise(pc)
        self._switches(worker_group)
        codes = {local_rank: h.proc.poll() for local_rank, h in pc.subprocess_handlers.items()}
        for local_rank, code in sorted(codes.items()):
            if code in (None, 0) or local_rank in self._incoming:
                # a hot switch's rank (its new process there): the controller decides on a death
                # of its old process (its replica fallback commits the new one; else the switch
                # ends, its new process goes, and this death is handled at the next turn)
                continue
            why = self._refusal(worker_group, local_rank, code)
            if why is not None:
                worker = worker_group.workers[local_rank]
                log.error("worker rank %d (pid %d, incarnation %d) exited with %d; not restarted: %s",
                          worker.global_rank, worker.id, self._incarnation[local_rank], code, why)
                abandoned = getattr(self.hooks, "abandoned", None)
                if abandoned is not None:
                    abandoned(worker.global_rank, why)
                self._handed_over = True
                return self._torch_monitor(worker_group)
            self._restart_one(worker_group, local_rank, code)
        if all(code == 0 for code in codes.values()) and not self._incoming:
            # final: torch's poll sees the same and succeeds (not while a hot switch's new process
            # is there: on another node its old process may exit 0 before the commit view arrives)
            return self._torch_monitor(worker_group)
        timeout = self._uninterruptible_state_timeout
        if timeout > 0:
            stuck = self._check_uninterruptible_state_timeout(worker_group, timeout)
            if stuck is not None:
                self._handed_over = True
                return stuck
        return RunResult(state=WorkerState.HEALTHY)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        try:
            super()._shutdown(death_sig, timeout)  # ends the replacements too: they are in the context
        finally:
            incoming, self._incoming = self._incoming, {}
            for handler, *_ in incoming.values():  # a hot switch's new process not switched in
                self._end_spare(handler)
            self._stop_spare()
            self._stop_tails()

    # ------------------------------------------------------------------ hot switch
    def _switches(self, worker_group: WorkerGroup) -> None:
        """Every monitor turn (hot switch, what ``hooks.switch_wanted`` says per rank): start
        the new processes asked for, report those that died, end those no longer wanted, and
        put a committed one in its old process's place once that one exited 0 (not a restart:
        no restart is counted, only the PID changes), also when the new one has already ended
        its training with exit 0, and when the old one died in its handoff (the controller's
        replica fallback repaired the new one: committed all the same)."""
        pc = self._pcontext
        wanted = self.hooks.switch_wanted()
        for local_rank, (handler, n, env, stdout, stderr, error_file) in sorted(self._incoming.items()):
            worker = worker_group.workers[local_rank]
            want, code = wanted.get(worker.global_rank), handler.proc.poll()
            old_code = pc.subprocess_handlers[local_rank].proc.poll()
            # a switch committed in the last iterations: the new process may end its training
            # (exit 0) before this turn sees its old process's exit; it takes the place all the same
            finished = want == "commit" and code == 0
            if finished and old_code is None:
                continue
            if (code is not None and not finished) or want is None:
                del self._incoming[local_rank]
                self._end_spare(handler)
                why = (f"its new process (pid {handler.proc.pid}) exited with {code}" if code is not None
                       else f"its new process (pid {handler.proc.pid}) was ended: the switch is over")
                log.warning("hot switch of rank %d: %s", worker.global_rank, why)
                self.hooks.switch_report("gone", worker.global_rank, why)
            elif want == "commit" and old_code is not None:
                del self._incoming[local_rank]
                old_pid, old = worker.id, pc.subprocess_handlers[local_rank]
                try:  # what is left of its process group (e.g. data loader workers), and its log files
                    old.close(death_sig=signal.SIGKILL)
                except ProcessLookupError:
                    pass
                pc.subprocess_handlers[local_rank] = handler
                env = {k: v for k, v in env.items() if k != ha_env.SWITCH}  # a later restart is a plain one
                pc.envs[local_rank], pc.stdouts[local_rank], pc.stderrs[local_rank] = env, stdout, stderr
                if local_rank in pc.error_files:
                    pc.error_files[local_rank] = error_file
                worker.id = handler.proc.pid
                self._incarnation[local_rank] = n
                record(self._construct_event("START", EventSource.WORKER, worker), worker_group.spec.event_log_handler)
                log.warning("hot switch: worker rank %d (pid %d) switched out with exit %d; pid %d (incarnation %d) "
                            "is the rank now", worker.global_rank, old_pid, old_code, handler.proc.pid, n)
                self.hooks.switch_report("switched", worker.global_rank, handler.proc.pid)
        for worker in worker_group.workers:
            if wanted.get(worker.global_rank) == "start" and worker.local_rank not in self._incoming:
                self._start_incoming(worker_group, worker.local_rank)

    def _start_incoming(self, worker_group: WorkerGroup, local_rank: int) -> None:
        """Start the next incarnation of ``local_rank`` beside its running process (hot
        switch): its argv and env, ``MINDSPEED_HA_SWITCH=1``, from the warm spare when one is parked."""
        worker = worker_group.workers[local_rank]
        n = self._incarnation[local_rank] + 1
        self._incarnation[local_rank] = n  # the number is taken, whatever becomes of this process
        self._switched[local_rank] = self._switched.get(local_rank, 0) + 1
        handler, warm, env, stdout, stderr, error_file = self._start_incarnation(
            worker_group, local_rank, n, {ha_env.SWITCH: "1"})
        self._incoming[local_rank] = (handler, n, env, stdout, stderr, error_file)
        self._tail(worker_group, local_rank, stdout, stderr)
        log.warning("hot switch: rank %d (pid %d) gets a new process beside it: pid %d%s, incarnation %d",
                    worker.global_rank, worker.id, handler.proc.pid, " (warm spare)" if warm else "", n)
        self.hooks.switch_report("started", worker.global_rank, handler.proc.pid)
        if warm:
            self._start_spare(worker_group)  # for the next restart or switch

    # ------------------------------------------------------------------ restarts
    def _torch_monitor(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._remaining_restarts = 0  # the per-rank budget replaces torchrun's group restarts
        return result

    def _refusal(self, worker_group: WorkerGroup, local_rank: int, code: int) -> Optional[str]:
        rank = worker_group.workers[local_rank].global_rank
        if code in HA_VERDICTS:
            return f"exit code {code} is a mindspeed-ha verdict on the job"
        if self._incarnation[local_rank] - self._switched.get(local_rank, 0) >= self.restarts_per_rank:
            return f"restarted {self._incarnation[local_rank] - self._switched.get(local_rank, 0)} times already (limit per rank: --max-restarts " \
                   f"{self.restarts_per_rank})"
        return self.hooks.restart_refused(rank, code)

    def _restart_one(self, worker_group: WorkerGroup, local_rank: int, code: int) -> None:
        """Start ``local_rank`` again, alone, in its place in the process context."""
        pc = self._pcontext
        worker = worker_group.workers[local_rank]
        old = pc.subprocess_handlers[local_rank]
        n = self._incarnation[local_rank] + 1
        # What is left of the dead incarnation's process group (its children, e.g. data loader
        # workers) goes before the new one starts, as torch's close() would end it; this also
        # closes the dead worker's log files.
        try:
            old.close(death_sig=signal.SIGKILL)
        except ProcessLookupError:
            pass
        handler, warm, env, stdout, stderr, error_file = self._start_incarnation(worker_group, local_rank, n, {})
        pc.subprocess_handlers[local_rank] = handler
        pc.envs[local_rank], pc.stdouts[local_rank], pc.stderrs[local_rank] = env, stdout, stderr
        if local_rank in pc.error_files:
            pc.error_files[local_rank] = error_file
        old_pid, worker.id = worker.id, handler.proc.pid
        self._incarnation[local_rank] = n
        self._tail(worker_group, local_rank, stdout, stderr)
        record(self._construct_event("START", EventSource.WORKER, worker), worker_group.spec.event_log_handler)
        log.warning("worker rank %d (pid %d) exited with %d: restarted alone as pid %d%s, incarnation %d (%d of %d "
                    "restarts of this rank)", worker.global_rank, old_pid, code, handler.proc.pid,
                    " (warm spare)" if warm else "", n, n, self.restarts_per_rank)
        self.hooks.restarted(worker.global_rank, n, handler.proc.pid, code)
        if warm:
            self._start_spare(worker_group)  # for the next restart

    def _start_incarnation(self, worker_group: WorkerGroup, local_rank: int, n: int, extra_env: Dict[str, str]):
        """Start incarnation ``n`` of ``local_rank`` (a restart, or a hot switch's new process):
        the worker's argv and env with ``MINDSPEED_HA_INCARNATION=n`` and ``extra_env``, its
        logs and error file per incarnation, from the warm spare when one is parked.
        Returns (handler, warm, env, stdout, stderr, error_file)."""
        pc = self._pcontext
        env = dict(pc.envs[local_rank], **extra_env)
        env[ENV_INCARNATION] = str(n)
        stdout = incarnation_path(pc.stdouts[local_rank], n)
        stderr = incarnation_path(pc.stderrs[local_rank], n)
        error_file = incarnation_path(pc.error_files.get(local_rank, ""), n)
        if env.get("TORCHELASTIC_ERROR_FILE"):
            env["TORCHELASTIC_ERROR_FILE"] = error_file
        handler = self._adopt_spare(worker_group, local_rank, env, stdout, stderr)
        warm = handler is not None
        if handler is None:
            handler = forked.start_handler(entrypoint=pc.entrypoint, args=pc.args[local_rank], env=env,
                                           stdout=stdout, stderr=stderr, local_rank_id=local_rank,
                                           numa_options=worker_group.spec.numa_options)
        return handler, warm, env, stdout, stderr, error_file

    # ------------------------------------------------------------------ warm spare
    def _start_spare(self, worker_group: WorkerGroup) -> None:
        """Start the warm spare unless one is parked or the workers are not ``mindspeed_ha.boot``'s."""
        if self._spare is not None and self._spare.proc.poll() is None:
            return
        pc = self._pcontext
        argv = boot_argv(pc.entrypoint, pc.args[min(pc.args)]) if pc.args else None
        if argv is None or worker_group.spec.numa_options is not None:
            log.warning("%s=1: no warm spare (workers are not `python -m %s ...`, or NUMA binding is on)",
                        ENV_WARM_SPARES, BOOT_MODULE)
            self.warm_spares = False
            return
        sys_path = None if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0]))
        self._spare = SpareHandler(pc.entrypoint, sys_path)
        log.info("warm spare started: pid %d", self._spare.proc.pid)
        self.hooks.spare_changed(self._spare.proc.pid)

    def _adopt_spare(self, worker_group: WorkerGroup, local_rank: int, env: Dict[str, str], stdout: str,
                     stderr: str) -> Optional[SpareHandler]:
        """The parked spare, now ``local_rank`` with ``env`` (the worker's part) and these log
        files, or None (no live spare, or it could not be told)."""
        spare_handler, self._spare = self._spare, None
        if spare_handler is None:
            return None
        self.hooks.spare_changed(None)
        pc = self._pcontext
        argv = boot_argv(pc.entrypoint, pc.args[local_rank])
        if spare_handler.proc.poll() is not None or argv is None:
            log.warning("warm spare (pid %d) unusable (exit code %s): restarting the worker cold; no more spares",
                        spare_handler.proc.pid, spare_handler.proc.returncode)
            self.warm_spares = False
            self._end_spare(spare_handler)
            return None
        try:
            spare_handler.adopt(local_rank, spare.worker_message(argv, env, stdout, stderr))
        except OSError as exc:
            log.warning("warm spare (pid %d) could not be told (%s): restarting the worker cold; no more spares",
                        spare_handler.proc.pid, exc)
            self.warm_spares = False
            self._end_spare(spare_handler)
            return None
        return spare_handler

    def _stop_spare(self) -> None:
        spare_handler, self._spare = self._spare, None
        if spare_handler is not None:
            self.hooks.spare_changed(None)
            self._end_spare(spare_handler)

    @staticmethod
    def _end_spare(spare_handler: SpareHandler) -> None:
        """SIGKILL to the spare's process group, then reap it (a parked spare holds nothing)."""
        try:
            spare_handler.close(death_sig=signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            spare_handler.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # uninterruptible sleep; the kernel ends it later
            log.warning("warm spare pid %d did not end within 10 s of SIGKILL", spare_handler.proc.pid)

    def _tail(self, worker_group: WorkerGroup, local_rank: int, stdout: str, stderr: str) -> None:
        """``--tee``: the replacement's log files to the console, prefixed as torch does."""
        if self._local_ranks_filter and local_rank not in self._local_ranks_filter:
            return
        prefixes = None
        if self._log_line_prefix_template:
            worker = worker_group.workers[local_rank]
            prefixes = {local_rank: Template(self._log_line_prefix_template).safe_substitute(
                role_name=worker_group.spec.role, rank=worker.global_rank, local_rank=local_rank)}
        tee = self._tee.get(local_rank, Std.NONE)
        for bit, path, dst in ((Std.OUT, stdout, sys.stdout), (Std.ERR, stderr, sys.stderr)):
            if tee & bit and path and path != os.devnull:
                self._tails.append(TailLog(worker_group.spec.role, {local_rank: path}, dst, prefixes).start())

    def _stop_tails(self) -> None:
        tails, self._tails = self._tails, []
        for tail in tails:
            tail.stop()
