"""Per-rank HA runtime: the one object the patches talk to, and its step protocol.

Step protocol, in the order the training thread calls it (one iteration ``k``; the
patches in ``patches/training.py`` and ``patches/optimizer.py`` are the callers):

1. ``train_step`` wrapper: :meth:`HARuntime.begin_attempt` (the RNG and timers at the
   attempt's entry), then :meth:`HARuntime.enter_iteration` (``current = k``; the
   graceful-stop pause point runs here, before the step).
2. optimizer wrapper: :meth:`HARuntime.begin_update` -> the processor marks the
   optimizer state UPDATING(k); it blocks instead if the controller froze this rank.
3. optimizer wrapper, after the update returned: :meth:`HARuntime.end_update` ->
   UPDATED(k); the RNG state is snapshotted (a dying checkpoint of ``k`` needs it); then
   :meth:`HARuntime.commit_update` (with in-place recovery possible: no rank leaves the
   update before every rank finished it). An update that raised:
   :meth:`HARuntime.abort_update` (the status stays UPDATING: dirty).
4. ``train_step`` returns: :meth:`HARuntime.iteration_done` (covers skipped updates).
5. Any exception escaping ``train_step`` goes to :meth:`HARuntime.handle_fault`, which
   classifies it, reports it and waits for the controller's action (a dying checkpoint
   runs in the processor's action thread; EXIT ends the process; RETRY comes back to the
   caller, which runs :meth:`HARuntime.recover` and re-runs the step). So does one escaping
   the rest of the run once training started: the training loop around ``train_step``,
   a periodic or the final checkpoint save, evaluation (fault guards in
   ``patches/training.py``); those report the last completed iteration.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional, Tuple

from mindspeed_ha.checkpoint.state import DyingContext, IterationSnapshot
from mindspeed_ha import env as ha_env
from mindspeed_ha.events import EventRecorder
from mindspeed_ha.integrations import megatron_lm

from . import actions, bootstrap, pause_tasks
from .bootstrap import EXCHANGE_BYTES  # noqa: F401  (re-exported)
from .exits import install_exit_hooks
from .fault_report import FaultLedger, FaultReport
from .state import StepState

log = logging.getLogger("mindspeed_ha.runtime")

#: where a fault is reported with the iteration in progress (see patches/optimizer.py)
_IN_STEP = ("train_step", "update", "update_done")
_WHERE = {"train": "the training loop (between iterations)", "save": "a regular checkpoint save",
          "final_save": "the final checkpoint save", "eval": "evaluation"}


class NoFaults:
    """The runtime's fault points when no fault injector is attached (feature ``testing``
    attaches one: :mod:`mindspeed_ha.patches.testing`): nothing is armed, nothing fires."""

    def armed(self, point: str, iteration: int):
        return None

    def fire(self, point: str, iteration: int, target=None) -> None:
        return None


class HARuntime:
    """One per process (:func:`mindspeed_ha.runtime.configure`).

    Attributes (public, read by the patches and the recovery stages):
        config, args, rank, layout, processor, controller_proc: the configuration and the
            control-plane side (set at start-up).
        ctx: the rank's :class:`~mindspeed_ha.checkpoint.state.DyingContext` (model, optimizer,
            scheduler), attached at the first ``train_step``.
        current / completed: the iteration in progress / the last one ``train_step`` completed.
        snapshot: the :class:`~mindspeed_ha.checkpoint.state.IterationSnapshot` of the last update.
        staged: the iteration of the dying checkpoint this rank writes (None: none).
        step_stats: the step's forward-backward losses, gradient norm and zero count
            (patches/optimizer.py): what a holder hands a process restarted inside this
            step's update.
        state: the step's recovery state (:class:`~mindspeed_ha.runtime.state.StepState`).
        recoveries: in-place recoveries done. events: this rank's phase events.
        injector: the fault points (:class:`NoFaults` unless a fault injector is attached).
        fallback_group: the start-up gloo groups for deciding without the controller
            (:class:`bootstrap.FallbackGroups`: the node's, and the nodes' leaders').
        script_loader: the training script's (load_checkpoint, get_args), for a reload.
    """

    def __init__(self, config, args, get_runtime: Optional[Callable[[], object]] = None):
        self.config = config
        self.args = args
        self.rank = int(os.environ.get("RANK", "0"))
        self.processor = None
        self.controller_proc = None
        self.injector = NoFaults()
        self.layout = None
        self.current: Optional[int] = None
        self.completed: Optional[int] = None
        self.snapshot: Optional[IterationSnapshot] = None
        self.ctx: Optional[DyingContext] = None
        self.staged: Optional[int] = None
        self.state = StepState()
        self.recoveries = 0
        self.step_stats: dict = {}
        self.events = EventRecorder(f"rank-{self.rank}")
        self.faults = FaultLedger()
        #: what still damages this rank's state while a recovery meant to repair it has not
        #: succeeded (a UCE: :func:`mindspeed_ha.recovery.executor.recover`), else None
        self.unrepaired: Optional[str] = None
        self.fallback_group = None
        self.script_loader = None
        self._get_runtime = get_runtime or (lambda: self)

    # ---- start-up -------------------------------------------------------------------
    def on_model_parallel_initialized(self) -> None:
        """Compute this rank's layout, agree on the auth key, start the controller (rank 0,
        without the launcher), the processor and the fallback group."""
        import dataclasses

        self.layout = bootstrap.layout_of_this_rank(self.args)
        restarted = os.environ.get(ha_env.INCARNATION, "0") not in ("", "0")  # ARF: the job runs on
        if self.rank == 0 and getattr(self.args, "save", None) and not restarted:
            # never in a restarted rank 0: the survivors may be writing a dying checkpoint now
            bootstrap.sweep_save_dir(self.args.save)
        key = bootstrap.agree_auth_key()
        self.controller_proc = bootstrap.ensure_controller(self.config, self.rank, key) or self.controller_proc
        if getattr(self.config, "auth_key", None) != key:
            self.config = dataclasses.replace(self.config, auth_key=key)
        self.processor = bootstrap.make_processor(self.config, self.rank, self.layout, self.args, self._on_exit,
                                                  pause_task=lambda task: pause_tasks.run(self, task))
        for kind, handler in actions.HANDLERS.items():
            self.processor.on_action(kind, lambda params, handler=handler: handler(self, params))
        self.fallback_group = bootstrap.fallback_group(self.config)
        self.processor.on_controller_lost(lambda record: bootstrap.exchange(self.fallback_group, record))
        self.processor.start()
        install_exit_hooks(self._get_runtime)

    def attach(self, model, optimizer, opt_param_scheduler, loader=None) -> None:
        """The rank's training state (first call wins); ``loader``: the training script's
        (load_checkpoint, get_args) (:func:`mindspeed_ha.recovery.reload.script_loader`)."""
        if loader is not None and self.script_loader is None:
            self.script_loader = loader
        if self.ctx is not None:
            return
        from mindspeed_ha.control.state import Layout

        # Megatron-LM's global args are the validated ones (with --yaml-cfg not even the
        # object parse_args returned); the built-in trainer has none there.
        args = megatron_lm.current_args() or self.args
        lay = self.layout or Layout()
        self.ctx = DyingContext(
            args=args, model=model, optimizer=optimizer, opt_param_scheduler=opt_param_scheduler,
            tp_rank=lay.tp_rank, pp_rank=lay.pp_rank, pp_size=lay.pp_size, shard_id=lay.shard_id,
        )

    @property
    def train_args(self):
        """The args the training loop counts in (the attached ones, else the parsed ones)."""
        return self.ctx.args if self.ctx is not None else self.args

    # ---- step protocol ----------------------------------------------------------------
    def enter_iteration(self) -> int:
        """The step after the last completed one starts: returns its number (``current``).

        At the first step the start-up ends (:meth:`_end_start_up`). Then the graceful-stop
        pause point (:meth:`Processor.pause_point`): every rank pauses after the same
        iteration when a stop is under way; a recovery's abort raised there is reported
        for this step (it has not begun).
        """
        args = self.train_args
        state = self.state
        fwd = state.catch_up if self.completed is None else None
        if fwd is not None:
            # a process restarted inside the update of j: the loop counts step j after this
            # catch-up step (its data iterators were built after j: rejoin_after_setup)
            state.catch_up = None
            args.consumed_train_samples -= int(fwd["samples"])
        if self.completed is None and state.resume_consumed is not None:
            # a process restarted without a replica: its iterators started after the
            # checkpoint it loaded (the re-runs read those batches); the loop counts from k
            args.consumed_train_samples, state.resume_consumed = state.resume_consumed, None
        if self.completed is None:
            self._end_start_up(args, dirty=fwd is not None)
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

    def _end_start_up(self, args, dirty: bool) -> None:
        """The first step: the start-up ends here. Its collectives were recorded (a
        restarted process of this rank replays them) or replayed (this is one),
        recovery/rejoin.py. The state loaded (or initialised) is what a save before the
        first step would write; every rank enters its first train_step here, so the RNG
        gather is safe. ``dirty``: the state held is that of j, whose update the catch-up
        step finishes (status UPDATING(j+1) until then)."""
        from mindspeed_ha.recovery import rejoin

        rejoin.startup_done()
        self.completed = int(getattr(self.args, "iteration", 0) or 0)
        self.take_snapshot(self.completed)
        snap = self.snapshot
        snap.rerun_state = megatron_lm.capture_rerun_state()
        snap.scheduler_state = megatron_lm.scheduler_state(getattr(self.ctx, "opt_param_scheduler", None))
        snap.returned = True
        snap.take_args(args, final=True, flops=getattr(args, "num_floating_point_operations_so_far", None))
        if megatron_lm.needs_rng_gather(args):
            snap.rng_states = megatron_lm.gather_rng_states(snap.rng_state, args)
        if self.processor is not None:
            self.processor.end_update(self.completed)
            if dirty:
                self.processor.begin_update(self.completed + 1)
        self.state.capture_rerun_machine()

    def begin_attempt(self) -> None:
        """An attempt at the step in progress starts: remember its RNG state (a re-run
        after a rollback draws the same dropout masks), the timers already running
        (kept running by the clean-up) and the grad scalers' state (fp16: put back by the
        clean-up). ~10 us."""
        state = self.state
        if state.rejoin_rng is not None:  # a restarted process: its holder's RNG at this step's entry
            megatron_lm.set_rng_state(state.rejoin_rng)
            state.rejoin_rng = None
        state.entry_rng = megatron_lm.collect_rng_state()
        self.step_stats = {}
        from mindspeed_ha.recovery.rollback import capture_grad_scalers, started_timers

        state.entry_timers = started_timers()
        state.entry_scalers = capture_grad_scalers(self.ctx.optimizer if self.ctx is not None else None)

    def replay_iterator(self, data_iterator):
        """What ``train_step`` gets instead of ``data_iterator``: the same iterator made
        replayable (:func:`mindspeed_ha.recovery.rollback.wrap_data_iterator`; made once
        per iterator, a ``RerunDataIterator`` keeps its type). None stays None."""
        if data_iterator is None:
            return None
        if isinstance(data_iterator, list):
            return [self.replay_iterator(it) for it in data_iterator]
        replays = self.state.replays
        known = replays.get(id(data_iterator))
        if known is None or known[0] is not data_iterator:
            from mindspeed_ha.recovery.rollback import wrap_data_iterator

            wrapped, wrappers = wrap_data_iterator(data_iterator)
            known = replays[id(data_iterator)] = (data_iterator, wrapped, wrappers)
        return known[1]

    @property
    def in_update(self) -> bool:
        """Whether the optimizer update bracket is open (nested calls report once)."""
        return self.state.update_depth > 0

    def begin_update(self) -> None:
        """The optimizer update of ``current`` starts (outermost call: UPDATING)."""
        self.state.update_depth += 1
        if self.state.update_depth == 1 and self.processor is not None:
            self.processor.begin_update(self.current)

    def end_update(self) -> None:
        """The optimizer update returned (outermost call: snapshot, UPDATED)."""
        self.state.update_depth -= 1
        if self.state.update_depth == 0:
            self.take_snapshot(self.current)
            if self.processor is not None:
                self.processor.end_update(self.current)

    def end_update_by_repair(self) -> None:
        """A roll forward gave this rank the finished update of the step in progress (its
        own update raised, or the catch-up step answered it): report UPDATED like
        :meth:`end_update`."""
        self.state.update_depth = 0
        self.take_snapshot(self.current)
        if self.processor is not None:
            self.processor.end_update(self.current)

    def abort_update(self) -> None:
        """The update raised: leave the status UPDATING (dirty), unwind the nesting."""
        self.state.update_depth -= 1

    def commit_update(self) -> None:
        """Wait until every rank finished the optimizer update of the step in progress.

        With in-place recovery possible (``--enable-hbmfault-repair``,
        ``--ha-network-retries`` > 0 or ``--enable-worker-reboot``: a worker killed inside
        the update is restarted and rolled forward), a world all-reduce of one int32 after
        this rank's update: no rank leaves the update of j before all finished it, so a
        fault inside it finds every rank there, and the step can be finished in place
        (roll forward, :mod:`mindspeed_ha.control.recovery_plan`). Called with the status
        UPDATED(j) already reported, so a dying checkpoint can use this rank's state of j.
        """
        config = self.config
        if self.processor is None or not (config.hbm_repair or config.network_retries > 0 or config.worker_reboot):
            return
        import torch
        import torch.distributed as dist

        from mindspeed_ha.accelerator import collective_device

        dist.all_reduce(torch.ones(1, dtype=torch.int32, device=collective_device()))

    def iteration_done(self) -> None:
        """``train_step`` returned: the step in progress is the last completed one."""
        k = self.current
        state = self.state
        if state.catching_up is not None:
            state.catching_up = None
            state.catch_up_optimizer = None
        if self.snapshot is None or self.snapshot.iteration != k:  # update skipped (fp16: inf/nan found)
            self.take_snapshot(k)
            if self.processor is not None:  # an update of k that changed nothing but the grad scaler
                self.processor.begin_update(k)
                self.processor.end_update(k)
        snap = self.snapshot
        args = self.train_args
        snap.rerun_state = megatron_lm.capture_rerun_state()  # as a regular save sees it
        snap.scheduler_state = megatron_lm.scheduler_state(getattr(self.ctx, "opt_param_scheduler", None))
        snap.consumed_before = getattr(args, "consumed_train_samples", None)  # the loop counts k after this
        snap.returned = True
        self.completed = k
        self.faults.step_completed()
        for wrapper in state.replay_wrappers():  # its batches are consumed for good
            wrapper.mark(k)
        state.capture_rerun_machine()
        if state.just_recovered:
            state.just_recovered = False
            _log_first_iteration_after(self.rank, k)
        if megatron_lm.needs_rng_gather(args):
            # --data-parallel-random-init: a regular save holds every DP rank's RNG state;
            # gathered now, while every rank is here (a dying checkpoint cannot gather).
            snap.rng_states = megatron_lm.gather_rng_states(snap.rng_state, args)
        self.injector.fire("between", k, self.ctx)

    def take_snapshot(self, iteration: int) -> None:
        """A new snapshot of ``iteration`` with the RNG state now. The rest is added when
        train_step returns (iteration_done) and when the training loop counted the
        iteration (IterationSnapshot says where)."""
        prev = self.snapshot
        self.snapshot = IterationSnapshot(iteration, megatron_lm.collect_rng_state(),
                                                flops_before=prev.flops if prev is not None else None)

    def handle_fault(self, exc: BaseException, where: str = "train_step", news: bool = False):
        """Report ``exc`` to the controller and carry out its action.

        Args:
            exc: the exception that escaped the guarded function.
            where: what raised it: ``"train_step"``, ``"update"`` (inside the optimizer
                update, not finished) or ``"update_done"`` (in the update's commit
                barrier, finished) are reported with the iteration being computed; a
                guard outside it (``"train"``: the training loop between iterations,
                ``"save"``, ``"final_save"``, ``"eval"``, ``"rejoin"``) with the last
                completed iteration, the one a dying checkpoint can hold.

        A fault is reported once (:class:`~mindspeed_ha.runtime.fault_report.FaultLedger`):
        an exception an inner guard already reported, or one raised from or during it,
        is not reported again by an outer one. ``news``: report an exception raised during
        a reported one all the same (a failed recovery from it); itself still once.

        Returns the controller's action when it is RETRY (an in-place recovery; an outer
        guard that sees the same exception again gets the same action), or None if the
        controller cannot be reached or the fault was reported before (then the caller
        re-raises).
        """
        if self.processor is None:
            return None
        if self.faults.seen(exc) and not (news and self.faults.report_of(exc) is None):
            # the action a guard further in got for it (a RETRY it passed on)
            report = self.faults.report_of(exc)
            return report.action if report is not None else None
        self.faults.remember(exc, FaultReport("", "", None, where))  # once is the rule, whatever happens below
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
        from mindspeed_ha.faults import FaultKind, classify, describe

        report = FaultReport(describe(exc), classify(exc).value, iteration, where)
        if report.kind == FaultKind.UCE.value and self.unrepaired is None:
            self.unrepaired = f"the UCE in iteration {iteration} ({report.error[:200]})"
        self.faults.remember(exc, report)
        action = self.processor.report_fault(exc, iteration, where=where)
        self.faults.remember(exc, FaultReport(report.error, report.kind, iteration, where, True, action))
        return action

    # ---- recovery (training thread) ------------------------------------------------------
    def recover(self, action, where: str = "train_step", modes: Optional[Tuple[str, ...]] = None,
                then: Optional[Callable[[], None]] = None) -> dict:
        """Carry out RETRY(plan) in place: :func:`mindspeed_ha.recovery.executor.recover`
        (the stages of ``plan.mode``), then ``then()`` (a reload's silent re-runs).

        A failure (a stage's, which the executor sent as the RETRY result, or ``then``'s) is
        reported as a new fault of ``where`` and the controller's next action is followed
        (:func:`mindspeed_ha.recovery.executor.next_plan`): another RETRY
        (whose mode is in ``modes``, any mode if None) runs the recovery again with its plan,
        e.g. a controller successor's with its rendezvous store after the controller's node
        was lost during this recovery; anything else raises the failure (the dying
        checkpoint's DUMP runs on the action thread and its EXIT ends the process meanwhile;
        None: the controller is lost).

        Returns:
            The seconds per stage of the recovery that succeeded.

        Raises:
            The last failure, when the controller's answer to it is not such a RETRY.

        After each attempt a young-generation garbage collection (``gc.collect(1)``, < 10 ms
        here; a full one takes 0.5-0.8 s on the tiny job's 0.4 M objects): the aborted
        attempt's reference cycles (exception, traceback, frames) hold gloo Works, and a Work
        keeps its destroyed group's sockets and event-loop thread until the cycle is collected
        (+4 descriptors, +1 thread now and then; flat over 10 recoveries with it, measured).
        """
        import gc

        from mindspeed_ha.recovery import executor

        while True:
            try:
                times = executor.recover(self, action)
                if then is not None:
                    then()
                return times
            except Exception as failure:  # SystemExit / KeyboardInterrupt pass through
                action = executor.next_plan(self, failure, where, modes)
            finally:
                gc.collect(1)

    def rejoin_after_setup(self, model, optimizer, opt_param_scheduler) -> None:
        """ARF, in a restarted process (``MINDSPEED_HA_INCARNATION`` >= 1), right after
        Megatron built its model and optimizer (no checkpoint loaded): wait at the rejoin
        point for the controller's RETRY(rejoin), then run the rejoin stages
        (:data:`mindspeed_ha.recovery.stages.REJOINING`): with the survivors, rebuild every
        process group (the start-up's deferred groups become real ones), receive the
        parameters, optimizer shard and optimizer host state (:mod:`recovery.transfer`) and
        the progress (counters, scheduler, RNG: :mod:`recovery.progress`) from the plan's
        source. The data iterators, built next, start at the received consumed samples; the
        training loop at the received iteration. A failed rejoin is reported and the
        controller's next action followed, as in :meth:`recover` (another RETRY: rejoin again).

        Plan mode ``forward`` (the death hit the optimizer update of j): the state received
        is j's finished update, the progress that at the entry of j's update; the first
        step is a catch-up step j (:meth:`_start_catch_up`). Mode ``reload`` (no replica):
        the latest periodic checkpoint c is loaded instead of received
        (:func:`mindspeed_ha.recovery.reload.reload_for_rejoin`, collective with the
        survivors' loads), the source sends the loop's counters of k only, the data
        iterators start after c and the first step re-runs c+1..k silently first.

        Raises:
            RuntimeError: the controller did not answer RETRY (the job takes another path;
                its EXIT ends this process), or a stage failed (reported as the RETRY result)
                and the controller's answer was not another RETRY.
        """
        from mindspeed_ha.recovery import executor

        self.attach(model, optimizer, opt_param_scheduler)
        action = self.processor.wait_to_rejoin(timeout=self.config.action_timeout_s)
        if getattr(action, "kind", None) != "retry":
            raise RuntimeError(f"rank {self.rank} (incarnation {self.processor.incarnation}): the controller "
                               f"answered {getattr(action, 'kind', None)} instead of a rejoin")
        while True:
            try:
                executor.rejoin(self, action, model, optimizer, opt_param_scheduler)
                return
            except Exception as failure:  # SystemExit / KeyboardInterrupt pass through
                action = executor.next_plan(self, failure, "rejoin")

    def mark_recovered(self) -> None:
        """A recovery succeeded: counted; the next completed iteration is logged as the first after it."""
        self.recoveries += 1
        self.state.just_recovered = True

    def _start_catch_up(self, fwd: dict) -> None:
        """ARF roll forward, in the restarted process's first step j (the death hit the
        update of j; this process holds the finished state of j and the progress as at
        the entry of j's update, :meth:`rejoin_after_setup`).

        The script's own ``train_step`` and training loop run step j, so this process
        takes part in every collective the survivors run in the rest of step j (Megatron-LM
        core_v0.12.1 ``train_step``: the model-parallel all-reduces of the update's success
        and of the gradient norm; ``train``: the timers' gathers of ``training_log``...)
        and counts it (iteration, consumed samples, FLOPs, scheduler step) as they do. Two
        calls are answered instead of computed (patches/optimizer.py, catch-up mode): the
        forward-backward returns the holder's losses of j (:meth:`catch_up_losses`) and the
        attached optimizer's next ``step()`` returns (True, the holder's gradient norm, zero
        count) without touching the state (:meth:`catch_up_step`). The RNG is the holder's
        after j's forward-backward (:meth:`begin_attempt`).
        """
        optimizer = self.ctx.optimizer if self.ctx is not None else None
        if optimizer is None:
            raise RuntimeError(f"rank {self.rank}: no optimizer attached for the catch-up step")
        self.state.catching_up = fwd
        self.state.catch_up_optimizer = optimizer
        log.warning("rank %d: catch-up step %d: the survivors' rest of step %d is run with them (losses and "
                    "gradient norm %s from the holder)", self.rank, self.current, self.current, fwd.get("grad_norm"))

    def catch_up_losses(self):
        """The holder's forward-backward result of the catch-up step (see :meth:`_start_catch_up`)."""
        from mindspeed_ha.accelerator import collective_device
        from mindspeed_ha.recovery import progress

        return progress.decode_value(self.state.catching_up["losses"], collective_device())

    def catch_up_step(self, optimizer):
        """``optimizer.step()`` in the catch-up step: the answer ``(True, grad norm, zero
        count)`` from the holder, once, for the attached optimizer (UPDATING(j) since
        :meth:`enter_iteration` -> UPDATED(j), snapshot of j); None when ``optimizer``'s
        step is to run as usual."""
        state = self.state
        if state.catch_up_optimizer is None or optimizer is not state.catch_up_optimizer:
            return None
        state.catch_up_optimizer = None  # once: the next step is the optimizer's own
        self.end_update_by_repair()
        fwd = state.catching_up
        return True, fwd.get("grad_norm"), fwd.get("num_zeros")

    # ---- end ------------------------------------------------------------------------------
    def _on_exit(self, code: int, reason: str) -> None:
        """The controller's EXIT (processor action thread): :func:`actions.on_exit`."""
        actions.on_exit(self, code, reason)

    def close(self, exit_code: int = 0) -> None:
        """Say GOODBYE (``exit_code``) and stop the processor; idempotent."""
        if self.processor is not None:
            try:
                self.processor.close(exit_code)
            finally:
                self.processor = None


def _log_first_iteration_after(rank: int, k: int) -> None:
    """``MINDSPEED_HA_RECOVERY_LOG``: one JSON line when the re-run iteration is done: rank,
    pid, iteration, wall clock (s), and this process's open file descriptors, threads and
    resident memory (bytes, psutil): for recovery-time measurements and the soak test's
    flat-resources check; ``thread_names``: name -> count of its threads (Linux
    ``/proc/self/task/*/comm``, native threads included; {} elsewhere), to tell which
    thread a drift is."""
    import json
    import time

    import psutil

    log.warning("rank %d (pid %d): iteration %d done after the in-place recovery", rank, os.getpid(), k)
    path = os.environ.get(ha_env.RECOVERY_LOG)
    if path:
        me = psutil.Process()
        line = {"rank": rank, "pid": os.getpid(), "iteration": k, "wall": time.time(),
                "fds": me.num_fds(), "threads": me.num_threads(), "rss": me.memory_info().rss,
                "thread_names": _thread_names()}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _thread_names() -> dict:
    """name -> count of this process's threads (``/proc/self/task/*/comm``; {} where absent)."""
    out: dict = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0) + 1
    return out
