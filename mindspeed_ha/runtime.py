"""Per-rank HA runtime: the one object the patches talk to.

Step protocol, in the order the training thread calls it (one iteration ``k``):

1. ``train_step`` wrapper enters iteration ``k`` (``current = k``).
2. optimizer wrapper: :meth:`HARuntime.begin_update` (``k``) -> the processor marks the
   optimizer state UPDATING(k); it blocks instead if the controller froze this rank.
3. optimizer wrapper, after the update returned: :meth:`HARuntime.end_update` (``k``) ->
   UPDATED(k); the RNG state is snapshotted (a dying checkpoint of ``k`` needs it).
4. ``train_step`` returns: :meth:`HARuntime.iteration_done` (``k``) (covers skipped
   updates); then the pause point (graceful pause: reserved).
5. Any exception escaping ``train_step`` goes to :meth:`HARuntime.handle_fault`, which
   classifies it, reports it and waits for the controller's action (a dying checkpoint
   runs in the processor's action thread; EXIT ends the process). So does one escaping
   the rest of the run once training started: the training loop around ``train_step``,
   a periodic or the final checkpoint save, evaluation (fault guards in
   ``patches/training.py``); those report the last completed iteration.
"""

from __future__ import annotations

from mindspeed_ha import env as ha_env
import logging
import os
import subprocess
import sys
import threading
from typing import Optional

from mindspeed_ha import dying
from mindspeed_ha.faults import EXIT_DYING_CHECKPOINT_SAVED
from mindspeed_ha.integrations import megatron_lm

log = logging.getLogger("mindspeed_ha.runtime")

ENV_CONTROLLER_HOSTED = ha_env.CONTROLLER_HOSTED
ENV_AUTH_KEY = ha_env.AUTH_KEY
ENV_RECOVERY_LOG = ha_env.RECOVERY_LOG
#: testing only: "1" skips the UCE repair (tests/test_in_place_recovery.py proves the damage is real)
ENV_TESTING_SKIP_REPAIR = ha_env.TESTING_SKIP_REPAIR

#: bytes per rank and exchange over the fallback group (a JSON record: status, layout, digests)
EXCHANGE_BYTES = 4096

_runtime: Optional["HARuntime"] = None
_lock = threading.Lock()


def get_runtime() -> Optional["HARuntime"]:
    return _runtime


def configure(config, args) -> "HARuntime":
    """Create the process's runtime from the parsed Megatron ``args`` (called by the arguments patch)."""
    global _runtime
    with _lock:
        _runtime = HARuntime(config, args)
    return _runtime


def reset() -> None:
    """Forget the runtime (tests)."""
    global _runtime
    with _lock:
        if _runtime is not None:
            _runtime.close()
        _runtime = None


_uncaught = {"code": 0}

#: attribute set on an exception once it was reported (see HARuntime.handle_fault)
_REPORTED = "_mindspeed_ha_reported"
_ACTION = "_mindspeed_ha_action"
ENV_TESTING_CHECK_HOLDERS = ha_env.TESTING_CHECK_HOLDERS  # the controller's answer to the reported fault
#: where a fault is reported with the iteration in progress (see patches/optimizer.py)
_IN_STEP = ("train_step", "update", "update_done")
_WHERE = {"train": "the training loop (between iterations)", "save": "a regular checkpoint save",
          "final_save": "the final checkpoint save", "eval": "evaluation"}


def _check_no_stale_holders(rank: int) -> None:
    """``MINDSPEED_HA_TESTING_CHECK_HOLDERS=1`` (tests): after a rebuild, nothing but
    torch's registries may still hold a replaced group (parallel_state's TP-DP / TP-CP
    groups, DDP buckets, the optimizer, Megatron's timers' barrier group...): raise
    naming them (the recovery then fails and falls back, so a test sees it). A full gc
    walk: ~0.3 s."""
    if os.environ.get(ENV_TESTING_CHECK_HOLDERS) != "1":
        return
    from mindspeed_ha.recovery import groups

    stale = groups.stale_holders(groups.retired_groups())
    if stale:
        raise RuntimeError(f"rank {rank}: {len(stale)} holder(s) still reference a replaced process group: "
                           f"{stale[:8]}")
    log.warning("rank %d: no holder of a replaced process group is left (%s)", rank, ENV_TESTING_CHECK_HOLDERS)


def _check_catch_up_possible(args) -> None:
    """A catch-up step (roll forward with rejoin) answers the forward-backward once:
    megatron-core's rerun state machine must be off (``--rerun-mode disabled``, the
    default), else its validation re-runs and data-iterator checkpoints would differ
    from the survivors'; no batch-size ramp-up (``--rampup-batch-size``: Megatron-LM's
    loop sizes the step from the consumed samples, which the catch-up step holds at j's
    end until it starts). Raises RuntimeError (the job takes the dying checkpoint)."""
    if getattr(args, "rampup_batch_size", None):
        raise RuntimeError("a catch-up step is not exact with --rampup-batch-size")
    try:
        from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine
    except ImportError:  # pragma: no cover - megatron-core always has it
        return
    mode = get_rerun_state_machine().mode
    if mode != RerunMode.DISABLED:
        raise RuntimeError(f"a catch-up step needs --rerun-mode disabled (it is {mode.value})")


def _reported(exc: BaseException) -> bool:
    """Whether ``exc`` or an exception it was raised from or during was reported already."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if getattr(exc, _REPORTED, False):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def record_exit_status(code) -> None:
    """The status the script is exiting with (``SystemExit.code``; the worker entry
    :mod:`mindspeed_ha.boot` calls this), for the GOODBYE and for :func:`_exit_now`."""
    if code is None:
        code = 0
    _uncaught["exit"] = code if isinstance(code, int) else 1


def _exit_now(code: int) -> None:
    """End the process now, skipping the interpreter's teardown.

    After an in-place recovery the old process groups still hold the collectives the
    recovery abandoned (gloo cannot cancel them, see :mod:`mindspeed_ha.recovery.comm`).
    When the peers exit, those fail; during interpreter finalization the waiting thread
    cannot take the GIL back and the C++ runtime calls ``std::terminate`` (measured: exit
    -6 on every rank but the first to leave). Everything the job had to do is done here
    (the atexit hook runs after the script ended, the GOODBYE was sent), so: flush the
    streams and the logging handlers, then ``os._exit``.
    """
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - best effort before _exit
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def _install_exit_hooks() -> None:
    """Say GOODBYE at interpreter exit, so a finished rank is not taken for a dead one."""
    import atexit

    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        _uncaught["code"] = 1
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook

    def goodbye():
        rt = get_runtime()
        if rt is None:
            return
        code = _uncaught["code"] if _uncaught.get("exit") is None else _uncaught["exit"]
        rt.close(code)
        if rt.recoveries:
            _exit_now(code)

    atexit.register(goodbye)
    _install_sigterm_deferral()


def _install_sigterm_deferral() -> None:
    """SIGTERM / SIGINT to a worker start a graceful stop of the whole job.

    How schedulers preempt (Kubernetes, Slurm: SIGTERM, then SIGKILL after a grace
    period, usually 30 s) and what Ctrl-C sends. The handler asks the controller for a
    graceful stop (:meth:`Processor.request_stop`) and returns: training goes on until
    every rank finished the iteration in progress and paused; the checkpoint of the last
    completed iteration is written and the controller's EXIT(75) ends the process. A
    rank already frozen by a fault round (plain torchrun SIGTERMs every worker when one
    fails) just keeps going: the dying checkpoint under way ends it.

    So a SIGTERM to a single worker never stalls the others: the job stops gracefully as
    a whole, within ``--ha-preemption-deadline``. When there is no controller to ask
    (not registered yet, or gone), or none acts within ``heartbeat_timeout_s``, the
    signal's default action runs (exit 143 for SIGTERM, KeyboardInterrupt for SIGINT).
    """
    import signal

    if threading.current_thread() is not threading.main_thread():
        return

    def on_signal(signum, frame):
        rt = get_runtime()
        proc = rt.processor if rt is not None else None
        name = signal.Signals(signum).name
        if proc is not None and proc.request_stop(f"{name} to rank {rt.rank} (pid {os.getpid()})", 128 + signum):
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

class HARuntime:
    def __init__(self, config, args):
        self.config = config
        self.args = args
        self.rank = int(os.environ.get("RANK", "0"))
        self.processor = None
        self.controller_proc = None
        from mindspeed_ha.testing.injector import Injector  # test hooks: loaded only with a runtime

        self.injector = Injector.from_env(self.rank)
        self.layout = None
        self.current: Optional[int] = None  # iteration in progress
        self.completed: Optional[int] = None  # last iteration completed by train_step
        self.snapshot: Optional[dying.IterationSnapshot] = None
        self.ctx: Optional[dying.DyingContext] = None
        self.staged: Optional[int] = None  # iteration of the dying checkpoint this rank writes
        self._update_depth = 0
        # in-place recovery: RNG state at the entry of the step in progress, the data
        # iterators' replay wrappers (id of the wrapped iterator -> wrapper), recoveries done
        self._entry_rng: Optional[dict] = None
        self._replays: dict = {}
        self.recoveries = 0
        self._just_recovered = False
        self._rerun_state: Optional[dict] = None  # Megatron's rerun state machine between iterations
        self.reruns: list = []  # reload: iterations the train_step wrapper re-runs before the step
        self._rejoin_rng: Optional[dict] = None  # ARF: the RNG a restarted process starts its first step with
        # the step in progress's forward-backward losses, gradient norm and zero count (patches/optimizer.py):
        # what a holder hands a process restarted inside this step's update (forward_progress)
        self.step_stats: dict = {}
        self._catch_up: Optional[dict] = None  # ARF roll forward: the progress' forward part, until the first step
        self.catching_up: Optional[dict] = None  # ... during that first step, the catch-up step (enter_iteration)
        self._resume_consumed: Optional[int] = None  # ARF reload: k's consumed samples, set at the first step

    # ---- start-up -------------------------------------------------------------------
    def on_model_parallel_initialized(self) -> None:
        """Compute this rank's layout, agree on the auth key, start the processor."""
        from megatron.core import parallel_state as mpu

        from mindspeed_ha import replica

        n = getattr(self.args, "num_distributed_optimizer_instances", 1) or 1
        dp = mpu.get_data_parallel_world_size(with_context_parallel=True)
        dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
        if getattr(self.args, "use_distributed_optimizer", False):
            instance_id, shard_id = replica.instance_and_shard(dp_rank, dp, n)
            replica_count = n
        else:  # every DP rank holds the whole optimizer state
            instance_id, shard_id, replica_count = dp_rank, 0, dp
        from mindspeed_ha.control.state import Layout

        self.layout = Layout(
            tp_rank=mpu.get_tensor_model_parallel_rank(), tp_size=mpu.get_tensor_model_parallel_world_size(),
            pp_rank=mpu.get_pipeline_model_parallel_rank(), pp_size=mpu.get_pipeline_model_parallel_world_size(),
            dp_rank=dp_rank, dp_size=dp, cp_rank=mpu.get_context_parallel_rank(),
            replica_count=replica_count, instance_id=instance_id, shard_id=shard_id,
            cp_size=mpu.get_context_parallel_world_size(),
        )
        key = self._agree_auth_key()
        self._ensure_controller(key)
        self._start_processor(key)

    def _agree_auth_key(self) -> bytes:
        env = os.environ.get(ENV_AUTH_KEY)
        if env:
            return bytes.fromhex(env)
        # No launcher: rank 0 draws a key and broadcasts it once, at start-up.
        import torch
        import torch.distributed as dist

        from mindspeed_ha.accelerator import collective_device

        buf = torch.zeros(32, dtype=torch.uint8, device=collective_device())
        if dist.get_rank() == 0:
            buf.copy_(torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8))
        dist.broadcast(buf, src=0)
        key = bytes(buf.cpu().tolist())
        os.environ[ENV_AUTH_KEY] = key.hex()
        return key

    def _ensure_controller(self, key: bytes) -> None:
        """Without ``mindspeed-ha-run``, global rank 0 starts the controller as a detached process.

        Detached (own session) so that the controller outlives a SIGKILL of rank 0 and can
        still drive the dying checkpoint; it exits by itself when the job is over.
        """
        if os.environ.get(ENV_CONTROLLER_HOSTED) == "1":
            return
        if self.config.controller_port == 0:
            from mindspeed_ha.config import ConfigError

            raise ConfigError("--ha-controller-port 0 (pick a free port) needs the mindspeed-ha-run launcher")
        if self.rank != 0:
            return
        env = dict(os.environ, **{ENV_AUTH_KEY: key.hex()})
        cmd = [sys.executable, "-m", "mindspeed_ha.control.controller",
               "--world-size", os.environ.get("WORLD_SIZE", "1"),
               "--port", str(self.config.controller_port), "--bind", self.config.controller_addr]
        self.controller_proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        log.info("rank 0 started controller pid %d on port %d", self.controller_proc.pid, self.config.controller_port)

    def _start_processor(self, key: bytes) -> None:
        import dataclasses

        from mindspeed_ha.control.processor import Processor

        config = self.config
        if getattr(config, "auth_key", None) != key:
            config = dataclasses.replace(config, auth_key=key)
            self.config = config
        import torch.distributed as dist

        self.processor = Processor(config, self.rank, self.layout, getattr(self.args, "save", None),
                                   world_size=dist.get_world_size(), exit_handler=self._on_exit)
        # ARF: with --enable-worker-reboot a restarted process of this rank rejoins
        # (recovery/rejoin.py replays its start-up, rejoin_after_setup repairs it)
        self.processor.rejoins = bool(config.worker_reboot)
        for kind, fn in (("verify", self._on_verify), ("dump", self._on_dump), ("assemble", self._on_assemble),
                         ("commit", self._on_commit)):
            self.processor.on_action(kind, fn)
        self._start_fallback_group()
        self.processor.start()
        _install_exit_hooks()

    def attach(self, model, optimizer, opt_param_scheduler) -> None:
        if self.ctx is not None:
            return
        from mindspeed_ha.control.state import Layout

        # Megatron-LM's global args are the validated ones (with --yaml-cfg not even the
        # object parse_args returned); the built-in trainer has none there.
        args = megatron_lm.current_args() or self.args
        lay = self.layout or Layout()
        self.ctx = dying.DyingContext(
            args=args, model=model, optimizer=optimizer, opt_param_scheduler=opt_param_scheduler,
            tp_rank=lay.tp_rank, pp_rank=lay.pp_rank, pp_size=lay.pp_size, shard_id=lay.shard_id,
        )

    # ---- step protocol ----------------------------------------------------------------
    def enter_iteration(self) -> int:
        args = self.ctx.args if self.ctx is not None else self.args
        fwd = self._catch_up if self.completed is None else None
        if fwd is not None:
            # a process restarted inside the update of j: the loop counts step j after this
            # catch-up step (its data iterators were built after j: rejoin_after_setup)
            self._catch_up = None
            args.consumed_train_samples -= int(fwd["samples"])
        if self.completed is None and self._resume_consumed is not None:
            # a process restarted without a replica: its iterators started after the
            # checkpoint it loaded (the re-runs read those batches); the loop counts from k
            args.consumed_train_samples, self._resume_consumed = self._resume_consumed, None
        if self.completed is None:
            # The start-up ends here: its collectives were recorded (a restarted process of
            # this rank replays them) or replayed (this is one), recovery/rejoin.py.
            from mindspeed_ha.recovery import rejoin

            rejoin.startup_done()
            # The state loaded (or initialised): what a save before the first step would write.
            # Every rank enters its first train_step here, so the RNG gather is safe.
            self.completed = int(getattr(self.args, "iteration", 0) or 0)
            self._take_snapshot(self.completed)
            snap = self.snapshot
            snap.rerun_state = megatron_lm.capture_rerun_state()
            snap.scheduler_state = megatron_lm.scheduler_state(getattr(self.ctx, "opt_param_scheduler", None))
            snap.returned = True
            snap.take_args(args, final=True, flops=getattr(args, "num_floating_point_operations_so_far", None))
            if megatron_lm.needs_rng_gather(args):
                snap.rng_states = megatron_lm.gather_rng_states(snap.rng_state, args)
            if self.processor is not None:
                self.processor.end_update(self.completed)
                if fwd is not None:  # the state held is that of j, whose update is caught up below: dirty
                    self.processor.begin_update(self.completed + 1)
            self._capture_rerun_machine()
        elif self.snapshot is not None and self.snapshot.iteration == self.completed:
            # The training loop counted the iteration (consumed samples...): a no-op when
            # Megatron-LM's checkpoint_and_decide_exit already took them (patches/megatron_state.py).
            self.snapshot.take_args(args, final=True)
        # the step about to start, until Megatron's own number is read below: a recovery's
        # abort raised in pause_point is then reported for this step (it has not begun)
        self.current = self.completed + 1
        if self.processor is not None:
            # graceful stop: every rank pauses after the same iteration, where a regular save
            # of it runs (Megatron-LM's loop counted it, saved and evaluated) and before the next
            self.processor.pause_point(self.completed)
        # Megatron-LM's own number of the step (args.curr_iteration, set just before train_step):
        # iterations it skipped (--iterations-to-skip: no train_step) are counted too.
        curr = getattr(args, "curr_iteration", None)
        self.current = curr + 1 if isinstance(curr, int) and curr >= self.completed else self.completed + 1
        if fwd is not None:
            self._start_catch_up(fwd)
        return self.current

    def _start_catch_up(self, fwd: dict) -> None:
        """ARF roll forward, in the restarted process's first step j (the death hit the
        update of j; this process holds the finished state of j and the progress as at
        the entry of j's update, :meth:`rejoin_after_setup`).

        The script's own ``train_step`` and training loop run step j, so this process
        takes part in every collective the survivors run in the rest of step j (Megatron-LM
        core_v0.12.1 ``train_step``: the model-parallel all-reduces of the update's success
        and of the gradient norm; ``train``: the timers' gathers of ``training_log``...)
        and counts it (iteration, consumed samples, FLOPs, scheduler step) as they do. Two
        calls are answered instead of computed: the forward-backward returns the holder's
        losses of j (patches/optimizer.py ``_forward_backward``) and ``optimizer.step()``
        returns (True, the holder's gradient norm, zero count) without touching the state.
        The RNG is the holder's after j's forward-backward (:meth:`begin_attempt`).
        """
        self.catching_up = fwd
        optimizer = self.ctx.optimizer if self.ctx is not None else None
        if optimizer is None:
            raise RuntimeError(f"rank {self.rank}: no optimizer attached for the catch-up step")
        rt = self

        def step(*args, **kwargs):
            optimizer.__dict__.pop("step", None)  # once: the next step is the optimizer's own
            rt.end_update_by_repair()  # UPDATING(j) (since enter_iteration) -> UPDATED(j), snapshot of j
            return True, fwd.get("grad_norm"), fwd.get("num_zeros")

        optimizer.step = step
        log.warning("rank %d: catch-up step %d: the survivors' rest of step %d is run with them (losses and "
                    "gradient norm %s from the holder)", self.rank, self.current, self.current, fwd.get("grad_norm"))

    def catch_up_losses(self):
        """The holder's forward-backward result of the catch-up step (see :meth:`_start_catch_up`)."""
        from mindspeed_ha.accelerator import collective_device
        from mindspeed_ha.recovery import progress

        return progress.decode_value(self.catching_up["losses"], collective_device())

    def begin_update(self) -> None:
        self._update_depth += 1
        if self._update_depth == 1:
            if self.processor is not None:
                self.processor.begin_update(self.current)

    def end_update(self) -> None:
        self._update_depth -= 1
        if self._update_depth == 0:
            self._take_snapshot(self.current)
            if self.processor is not None:
                self.processor.end_update(self.current)

    def end_update_by_repair(self) -> None:
        """A roll forward gave this rank the finished update of the step in progress (its
        own update raised): report UPDATED like :meth:`end_update`."""
        self._update_depth = 0
        self._take_snapshot(self.current)
        if self.processor is not None:
            self.processor.end_update(self.current)

    def commit_update(self) -> None:
        """Wait until every rank finished the optimizer update of the step in progress.

        With in-place recovery possible (``--enable-hbmfault-repair``,
        ``--ha-network-retries`` > 0 or ``--enable-worker-reboot``: a worker killed inside
        the update is restarted and rolled forward), a world all-reduce of one int32 after this rank's
        update: no rank leaves the update of j before all finished it, so a fault inside
        it finds every rank there, and the step can be finished in place (roll forward,
        :mod:`mindspeed_ha.control.recovery_plan`). Called with the status UPDATED(j)
        already reported, so a dying checkpoint can use this rank's state of j.
        """
        if not self._commit_barrier:
            return
        import torch
        import torch.distributed as dist

        from mindspeed_ha.accelerator import collective_device

        dist.all_reduce(torch.ones(1, dtype=torch.int32, device=collective_device()))

    @property
    def _commit_barrier(self) -> bool:
        return bool(self.processor is not None and (self.config.hbm_repair or self.config.network_retries > 0
                                                    or self.config.worker_reboot))

    def abort_update(self) -> None:
        """The update raised: leave the status UPDATING (dirty), unwind the nesting."""
        self._update_depth -= 1

    def iteration_done(self) -> None:
        k = self.current
        if self.catching_up is not None:
            self.catching_up = None
            if self.ctx is not None:
                self.ctx.optimizer.__dict__.pop("step", None)
        if self.snapshot is None or self.snapshot.iteration != k:  # update skipped (inf/nan)
            self._take_snapshot(k)
            if self.processor is not None:
                self.processor.end_update(k)
        snap = self.snapshot
        args = self.ctx.args if self.ctx is not None else self.args
        snap.rerun_state = megatron_lm.capture_rerun_state()  # as a regular save sees it
        snap.scheduler_state = megatron_lm.scheduler_state(getattr(self.ctx, "opt_param_scheduler", None))
        snap.consumed_before = getattr(args, "consumed_train_samples", None)  # the loop counts k after this
        snap.returned = True
        self.completed = k
        for wrapper in self._replay_wrappers():  # its batches are consumed for good
            wrapper.mark(k)
        self._capture_rerun_machine()
        if self._just_recovered:
            self._just_recovered = False
            self._log_first_iteration_after(k)
        if megatron_lm.needs_rng_gather(args):
            # --data-parallel-random-init: a regular save holds every DP rank's RNG state;
            # gathered now, while every rank is here (a dying checkpoint cannot gather).
            snap.rng_states = megatron_lm.gather_rng_states(snap.rng_state, args)
        self.injector.fire("between", k, self.ctx)

    def _take_snapshot(self, iteration: int) -> None:
        # The rest is added when train_step returns (iteration_done) and when the training
        # loop counted the iteration (dying.IterationSnapshot says where).
        prev = self.snapshot
        self.snapshot = dying.IterationSnapshot(iteration, megatron_lm.collect_rng_state(),
                                                flops_before=prev.flops if prev is not None else None)

    def handle_fault(self, exc: BaseException, where: str = "train_step"):
        """Report ``exc`` to the controller and carry out its action.

        Args:
            exc: the exception that escaped the guarded function.
            where: what raised it: ``"train_step"``, ``"update"`` (inside the optimizer
                update, not finished) or ``"update_done"`` (in the update's commit barrier,
                finished) are reported with the iteration being computed; a guard outside it (``"train"``: the training loop between
                iterations, ``"save"``, ``"final_save"``, ``"eval"``; reported with the
                last completed iteration, the one a dying checkpoint can hold).

        A fault is reported once: an exception an inner guard already reported (it comes
        back only when the controller could not act) is not reported again by an outer one.

        Returns the controller's action when it is RETRY (an in-place recovery; the
        exception carries it, so an outer guard that sees it again gets the same action),
        or None if the controller cannot be reached (then the caller re-raises).
        """
        if self.processor is None:
            return None
        if _reported(exc):  # the action a guard further in got for it (a RETRY it passed on)
            return getattr(exc, _ACTION, None)
        try:
            setattr(exc, _REPORTED, True)
        except AttributeError:  # an exception type without a __dict__: report it, once is the rule
            pass
        if self.config.hbm_repair and not getattr(exc, "aborted", False):
            from mindspeed_ha.accelerator import check_npu_uce

            check_npu_uce(exc)  # on an NPU: torch_npu says whether the device has a UCE
        if where in _IN_STEP:
            iteration = self.current
            log.error("rank %d: fault in iteration %s: %s", self.rank, iteration, exc)
        else:
            iteration = self.completed if self.completed is not None else int(getattr(self.args, "iteration", 0) or 0)
            log.error("rank %d: fault during %s after iteration %s: %s", self.rank, _WHERE.get(where, where),
                      iteration, exc)
        action = self.processor.report_fault(exc, iteration, where=where)
        try:
            setattr(exc, _ACTION, action)
        except AttributeError:
            pass
        return action

    # ---- in-place recovery (training thread) ---------------------------------------------
    def _capture_rerun_machine(self) -> None:
        try:
            from mindspeed_ha.recovery.rollback import capture_rerun_machine

            self._rerun_state = capture_rerun_machine()
        except ImportError:  # a megatron-core without the rerun state machine
            self._rerun_state = None

    def _log_first_iteration_after(self, k: int) -> None:
        """``MINDSPEED_HA_RECOVERY_LOG``: one JSON line when the re-run iteration is done
        (rank, pid, iteration, wall clock seconds): for recovery-time measurements."""
        import json
        import time

        log.warning("rank %d (pid %d): iteration %d done after the in-place recovery", self.rank, os.getpid(), k)
        path = os.environ.get(ENV_RECOVERY_LOG)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"rank": self.rank, "pid": os.getpid(), "iteration": k,
                                    "wall": time.time()}) + "\n")

    def begin_attempt(self) -> None:
        """An attempt at the step in progress starts: remember its RNG state (a re-run
        after a rollback draws the same dropout masks) and the timers already running
        (kept running by the clean-up). ~10 us."""
        if self._rejoin_rng is not None:  # a restarted process: its holder's RNG at this step's entry
            megatron_lm.set_rng_state(self._rejoin_rng)
            self._rejoin_rng = None
        self._entry_rng = megatron_lm.collect_rng_state()
        self.step_stats = {}
        from mindspeed_ha.recovery.rollback import started_timers

        self._entry_timers = started_timers()

    def replay_iterator(self, data_iterator):
        """What ``train_step`` gets instead of ``data_iterator``: the same iterator made
        replayable (:func:`mindspeed_ha.recovery.rollback.wrap_data_iterator`; made once
        per iterator, a ``RerunDataIterator`` keeps its type). None stays None."""
        if data_iterator is None:
            return None
        if isinstance(data_iterator, list):
            return [self.replay_iterator(it) for it in data_iterator]
        known = self._replays.get(id(data_iterator))
        if known is None or known[0] is not data_iterator:
            from mindspeed_ha.recovery.rollback import wrap_data_iterator

            wrapped, replays = wrap_data_iterator(data_iterator)
            known = self._replays[id(data_iterator)] = (data_iterator, wrapped, replays)
        return known[1]

    def _replay_wrappers(self):
        return [r for _, _, replays in self._replays.values() for r in replays]

    def recover(self, action) -> dict:
        """Carry out RETRY(plan) (:class:`~mindspeed_ha.control.recovery_plan.RecoveryPlan`)
        in the training thread, then let the caller re-run the step.

        Stages (every rank, the same order): clean (pending communication handles, grad
        buckets and their flags, gradients, timers: :func:`recovery.rollback.clean`);
        rebuild every process group (:func:`recovery.groups.rebuild_process_groups`,
        generation ``plan.generation``; the start-up fallback group is kept); repair (a
        damaged rank receives its parameters and optimizer shard from its replica holder,
        point to point over the new world group: :mod:`recovery.transfer`); roll back (the
        data iterators replay the batches of the aborted attempt, the RNG returns to the
        attempt's entry). Model and optimizer are still those of ``plan.iteration``: the
        plan is only made when no rank started the optimizer update.

        ``plan.mode == "forward"`` (every rank was stopped inside the optimizer update of
        ``plan.iteration``; called from :mod:`patches.optimizer`'s bracket): clean only the
        in-flight communication, rebuild, repair (a rank whose update did not finish gets
        the finished state from a rank that finished it); no roll back: the caller returns
        from the update and the step goes on. ``plan.mode == "reload"``: after the rebuild,
        :func:`mindspeed_ha.recovery.reload.reload_in_place` loads the latest periodic
        checkpoint and sets :attr:`reruns`.

        Returns:
            Seconds per stage (``clean``, ``rebuild``, ``repair``, ``rollback``), also sent
            to the controller as the RETRY result.

        Raises:
            Whatever a stage raised (after the failure was sent as the RETRY result): the
            caller reports it as a fault during recovery, and the controller falls back
            to the dying checkpoint.
        """
        import json
        import time

        from mindspeed_ha.control.recovery_plan import RecoveryPlan
        from mindspeed_ha.recovery import comm, groups, rollback, transfer

        plan = RecoveryPlan.from_params(action.params)
        times = {}
        t = time.perf_counter()

        def lap(name):
            nonlocal t
            now = time.perf_counter()
            times[name] = round(now - t, 6)
            t = now

        try:
            comm.reset()
            self._update_depth = 0
            model = self.ctx.model if self.ctx is not None else None
            optimizer = self.ctx.optimizer if self.ctx is not None else None
            if plan.mode == "forward":  # the step goes on after its update: keep grads, timers
                rollback.clean_communication(model)
            else:
                rollback.clean(model, optimizer, rerun_state=self._rerun_state,
                               keep_timers=getattr(self, "_entry_timers", ()))
            lap("clean")
            self.injector.fire("recover", plan.iteration + 1, self.ctx)
            exclude = [g for g in (getattr(self, "_fallback_group", None),) if g is not None]
            import datetime

            # bounded: a member that never comes fails the rebuild (-> the dying checkpoint)
            # instead of waiting Megatron's --distributed-timeout-minutes
            groups.rebuild_process_groups(plan.generation, exclude=exclude,
                                          timeout=datetime.timedelta(seconds=self.config.action_timeout_s))
            _check_no_stale_holders(self.rank)
            lap("rebuild")
            repaired = 0
            if plan.mode == "reload":
                from mindspeed_ha.recovery import reload

                # every rank: the latest periodic checkpoint in place; the iterations after
                # it are re-run by the train_step wrapper (reload.rerun) before k+1
                self.reruns = reload.reload_in_place(self, plan)
                lap("reload")
            repairs = plan.repairs
            if repairs and os.environ.get(ENV_TESTING_SKIP_REPAIR) == "1":
                log.error("rank %d: %s=1: the repair is SKIPPED (testing only): the damaged state stays",
                          self.rank, ENV_TESTING_SKIP_REPAIR)
                repairs = {}
            for dst, src in sorted(repairs.items()):
                if plan.mode == "reload":  # ARF without a replica: the restarted rank reloads too
                    if self.rank == src:
                        from mindspeed_ha.recovery import progress

                        progress.send(self._reload_progress(plan.iteration), dst)
                    continue
                if self.rank == dst:
                    transfer.recv_state(model, optimizer, src, None)
                    repaired += 1
                elif self.rank == src:
                    transfer.send_state(model, optimizer, dst, None)
                    if dst in plan.rejoin:  # a restarted process: also the counters, scheduler, RNG
                        from mindspeed_ha.recovery import progress

                        progress.send(self.forward_progress(plan.iteration) if plan.mode == "forward"
                                      else self._progress(plan.iteration), dst)
            lap("repair")
            if plan.mode in ("rollback", "rejoin"):
                for wrapper in self._replay_wrappers():
                    wrapper.rewind()
                if self._entry_rng is not None:
                    megatron_lm.set_rng_state(self._entry_rng)
                lap("rollback")
        except Exception as exc:
            self._recovery_failed(action, exc, "in-place recovery")
            raise
        self._recovered()
        detail = dict(times, rank=self.rank, iteration=plan.iteration, generation=plan.generation,
                      repaired=bool(repaired), mode=plan.mode)
        if plan.mode == "forward":
            log.warning("rank %d: recovered in place (%s, generation %d): iteration %d goes on after its "
                        "optimizer update; seconds %s", self.rank, plan.kind.value, plan.generation,
                        plan.iteration, times)
        else:
            log.warning("rank %d: recovered in place (%s, %s, generation %d): re-running iteration %d; seconds %s",
                        self.rank, plan.kind.value, plan.mode, plan.generation, plan.iteration + 1, times)
        self.processor.action_result(action.action_id, True, json.dumps(detail, sort_keys=True))
        return times

    def _recovery_failed(self, action, exc: BaseException, what: str) -> None:
        """A recovery stage raised: log it and send the failure as the RETRY result (the
        controller then falls back to the dying checkpoint); the caller re-raises."""
        from mindspeed_ha.faults import describe

        log.exception("rank %d: %s failed", self.rank, what)
        self.processor.action_result(action.action_id, False, describe(exc))

    def _recovered(self) -> None:
        """A recovery succeeded: counted; the next completed iteration is logged as the first after it."""
        self.recoveries += 1
        self._just_recovered = True

    def _progress(self, k: int) -> dict:
        """This rank's progress at the end of iteration ``k`` for a restarted process
        (:mod:`mindspeed_ha.recovery.progress`): the loop's counters and the scheduler as
        the snapshot of ``k`` holds them, the RNG at the entry of step k+1."""
        from mindspeed_ha.recovery import progress

        snap = self.snapshot
        if snap is None or snap.iteration != k:
            raise RuntimeError(f"rank {self.rank}: no snapshot of iteration {k} to hand to a restarted process "
                               f"(have {snap.iteration if snap is not None else None})")
        args = snap.args if snap.args is not None else (self.ctx.args if self.ctx is not None else self.args)
        rerun = (self._rerun_state or {}).get("current_iteration")
        return progress.capture(args, k, snap.scheduler_state, self._entry_rng, flops=snap.flops,
                                rerun_iteration=rerun if isinstance(rerun, int) else None)

    def _reload_progress(self, k: int) -> dict:
        """The counters of k (the last iteration every survivor completed) for a process
        restarted without a replica (plan mode ``reload``): it loads the checkpoint
        itself and its re-runs give it the scheduler, RNG and rerun count, so only the
        training loop's counters are sent."""
        from mindspeed_ha.recovery import progress

        args = self.ctx.args if self.ctx is not None else self.args
        snap = self.snapshot
        flops = None
        if snap is not None:
            flops = snap.flops if snap.iteration == k else snap.flops_before if snap.iteration == k + 1 else None
        return progress.capture(args, k, None, None, flops=flops)

    def forward_progress(self, j: int) -> dict:
        """This rank's progress for a process restarted inside the optimizer update of
        ``j`` (roll forward with rejoin), called inside that update after this rank
        finished it: counters, scheduler and rerun count as at the end of j-1 (the loop
        and ``train_step`` count j after the update), the RNG now (after j's
        forward-backward), and :func:`mindspeed_ha.recovery.progress.forward_part` (the
        losses, gradient norm and zero count of j; the samples j consumes).

        Raises:
            RuntimeError: this rank holds no forward-backward result of step ``j``.
        """
        from mindspeed_ha.recovery import progress

        if self.current != j or "losses" not in self.step_stats:
            raise RuntimeError(f"rank {self.rank}: no forward-backward result of step {j} to hand to a restarted "
                               f"process (in step {self.current})")
        args = self.ctx.args if self.ctx is not None else self.args
        optimizer = self.ctx.optimizer if self.ctx is not None else None
        try:  # optimizer.step()'s values where it computed none (megatron-core 0.12.1 optimizer.py)
            from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

            mixed = isinstance(optimizer, MixedPrecisionOptimizer)
        except ImportError:  # pragma: no cover - megatron-core is a dependency
            mixed = False
        grad_norm = self.step_stats.get("grad_norm", 0.0 if mixed else None)
        num_zeros = self.step_stats.get("num_zeros", 0 if mixed else None)
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        samples = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        snap = self.snapshot
        flops = snap.flops_before if snap is not None and snap.iteration == j else None
        rerun = (self._rerun_state or {}).get("current_iteration")
        sched = megatron_lm.scheduler_state(getattr(self.ctx, "opt_param_scheduler", None))
        return progress.capture(args, j - 1, sched, megatron_lm.collect_rng_state(), flops=flops,
                                rerun_iteration=rerun if isinstance(rerun, int) else None,
                                forward=progress.forward_part(j, self.step_stats["losses"], grad_norm, num_zeros,
                                                              samples))

    def rejoin_after_setup(self, model, optimizer, opt_param_scheduler) -> None:
        """ARF, in a restarted process (``MINDSPEED_HA_INCARNATION`` >= 1), right after
        Megatron built its model and optimizer (no checkpoint loaded): wait at the rejoin
        point for the controller's RETRY(rejoin), then, with the survivors, rebuild every
        process group (the start-up's deferred groups become real ones), receive the
        parameters and optimizer shard (:mod:`recovery.transfer`) and the progress
        (counters, scheduler, RNG: :mod:`recovery.progress`) from the plan's source. The
        data iterators, built next, start at the received consumed samples; the training
        loop at the received iteration.

        Plan mode ``forward`` (the death hit the optimizer update of j): the state received
        is j's finished update, the progress that at the entry of j's update; the first
        step is a catch-up step j (:meth:`_start_catch_up`). Mode ``reload`` (no replica):
        the latest periodic checkpoint c is loaded instead of received
        (:func:`mindspeed_ha.recovery.reload.reload_for_rejoin`, collective with the
        survivors' loads), the source sends the loop's counters of k only, the data
        iterators start after c and the first step re-runs c+1..k silently first.

        Raises:
            RuntimeError: the controller did not answer RETRY (the job takes another path;
                its EXIT ends this process), or a stage failed (reported as the RETRY result).
        """
        import datetime
        import json
        import time

        from mindspeed_ha.control.recovery_plan import RecoveryPlan
        from mindspeed_ha.recovery import groups, progress, rejoin, transfer

        self.attach(model, optimizer, opt_param_scheduler)
        action = self.processor.wait_to_rejoin(timeout=self.config.action_timeout_s)
        if getattr(action, "kind", None) != "retry":
            raise RuntimeError(f"rank {self.rank} (incarnation {self.processor.incarnation}): the controller "
                               f"answered {getattr(action, 'kind', None)} instead of a rejoin")
        plan = RecoveryPlan.from_params(action.params)
        times = {}
        t = time.perf_counter()
        try:
            if (plan.mode not in ("rejoin", "forward", "reload") or self.rank not in plan.rejoin
                    or self.rank not in plan.repairs):
                raise RuntimeError(f"rank {self.rank}: a {plan.mode} plan does not rejoin this rank ({plan.reason})")
            exclude = [g for g in (getattr(self, "_fallback_group", None),) if g is not None]
            with rejoin.live():  # the rejoin's own communication is real, not replayed
                report = groups.rebuild_process_groups(
                    plan.generation, exclude=exclude, timeout=datetime.timedelta(seconds=self.config.action_timeout_s))
                log.info("rank %d: rejoin rebuilt %d groups: %s", self.rank, report.groups_rebuilt, report.groups)
                _check_no_stale_holders(self.rank)
                times["rebuild"] = round(time.perf_counter() - t, 6)
                t = time.perf_counter()
                src = plan.repairs[self.rank]
                chunks = self.ctx.model if self.ctx is not None else model
                run_args = self.ctx.args if self.ctx is not None else self.args
                if plan.mode == "reload":  # no replica: the latest periodic checkpoint, with the survivors
                    from mindspeed_ha.recovery import reload

                    self.reruns = reload.reload_for_rejoin(self, plan)
                    times["reload"] = round(time.perf_counter() - t, 6)
                    t = time.perf_counter()
                else:
                    transfer.recv_state(chunks, optimizer, src, None, materialize=True)
                received = progress.recv(src)
            if plan.mode == "reload":
                # the data iterators (built next) start after the checkpoint: the re-runs read
                # its batches; the loop's counters are k's from the first step on (enter_iteration)
                loaded = run_args.consumed_train_samples
                progress.apply(received, run_args, None)
                self._resume_consumed, run_args.consumed_train_samples = run_args.consumed_train_samples, loaded
            else:
                progress.apply(received, run_args, opt_param_scheduler)
            if received.get("rng") is not None:
                self._rejoin_rng = progress.decode_rng(received["rng"])
            if received.get("forward") is not None:  # restarted inside the update of j: catch up step j
                _check_catch_up_possible(run_args)
                self._catch_up = received["forward"]
                run_args.consumed_train_samples += int(self._catch_up["samples"])  # the iterators start after j
            times["repair"] = round(time.perf_counter() - t, 6)
        except Exception as exc:
            self._recovery_failed(action, exc, "rejoin")
            raise
        self._recovered()
        log.warning("rank %d (incarnation %d): rejoined at iteration %d from rank %d; seconds %s", self.rank,
                    self.processor.incarnation, plan.iteration, plan.repairs[self.rank], times)
        self.processor.action_result(action.action_id, True, json.dumps(
            dict(times, rank=self.rank, iteration=plan.iteration, generation=plan.generation, repaired=True,
                 mode=plan.mode, incarnation=self.processor.incarnation), sort_keys=True))

    # ---- action handlers (processor action thread) -------------------------------------
    def _roles(self, params: dict):
        from mindspeed_ha.control.policy import DumpPlan

        plan = DumpPlan.from_params(params)
        return plan, plan.roles(self.rank)

    def _on_verify(self, params: dict):
        """VERIFY: report the integrity of the frozen state (digests, finiteness) to the controller.

        Runs once per fault, in the action thread, while this rank is frozen at UPDATED(k):
        no optimizer update can start, so the state hashed is the state a dump would write.
        """
        from mindspeed_ha.control.state import OptimizerStatus

        status, k = self.processor.status()
        if status is not OptimizerStatus.UPDATED or not self.processor.frozen:
            return False, f"rank {self.rank}: not frozen at a completed update ({status.value}@{k})"
        if self.ctx is None or self.snapshot is None or self.snapshot.iteration != k:
            return False, f"rank {self.rank}: no consistent state for iteration {k}"
        report = dying.verify_state(self.ctx, k)
        self.processor.report_integrity(report)
        verdict = "ok" if report.shard_ok and report.model_ok else f"CORRUPT ({report.detail})"
        return True, (f"rank {self.rank}: iteration {k} {verdict}, shard {report.shard_digest[:12] or '-'}, "
                      f"model {report.model_digest[:12]}")

    def _on_dump(self, params: dict):
        plan, roles = self._roles(params)
        self.staged = plan.iteration  # before the first write: a failure below is cleaned up too
        self.injector.fire("dying", plan.iteration, self.ctx)
        shard_key = (self.layout.tp_rank, self.layout.pp_rank, self.layout.shard_id) if self.layout else None
        model_key = shard_key[:2] if shard_key else None
        detail = dying.dump(self.ctx, plan.iteration, self.snapshot,
                            write_shard=bool(roles["shards"]), write_model=bool(roles["models"]),
                            shard_digest=plan.shard_digests.get(shard_key, "") if roles["shards"] else "",
                            model_digest=plan.model_digests.get(model_key, "") if roles["models"] else "")
        return True, f"rank {self.rank}: {detail}"

    def _on_assemble(self, params: dict):
        plan, roles = self._roles(params)
        if not roles["assemble"]:
            return True, "nothing to assemble"
        return True, f"rank {self.rank}: {dying.assemble(self.ctx, plan.iteration)}"

    def _on_commit(self, params: dict):
        plan, _ = self._roles(params)
        return True, f"rank {self.rank}: {dying.commit(self.args.save, plan.iteration)}"

    def _on_exit(self, code: int, reason: str) -> None:
        """The controller's EXIT (processor action thread): clean up, then end the process.

        A failed dying checkpoint (any exit code but 75) leaves its staging dir behind
        unless someone removes it. Who, and when: the controller sends EXIT to every
        survivor as soon as one saver fails, while other savers may still be writing,
        so a single remover (say the committer) could run before the last write and leave
        files behind. But the processor runs one action at a time, so on each rank this
        EXIT runs only after that rank's own DUMP/ASSEMBLE/COMMIT has returned. Hence
        every rank that took part (got DUMP; assemblers and the committer are savers
        too) removes the whole staging dir here, after its own last write: the last
        removal follows every write, and the partial files of a saver that died go with
        it. Removal is idempotent and moves the dir away before deleting it
        (:func:`dying.discard`), so concurrent removals, and a commit the controller
        timed out, are harmless.
        """
        from mindspeed_ha.control.processor import default_exit_handler

        if self.staged is not None and code != EXIT_DYING_CHECKPOINT_SAVED:
            try:
                log.warning("rank %d: dying checkpoint failed: %s", self.rank,
                            dying.discard(self.args.save, self.staged))
            except Exception:  # noqa: BLE001 - the exit must happen whatever cleanup did
                log.exception("rank %d: removing the dying checkpoint's staging dir failed", self.rank)
        default_exit_handler(code, reason)

    # ---- without a controller ---------------------------------------------------------------
    def _start_fallback_group(self) -> None:
        """A gloo group of every rank, made at start-up, for deciding without the controller.

        If the controller is lost, the ranks agree among themselves over it (see
        :meth:`Processor._without_controller`): its connections were made now, so it works
        when the controller, torchrun's store (both in the launcher process) and new
        groups are gone. Used from the processor's own thread only, never by the training
        thread, so it cannot interleave with training collectives. Its timeout bounds
        each exchange: ``action_timeout_s + heartbeat_timeout_s`` (a save step, plus the
        time ranks take to notice the loss); a dead rank fails it at once. Cost: one
        all-rank group at start-up (world - 1 connections per rank), nothing per iteration.
        """
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.config.action_timeout_s + self.config.heartbeat_timeout_s)
        self._fallback_group = dist.new_group(backend="gloo", timeout=timeout)
        try:  # the processor thread uses it while a recovery has aborted the training collectives
            from mindspeed_ha.recovery import comm

            comm.exempt(self._fallback_group)
        except ImportError:  # pragma: no cover - part of the package
            pass
        self.processor.on_controller_lost(self._exchange)

    def _exchange(self, record: dict) -> list:
        """All-gather one JSON record per rank over the fallback group (rank order).

        Raises:
            ValueError: the record is larger than ``EXCHANGE_BYTES``.
            RuntimeError: (gloo) a rank is gone, or silent past the group's timeout.
        """
        import json

        import torch
        import torch.distributed as dist

        data = json.dumps(record, sort_keys=True).encode()
        if len(data) > EXCHANGE_BYTES - 4:
            raise ValueError(f"exchange record of {len(data)} bytes > {EXCHANGE_BYTES - 4}")
        buf = torch.zeros(EXCHANGE_BYTES, dtype=torch.uint8)
        buf[:4] = torch.tensor(list(len(data).to_bytes(4, "big")), dtype=torch.uint8)
        buf[4:4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros_like(buf) for _ in range(dist.get_world_size(self._fallback_group))]
        dist.all_gather(out, buf, group=self._fallback_group)
        records = []
        for t in out:
            raw = bytes(t.tolist())
            n = int.from_bytes(raw[:4], "big")
            records.append(json.loads(raw[4:4 + n].decode()))
        return records

    def close(self, exit_code: int = 0) -> None:
        if self.processor is not None:
            try:
                self.processor.close(exit_code)
            finally:
                self.processor = None
