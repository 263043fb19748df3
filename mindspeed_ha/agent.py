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
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from string import Template
from typing import Any, Dict, List, Optional, Set, Union

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.events import EventSource, record
from torch.distributed.elastic.multiprocessing import Std, SubprocessContext, to_map
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler
from torch.distributed.elastic.multiprocessing.tail_log import TailLog

from mindspeed_ha import faults

log = logging.getLogger("mindspeed_ha.agent")

#: the worker's incarnation: unset (0) for the workers torchrun started, n for the n-th restart of its rank
ENV_INCARNATION = "MINDSPEED_HA_INCARNATION"
#: restarts per rank when ``--max-restarts`` is not given (torchrun's default, 0, would make
#: ``--enable-worker-reboot`` a no-op)
DEFAULT_RESTARTS_PER_RANK = 3
#: exit codes that are mindspeed-ha's verdicts on the job, never restarted
HA_VERDICTS = frozenset({faults.EXIT_DYING_CHECKPOINT_SAVED, faults.EXIT_NO_COMPLETE_DATA,
                         faults.EXIT_FAULT_UNRECOVERABLE, faults.EXIT_CONTROLLER_LOST,
                         faults.EXIT_FAILED_BEFORE_TRAINING})


class RestartHooks:
    """What :class:`WorkerRebootAgent` asks and tells its owner. These defaults refuse
    nothing and tell no one; ``mindspeed-ha-run`` passes its own (duck-typed: any object
    with these methods)."""

    def restart_refused(self, rank: int, exitcode: int) -> Optional[str]:
        """None if global ``rank``, which exited with ``exitcode``, may be restarted, else why not."""
        return None

    def restarted(self, rank: int, incarnation: int, pid: int, exitcode: int) -> None:
        """``rank`` runs again as ``pid``, its ``incarnation``-th restart (the previous
        process exited with ``exitcode``)."""

    def supervise(self, pcontext: SubprocessContext) -> None:
        """Called at every monitor turn while restarts are possible, before the workers are polled."""

    def abandoned(self, rank: int, why: str) -> None:
        """Dead ``rank`` will not be restarted, for the reason ``why`` (the agent hands over
        to torch's monitoring)."""


@dataclasses.dataclass(frozen=True)
class Restart:
    """One restart: global rank, local rank, incarnation (1 = first restart), new pid, the
    previous incarnation's exit code (negative: killed by that signal)."""

    rank: int
    local_rank: int
    incarnation: int
    pid: int
    exitcode: int


def incarnation_path(path: str, incarnation: int) -> str:
    """``.../1/stdout.log`` -> ``.../1/stdout.incarnation2.log``; the console (``""``) and
    ``os.devnull`` stay as they are."""
    if not path or path == os.devnull or incarnation == 0:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.incarnation{incarnation}{ext}"


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

    Raises:
        ValueError: ``restarts_per_rank`` < 0.
    """

    def __init__(self, spec, logs_specs, *, restarts_per_rank: int = DEFAULT_RESTARTS_PER_RANK,
                 hooks: Optional[Any] = None, tee: Union[Std, Dict[int, Std]] = Std.NONE,
                 local_ranks_filter: Optional[Set[int]] = None, **kwargs):
        if restarts_per_rank < 0:
            raise ValueError(f"restarts_per_rank={restarts_per_rank}: expected >= 0 (--max-restarts)")
        super().__init__(spec, logs_specs, **kwargs)
        self.restarts_per_rank = restarts_per_rank
        self.hooks = hooks if hooks is not None else RestartHooks()
        self._tee = to_map(tee, spec.local_world_size)
        self._local_ranks_filter = local_ranks_filter
        self.restarts: List[Restart] = []  # every restart of the agent's life, oldest first
        self._incarnation: Dict[int, int] = {}  # local rank -> incarnation of its current process
        self._tails: List[TailLog] = []
        self._handed_over = False

    # ------------------------------------------------------------------ torch's hooks
    def _start_workers(self, worker_group: WorkerGroup) -> Dict[int, Any]:
        """torch's start of the whole group (a new attempt): incarnations start again at 0."""
        self._stop_tails()
        pids = super()._start_workers(worker_group)
        self._incarnation = {local_rank: 0 for local_rank in pids}
        self._handed_over = not isinstance(self._pcontext, SubprocessContext)
        if self._handed_over:
            log.warning("--enable-worker-reboot: workers of a function entrypoint (%s) cannot be restarted one "
                        "by one; a failure ends the group as in torchrun", type(self._pcontext).__name__)
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """HEALTHY while every worker runs or was restarted; otherwise torch's own result."""
        pc = self._pcontext
        if self._handed_over:
            return self._torch_monitor(worker_group)
        self.hooks.supervise(pc)
        codes = {local_rank: h.proc.poll() for local_rank, h in pc.subprocess_handlers.items()}
        for local_rank, code in sorted(codes.items()):
            if code in (None, 0):
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
        if all(code == 0 for code in codes.values()):  # final: torch's poll sees the same and succeeds
            return self._torch_monitor(worker_group)
        timeout = self._uninterruptible_state_timeout
        if timeout > 0:
            stuck = self._check_uninterruptible_state_timeout(worker_group, timeout)
            if stuck is not None:
                self._handed_over = True
                return stuck
        return RunResult(state=WorkerState.HEALTHY)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        super()._shutdown(death_sig, timeout)  # ends the replacements too: they are in the context
        self._stop_tails()

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
        if self._incarnation[local_rank] >= self.restarts_per_rank:
            return f"restarted {self._incarnation[local_rank]} times already (limit per rank: --max-restarts " \
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
        env = dict(pc.envs[local_rank])
        env[ENV_INCARNATION] = str(n)
        stdout = incarnation_path(pc.stdouts[local_rank], n)
        stderr = incarnation_path(pc.stderrs[local_rank], n)
        error_file = incarnation_path(pc.error_files.get(local_rank, ""), n)
        if env.get("TORCHELASTIC_ERROR_FILE"):
            env["TORCHELASTIC_ERROR_FILE"] = error_file
        handler = get_subprocess_handler(entrypoint=pc.entrypoint, args=pc.args[local_rank], env=env, stdout=stdout,
                                         stderr=stderr, local_rank_id=local_rank,
                                         numa_options=worker_group.spec.numa_options)
        pc.subprocess_handlers[local_rank] = handler
        pc.envs[local_rank], pc.stdouts[local_rank], pc.stderrs[local_rank] = env, stdout, stderr
        if local_rank in pc.error_files:
            pc.error_files[local_rank] = error_file
        old_pid, worker.id = worker.id, handler.proc.pid
        self._incarnation[local_rank] = n
        self._tail(worker_group, local_rank, stdout, stderr)
        record(self._construct_event("START", EventSource.WORKER, worker), worker_group.spec.event_log_handler)
        restart = Restart(worker.global_rank, local_rank, n, handler.proc.pid, code)
        self.restarts.append(restart)
        log.warning("worker rank %d (pid %d) exited with %d: restarted alone as pid %d, incarnation %d (%d of %d "
                    "restarts of this rank)", worker.global_rank, old_pid, code, handler.proc.pid, n, n,
                    self.restarts_per_rank)
        self.hooks.restarted(worker.global_rank, n, handler.proc.pid, code)

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
