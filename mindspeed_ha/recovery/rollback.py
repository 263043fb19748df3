"""Roll a rank back to the end of iteration ``k`` after a fault inside iteration ``k+1``.

For a fault before the optimizer update of ``k+1`` (the model and optimizer state are
still those of ``k``), re-running ``k+1`` in the same processes must compute exactly
what an uninterrupted run computes. Three things the aborted step left behind would
make it differ, and this module puts each back:

* the data: the step already took its micro-batches from the training data iterator;
  :class:`ReplayIterator` records the items taken since the last completed iteration
  and serves them again after :meth:`ReplayIterator.rewind`;
* the RNG state (dropout): :func:`capture_rng` at the end of ``k``, :func:`restore_rng`
  before the re-run (Megatron-LM's layout: python, numpy, torch, device, the
  tensor-parallel tracker);
* communication and gradient state: :func:`clean` resets DDP's per-step bucket state,
  zeroes the gradients, stops Megatron-LM's timers that the step left running and
  returns the rerun state machine to "between iterations";
* the grad scaler (``--fp16``): megatron-core's ``MixedPrecisionOptimizer.prepare_grads``
  updates it (scale, growth and hysteresis trackers) before the update bracket, so a step
  aborted after it (e.g. in the grad-norm all-reduce) would count its inf/nan check twice:
  :func:`capture_grad_scalers` at the attempt's entry, put back by :func:`clean`.

Sources (megatron-core 0.12.1): ``distributed/param_and_grad_buffer.py``
(``_ParamAndGradBucketGroup``: ``reset``, ``start/finish_grad_sync``,
``start/finish_param_sync``), ``distributed/distributed_data_parallel.py``
(``zero_grad_buffer``, ``no_sync``), ``timers.py`` (``Timer.start`` asserts "timer has
already been started"), ``rerun_state_machine.py`` (``should_run_forward_backward``).
"""

from __future__ import annotations

import sys
from typing import Any, Iterator, List, Optional, Tuple

from mindspeed_ha.integrations import megatron_lm


class ReplayIterator:
    """An iterator that can serve again the items it gave out since the last :meth:`mark`.

    Wrap the training data iterator once; call :meth:`mark` when an iteration completed
    (its items are then forgotten) and :meth:`rewind` after a rollback: the next
    ``next()`` calls return the recorded items in the order they were first given out,
    then continue with the underlying iterator. Holds at most the items of one
    iteration (those taken since the last mark). The items are kept as they were
    returned (references, no copy): a consumer that modified a batch in place would get
    the modified batch back.

    Keep mode (:meth:`keep_since`, for an in-place reload of the latest periodic
    checkpoint, :mod:`mindspeed_ha.recovery.reload`): :meth:`mark` forgets nothing, it
    records where each completed iteration's items end; :meth:`forget_through` (called
    when a periodic checkpoint of iteration ``s`` was saved) drops the items of the
    iterations up to ``s``; :meth:`rewind_to` serves again the items taken after a
    kept iteration. Memory cost: the items of every iteration since the last save, at
    most ``--save-interval`` + 1 iterations' worth (``num_microbatches`` items per
    iteration per iterator), held by reference: the batches stay alive instead of
    being freed (Megatron-LM's GPT batch: about ``micro_batch_size * seq_length * 28``
    bytes of CPU tensors: tokens, labels and position ids int64, loss mask float32;
    e.g. 112 KiB for 1 x 4096, about 3.4 GiB for a save interval of 1000 with 32
    micro-batches).

    Args:
        iterator: any iterator (or iterable).
    """

    def __init__(self, iterator):
        self.iterator = iter(iterator) if not hasattr(iterator, "__next__") else iterator
        self._items: List[Any] = []
        self._pos: Optional[int] = None  # replaying: index of the next recorded item to serve
        self.marked: Optional[int] = None  # the iteration of the last mark
        self._start = 0  # index of the first item taken after the last mark (0 unless keeping)
        self._ends: Optional[dict] = None  # keep mode: iteration -> index of the first item after it

    def __iter__(self) -> "ReplayIterator":
        return self

    def __next__(self) -> Any:
        if self._pos is not None:
            if self._pos < len(self._items):
                item = self._items[self._pos]
                self._pos += 1
                return item
            self._pos = None
        item = next(self.iterator)  # StopIteration passes through
        self._items.append(item)
        return item

    @property
    def recorded(self) -> int:
        """Number of items held for a replay."""
        return len(self._items)

    @property
    def keeping(self) -> bool:
        """Whether keep mode is on (:meth:`keep_since`)."""
        return self._ends is not None

    def _taken(self) -> int:
        """Index of the next item a ``next()`` serves (recorded or new)."""
        return self._pos if self._pos is not None else len(self._items)

    def mark(self, iteration_done: Optional[int] = None) -> None:
        """Iteration ``iteration_done`` completed: forget the items it consumed.

        Items recorded but not served again yet (a rewind whose replay the iteration did
        not use up) stay recorded: they were not consumed by a completed iteration. In
        keep mode nothing is forgotten: the items taken so far become those of
        ``iteration_done`` (see :meth:`rewind_to`).
        """
        if self._ends is not None:
            self._start = self._taken()
            if iteration_done is not None:
                self._ends[int(iteration_done)] = self._start
        elif self._pos is not None:
            self._items = self._items[self._pos:]
            self._pos = 0 if self._items else None
        else:
            self._items = []
        self.marked = iteration_done

    def rewind(self) -> int:
        """Serve the items taken since the last mark again, from the first; returns how many."""
        self._pos = self._start if self._start < len(self._items) else None
        return len(self._items) - self._start

    def keep_since(self, iteration: int) -> None:
        """Turn keep mode on: from now on keep every item taken after ``iteration`` (the
        last completed iteration, or the one a checkpoint holds), until
        :meth:`forget_through` a later one. A no-op when already on."""
        if self._ends is None:
            self._ends = {int(iteration): self._start}

    def can_rewind_to(self, iteration: int) -> bool:
        """Whether :meth:`rewind_to` (``iteration``) can serve the items taken after it."""
        return self._ends is not None and int(iteration) in self._ends

    def rewind_to(self, iteration: int) -> int:
        """Serve again every item taken after iteration ``iteration`` (keep mode).

        Returns:
            the number of items that will be served again before the underlying iterator.

        Raises:
            ValueError: keep mode is off, or the items after ``iteration`` are not held
                (it is older than the last :meth:`forget_through` or was never marked).
        """
        if not self.can_rewind_to(iteration):
            held = sorted(self._ends) if self._ends is not None else "none (keep mode off)"
            raise ValueError(f"the data items taken after iteration {iteration} are not held (held after: {held})")
        start = self._ends[int(iteration)]
        self._start = start
        self._pos = start if start < len(self._items) else None
        return len(self._items) - start

    def forget_through(self, iteration: int) -> int:
        """Keep mode: a checkpoint of iteration ``iteration`` was saved; drop the items of
        the iterations up to it (a reload never goes back further). Returns how many
        items were dropped (0 when keep mode is off or ``iteration`` was not marked)."""
        iteration = int(iteration)
        if self._ends is None or iteration not in self._ends:
            return 0
        cut = self._ends[iteration]
        if cut > self._start or (self._pos is not None and self._pos < cut):
            return 0  # replaying items from before it: they are still needed
        self._items = self._items[cut:]
        if self._pos is not None:
            self._pos -= cut
        self._start -= cut
        self._ends = {it: end - cut for it, end in self._ends.items() if it >= iteration}
        return cut


def wrap_data_iterator(data_iterator) -> Tuple[Any, List[ReplayIterator]]:
    """Make a training data iterator replayable.

    Args:
        data_iterator: what Megatron-LM passes to ``train_step``: None, an iterator, a
            ``RerunDataIterator`` or (virtual pipeline) a list of those.

    Returns:
        ``(iterator to use instead, [ReplayIterator])``. A ``RerunDataIterator`` is kept
        (the rerun state machine checks the type) and its inner iterable wrapped; a list
        stays a list of the same length; None stays None (no replay needed).
    """
    if data_iterator is None:
        return None, []
    if isinstance(data_iterator, list):
        out, replays = [], []
        for d in data_iterator:
            w, r = wrap_data_iterator(d)
            out.append(w)
            replays += r
        return out, replays
    if isinstance(data_iterator, ReplayIterator):
        return data_iterator, [data_iterator]
    try:
        from megatron.core.rerun_state_machine import RerunDataIterator
    except ImportError:  # pragma: no cover - megatron-core always has it (0.10+)
        RerunDataIterator = ()
    if RerunDataIterator and isinstance(data_iterator, RerunDataIterator):
        inner = data_iterator.iterable
        if not isinstance(inner, ReplayIterator):
            inner = ReplayIterator(inner)
            data_iterator.iterable = inner
        return data_iterator, [inner]
    replay = ReplayIterator(data_iterator)
    return replay, [replay]


# ---- RNG -------------------------------------------------------------------------------
def capture_rng() -> dict:
    """This rank's RNG state (Megatron-LM's ``rng_state`` element; no collectives):
    :func:`mindspeed_ha.integrations.megatron_lm.collect_rng_state`."""
    return megatron_lm.collect_rng_state()


def restore_rng(state: dict) -> None:
    """Restore a :func:`capture_rng` state.

    Raises:
        KeyError: ``state`` lacks a key or the tracker states
            (:func:`mindspeed_ha.integrations.megatron_lm.set_rng_state`).
    """
    megatron_lm.set_rng_state(state)


# ---- grad scaler (fp16) ------------------------------------------------------------------
def _scalers(optimizer) -> List[Any]:
    opts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer]) if optimizer is not None else []
    return [getattr(opt, "grad_scaler", None) for opt in opts]


def capture_grad_scalers(optimizer) -> List[Optional[dict]]:
    """Each optimizer's grad scaler state now (megatron-core ``grad_scaler.state_dict()``;
    None where there is none). No copy: the scaler replaces its scale tensor on update
    instead of writing it (megatron-core 0.12.1 ``DynamicGradScaler.update``), so holding
    the dict keeps the values of now. A few microseconds."""
    return [scaler.state_dict() if scaler is not None else None for scaler in _scalers(optimizer)]


def restore_grad_scalers(optimizer, captured: Optional[List[Optional[dict]]]) -> int:
    """Put back a :func:`capture_grad_scalers` state (``grad_scaler.load_state_dict``);
    returns how many scalers were set (0 without a capture)."""
    done = 0
    for scaler, state in zip(_scalers(optimizer), captured or []):
        if scaler is not None and state is not None:
            scaler.load_state_dict(state)
            done += 1
    return done


# ---- rerun state machine -----------------------------------------------------------------
_RERUN_FIELDS = ("state", "current_iteration", "rerun_requested", "checkpoint_requested",
                 "restart_again_requested", "continue_requested")


def capture_rerun_machine() -> dict:
    """The rerun state machine's per-iteration fields now (call between iterations, e.g.
    where the runtime's ``iteration_done`` runs), for :func:`clean`."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    sm = get_rerun_state_machine()
    return {f: getattr(sm, f) for f in _RERUN_FIELDS if hasattr(sm, f)}


def reset_rerun_machine(captured: Optional[dict] = None) -> str:
    """Return the rerun state machine to "between iterations".

    Args:
        captured: a :func:`capture_rerun_machine` result taken when the last completed
            iteration ended: restored as it was. Without it: a machine left inside its
            forward-backward loop (``state`` not ``NOT_RUNNING_YET``) goes back to
            ``NOT_RUNNING_YET`` with ``current_iteration`` one lower (it counts on entry);
            one already out of the loop (fault in the optimizer) cannot be told apart from
            one between iterations and is left alone.

    Returns:
        what was done (for logs).
    """
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    sm = get_rerun_state_machine()
    before = f"{sm.state.name}@{sm.current_iteration}"
    if captured is not None:
        for f, v in captured.items():
            setattr(sm, f, v)
    elif sm.state in (RerunState.INITIAL_RUN, RerunState.RERUNNING_IN_PLACE):
        sm.state = RerunState.NOT_RUNNING_YET
        sm.current_iteration -= 1
    return f"rerun state machine {before} -> {sm.state.name}@{sm.current_iteration}"


# ---- timers ------------------------------------------------------------------------------
def megatron_lm_timers():
    """Megatron-LM's global ``Timers`` (``megatron.training.global_vars._GLOBAL_TIMERS``)
    when the training script set them up, else None. Never imports ``megatron.training``."""
    gv = sys.modules.get("megatron.training.global_vars")
    return getattr(gv, "_GLOBAL_TIMERS", None) if gv is not None else None


def started_timers(timers=None) -> List[str]:
    """Names of the timers of ``timers`` (default: Megatron-LM's) running now (a few us)."""
    timers = timers if timers is not None else megatron_lm_timers()
    if timers is None:
        return []
    return [name for name, t in getattr(timers, "_timers", {}).items() if getattr(t, "_started", False)]


def stop_timers(timers=None, keep=()) -> List[str]:
    """Mark every started timer of ``timers`` stopped, keeping its elapsed total.

    An aborted step leaves the timers it started running; when the step runs again,
    ``Timer.start`` asserts "timer has already been started". The time since the start
    is dropped (not added: it belongs to the aborted step), nothing is synchronised.

    Args:
        timers: a ``megatron.core.timers.Timers`` (default: :func:`megatron_lm_timers`).
        keep: names of timers that were running when the step began (Megatron-LM's
            ``interval-time`` runs across iterations and is read by ``training_log``:
            stopping it would make the next log divide by a zero interval); left running.

    Returns:
        the names of the timers stopped.
    """
    timers = timers if timers is not None else megatron_lm_timers()
    if timers is None:
        return []
    stopped = []
    keep = set(keep)
    for name, timer in sorted(getattr(timers, "_timers", {}).items()):
        if getattr(timer, "_started", False) and name not in keep:
            timer._started = False
            stopped.append(name)
    return stopped


# ---- DDP and gradients -------------------------------------------------------------------
def _ddp_chunks(model) -> List[Any]:
    chunks = model if isinstance(model, list) else [model]
    out = []
    for m in chunks:
        while m is not None and not hasattr(m, "bucket_groups") and hasattr(m, "module"):
            m = m.module
        if m is not None and hasattr(m, "bucket_groups"):
            out.append(m)
    return out


def clean_bucket_group(bucket_group) -> None:
    """Forget a ``_ParamAndGradBucketGroup``'s in-flight communication and per-step flags.

    The handles of collectives the aborted step launched are dropped, not waited on (a
    wait on an aborted or failed collective raises or blocks): call this once those
    collectives finished or were aborted (``recovery.comm.abort``, groups rebuilt), else
    one still running could write into a gradient buffer after it was zeroed.
    ``param_gather_dispatched = False``: with ``--overlap-param-gather`` the next forward
    gathers the parameters again (``finish_param_sync`` dispatches an undispatched
    gather), so a parameter all-gather cut short by the fault is redone.
    """
    bucket_group.grad_reduce_handle = None
    bucket_group.param_gather_handle = None
    bucket_group.param_gather_dispatched = False
    bucket_group.reset()  # params_with_grad = set(), is_last_microbatch = True
    bucket_group.is_last_microbatch = True  # no_sync() exited by an exception leaves False


def clean_communication(model) -> List[str]:
    """Forget the in-flight communication of every DDP chunk's bucket groups and nothing
    else (:func:`clean_bucket_group`): for a roll forward, whose step goes on after its
    optimizer update (gradients, timers and the rerun state machine stay as they are).

    Returns:
        a line per thing done (for logs).
    """
    n_groups = 0
    chunks = _ddp_chunks(model)
    for chunk in chunks:
        for bg in list(getattr(chunk, "bucket_groups", [])) + list(getattr(chunk, "expert_parallel_bucket_groups", [])):
            clean_bucket_group(bg)
            n_groups += 1
    return [f"{len(chunks)} DDP chunk(s): {n_groups} bucket group(s) reset"]


def clean(model, optimizer, rerun_state: Optional[dict] = None, timers=None, keep_timers=(),
          grad_scalers: Optional[List[Optional[dict]]] = None) -> List[str]:
    """Clean the communication and gradient state an aborted training step left behind.

    After it, the step can run again from its start with the model and optimizer state
    of the last completed iteration (this does not touch parameters or optimizer state).

    Args:
        model: the model chunks (list of megatron DDP, possibly wrapped) or one chunk.
        optimizer: the Megatron optimizer (or None).
        rerun_state: :func:`capture_rerun_machine` taken when the last iteration ended
            (see :func:`reset_rerun_machine` for what happens without it).
        timers: Megatron-LM's ``Timers`` (default: the global ones, if any).
        keep_timers: timers running when the step began (:func:`started_timers`): kept running.
        grad_scalers: :func:`capture_grad_scalers` at the step's entry: put back.

    Does:
        every DDP chunk's bucket groups (expert ones too): :func:`clean_bucket_group`;
        ``param.grad = None`` for every parameter (a backward cut short may leave one);
        ``zero_grad_buffer()`` on every chunk (grad buffers zeroed,
        ``grad_added_to_main_grad`` cleared); ``optimizer.zero_grad()``;
        :func:`stop_timers`; :func:`reset_rerun_machine`; :func:`restore_grad_scalers`.

    Returns:
        a line per thing done (for logs).
    """
    done = []
    chunks = _ddp_chunks(model)
    n_groups = 0
    for chunk in chunks:
        for bg in list(getattr(chunk, "bucket_groups", [])) + list(getattr(chunk, "expert_parallel_bucket_groups", [])):
            clean_bucket_group(bg)
            n_groups += 1
        for p in chunk.parameters():
            p.grad = None
        chunk.zero_grad_buffer()
    done.append(f"{len(chunks)} DDP chunk(s): {n_groups} bucket group(s) reset, grad buffers zeroed")
    if optimizer is not None:
        optimizer.zero_grad()
        done.append("optimizer grads zeroed")
        if restore_grad_scalers(optimizer, grad_scalers):
            done.append("grad scalers back to the step's entry")
    stopped = stop_timers(timers, keep=keep_timers)
    if stopped:
        done.append(f"timers stopped: {', '.join(stopped)}")
    try:
        done.append(reset_rerun_machine(rerun_state))
    except ImportError:  # pragma: no cover - megatron-core always has it
        pass
    return done

