"""Interruptible ``torch.distributed`` collectives: a rank blocked in a collective whose
peer is alive but never joins gets out once the control plane decides to recover.

Why (measured, torch 2.13.0 CPU, gloo; ``docs/CPU_BACKEND_FACTS.md`` "In-process recovery
on gloo"): ``ProcessGroupGloo.abort()``/``shutdown()`` do not unblock a synchronous op, so
a gloo op must never be waited on without a way out. NCCL/HCCL groups have ``abort()``,
which fails their pending ops; their calls are left unchanged.

How, on a gloo group (the patches in ``patches/comm.py`` install :func:`collective`
around every ``torch.distributed`` communication function Megatron uses):

* a synchronous call is issued with ``async_op=True`` and then waited by :func:`wait`;
  an asynchronous call returns an :class:`InterruptibleWork` (``wait()`` goes through
  :func:`wait`); ``isend``/``irecv``/``batch_isend_irecv`` return InterruptibleWorks,
  so torch's own ``send``/``recv`` (``isend``/``irecv`` + ``work.wait()``,
  distributed_c10d.py) and the object collectives (which call the tensor ones through
  distributed_c10d's globals) are covered too;
* :func:`abort` sets a flag and wakes every waiter at once; the waiter raises
  :class:`CollectiveAborted`; every later op raises it before launching until
  :func:`reset`. The abandoned op stays pending in gloo's background thread: the old
  group is unusable, recovery makes new groups (they work at once, facts file).

How :func:`wait` waits: measured on this machine (2 gloo processes sharing 2 loaded CPU
cores, torch 2.13.0; medians of 400 interleaved 1 KB all-reduces in a scratch script):
plain ``work.wait()`` 353 us; a loop of bounded ``work.wait(timeout=50 ms)`` 364 us;
``get_future()`` + a done-callback releasing a lock the waiter blocks on 446 us (+~90
us: gloo's completion thread takes the GIL to run the callback and hands it back). The
bounded loop costs nothing but answers an abort only at its next timeout; the callback
answers at once but costs ~20% of a small op. The design below keeps both good parts:
``scripts/bench_comm.py`` (median of 200, 6 runs at load average 3-17) gives wrapped /
unwrapped 0.97-1.06 for 1 KB and 0.90-1.04 for 4 MB (noise: the wrapper's own Python
work is ~4 us a call, measured on a one-rank group), callback-only ("no phase 1")
1.04-1.18 for 1 KB; abort -> raise 0.16-0.24 ms (median) for a parked all_reduce,
0.19-0.30 ms for a parked recv, 10.2-10.3 ms when the abort comes in phase 1. The
price is on p2p (works without a future: a helper thread): a 1 KB
``batch_isend_irecv`` exchange + waits took 1.6-1.7x unwrapped (+~200 us, two thread
hand-offs; gloo sets a p2p work's ``is_completed()`` only inside a wait, so there is
no cheap shortcut).
Facts per work kind (torch 2.13 gloo):

* collective works (all_reduce, all_gather(_into_tensor), broadcast, reduce, barrier,
  all_to_all(_single), gather, scatter, coalesced all_reduce/all_gather) have
  ``get_future()``, and ``wait(timeout)`` that timed out ("Operation timed out!",
  c10d ``Work::wait``) leaves them waitable again (the result is right afterwards);
  a timed-out wait costs ~0.1 ms on top of its timeout;
* send/recv works have no future ("Work::getFuture not implemented") and a timed-out
  ``wait(timeout)`` closes the pair ("Application timeout caused pair closure"): never
  wait them with a timeout;
* reduce_scatter / reduce_scatter_tensor (and their coalesced form) have no future and
  ignore the timeout of ``wait(timeout)`` (it blocked 30 s for a 100 ms timeout).

So :func:`wait` does, for a work with a future: (1) one bounded C++ wait of
:data:`FIRST_WAIT_S` (no Python on the completion path: an op that ends inside it costs
what an unwrapped one does), then (2) blocks on a lock released by the future's
done-callback or by :func:`abort` (no polling; an op still pending after phase 1 pays
the callback's ~90 us). For a work without a future: if not already completed, a
pooled daemon helper thread does the plain ``work.wait()`` and releases the lock;
:func:`abort` releases it too. Abort latency: at most :data:`FIRST_WAIT_S` while a waiter
is in phase 1, otherwise the time to wake a thread (see ``scripts/bench_comm.py``).

Not covered: ops on mixed-backend groups (``"cpu:gloo,cuda:nccl"``) and on other
backends (mpi, ucc) pass through unchanged; a ``work.get_future().wait()`` a caller
makes itself is not interruptible; exempt groups (:func:`exempt`) are never aborted (a
group the control plane itself uses while aborted, such as the runtime's fallback group,
must be exempted by its owner). A helper thread waiting an abandoned p2p op stays
blocked for the life of the process (daemon: it never holds up the exit).
"""

from __future__ import annotations

import _thread
import datetime
import inspect
import logging
import queue
import threading
import weakref
from typing import Callable, Optional

from mindspeed_ha.faults import CommunicationError

log = logging.getLogger("mindspeed_ha.recovery.comm")

#: phase 1 of :func:`wait`: one C++ wait this long (seconds) before parking on a lock.
FIRST_WAIT_S = 0.01

#: how a group's ops are treated (cached per group object)
_GLOO, _PASS, _EXEMPT = "gloo", "pass", "exempt"

_lock = threading.Lock()
_reason: Optional[str] = None
_waiters: set = set()  # locks of parked waiters; abort() releases them
_hook: Optional[Callable[[str, object], None]] = None
_modes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_local = threading.local()  # .inside: a wrapper of ours is launching (nested ops pass)


class CollectiveAborted(CommunicationError):
    """A collective was interrupted (or refused) because recovery called :func:`abort`.

    ``aborted`` is True (a real link error has no such attribute); ``reason`` is the
    string given to :func:`abort`.
    """

    aborted = True

    def __init__(self, reason: str):
        super().__init__(f"collective aborted by mindspeed-ha recovery: {reason}")
        self.reason = reason

    def __reduce__(self):  # pickles back to the same message
        return type(self), (self.reason,)


# --------------------------------------------------------------------------- control
def abort(reason: str) -> None:
    """Interrupt every collective of this process; thread-safe, returns at once.

    Sets the flag (every op raises :class:`CollectiveAborted` until :func:`reset`),
    releases every parked waiter, and aborts the NCCL/HCCL groups (``ProcessGroup.abort()``)
    on a daemon thread, since a communicator abort may take a while. Exempt groups are
    left alone. Called again while aborted: keeps the first reason, wakes again (the
    groups are aborted once).
    """
    global _reason
    with _lock:
        first = _reason is None
        if first:
            _reason = str(reason)
        waiters = list(_waiters)
    for lk in waiters:
        _release(lk)
    groups = _accelerator_groups() if first else []
    if groups:
        threading.Thread(target=_abort_groups, args=(groups,), name="mindspeed-ha-comm-abort",
                         daemon=True).start()
    log.info("collectives aborted (%s): %d waiter(s) woken, %d NCCL/HCCL group(s) aborting",
             reason, len(waiters), len(groups))


def reset() -> None:
    """Clear the abort flag (the training thread, when recovery starts)."""
    global _reason
    with _lock:
        _reason = None


def aborted() -> Optional[str]:
    """The reason given to :func:`abort`, or None when not aborted."""
    return _reason


def set_fault_hook(fn: Optional[Callable[[str, object], None]]) -> None:
    """``fn(op_name, group)`` runs on the calling thread right after an op was launched
    (before it is waited on); ``group`` is the resolved process group. An exception it
    raises propagates out of the op, which stays launched (a real-looking link error on
    this rank while the peers are inside the same op). ``None`` removes it."""
    global _hook
    _hook = fn


def exempt(group) -> None:
    """Never interrupt or refuse ops on ``group`` (a group used by the control plane
    itself, e.g. the runtime's fallback group, must keep working while aborted)."""
    _modes[group] = _EXEMPT


def _release(lk) -> None:
    try:
        lk.release()
    except RuntimeError:  # released already (the op completed and abort() raced)
        pass


def _check() -> None:
    reason = _reason
    if reason is not None:
        raise CollectiveAborted(reason)


# --------------------------------------------------------------------------- groups
_c10d_module = []


def _c10d():
    if not _c10d_module:
        import torch.distributed.distributed_c10d as c10d

        _c10d_module.append(c10d)
    return _c10d_module[0]


def _resolve(group):
    """``group`` or the default group (None when torch.distributed is not initialised)."""
    if group is None:
        return _c10d()._world.default_pg
    return group


def _mode(group) -> str:
    """How ops on ``group`` (already resolved) are treated: cached per group object."""
    try:
        return _modes[group]
    except KeyError:
        pass
    except TypeError:  # not a group (None, NON_GROUP_MEMBER): let torch handle it
        return _PASS
    try:
        backend = str(_c10d().get_backend(group)).lower()
    except (ValueError, RuntimeError, AssertionError):  # destroyed / not a member
        return _PASS
    mode = _GLOO if backend == "gloo" else _PASS
    _modes[group] = mode
    return mode


def _accelerator_groups() -> list:
    """The live NCCL/HCCL groups that are not exempt, newest first (torch's abort order)."""
    import sys

    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return []
    out = []
    try:
        names = dict(c10d._world.pg_names)
    except Exception:  # noqa: BLE001 - torch not initialised: nothing to abort
        return []
    for pg in sorted(names, key=lambda p: str(names[p]), reverse=True):
        try:
            if _modes.get(pg) == _EXEMPT:
                continue
            backend = str(c10d.get_backend(pg)).lower()
        except Exception:  # noqa: BLE001 - destroyed meanwhile
            continue
        if any(b in backend for b in ("nccl", "hccl")) and hasattr(pg, "abort"):
            out.append(pg)
    return out


def _abort_groups(groups) -> None:
    for pg in groups:
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - one failed abort must not stop the others
            log.exception("abort of process group %r failed", pg)


# --------------------------------------------------------------------------- waiting
class _Helpers:
    """Daemon threads (an abandoned op never holds up the exit) doing a plain ``work.wait()``
    for works without a future; at most one idle helper is kept, one more ends when idle."""

    def __init__(self):
        self._idle = []
        self._lock = threading.Lock()

    def submit(self, job) -> None:
        with self._lock:
            q = self._idle.pop() if self._idle else None
        if q is None:
            q = queue.SimpleQueue()
            threading.Thread(target=self._run, args=(q,), name="mindspeed-ha-comm-wait", daemon=True).start()
        q.put(job)

    def _run(self, q) -> None:
        while True:
            job = q.get()
            job()
            del job  # its closure holds a Work: the destroyed group's sockets and thread
            with self._lock:
                if self._idle:
                    return
                self._idle.append(q)


_helpers = _Helpers()


def _park(lk, timeout: Optional[float]) -> None:
    """Block on ``lk`` (held) until released by completion or :func:`abort`."""
    with _lock:
        if _reason is not None:
            raise CollectiveAborted(_reason)
        _waiters.add(lk)
    try:
        if timeout is None:
            lk.acquire()
        else:
            lk.acquire(timeout=max(timeout, 0.0))
    finally:
        with _lock:
            _waiters.discard(lk)


def wait(work, timeout: Optional[datetime.timedelta] = None):
    """Wait for a c10d ``Work`` like ``work.wait(timeout)``, but interruptibly.

    Args:
        work: a ``torch.distributed.Work`` (or an :class:`InterruptibleWork`).
        timeout: as ``Work.wait``'s; None waits until the op ends.

    Returns:
        What ``work.wait()`` returns (True).

    Raises:
        CollectiveAborted: :func:`abort` was called before or while waiting.
        RuntimeError: whatever ``work.wait()`` raises (the op failed, "Operation timed
            out!" when ``timeout`` passed).
    """
    if isinstance(work, _work_class()):
        work = work._work
    if timeout is not None and timeout.total_seconds() <= 0:
        timeout = None  # c10d's default argument, timedelta(0), means "no timeout"
    _check()
    try:
        fut = work.get_future()
    except RuntimeError:  # gloo send/recv/reduce_scatter: "Work::getFuture not implemented"
        fut = None
    if fut is None:
        return _wait_helper(work, timeout)
    return _wait_future(work, fut, timeout)


def _wait_future(work, fut, timeout):
    limit = None if timeout is None else timeout.total_seconds()
    first = FIRST_WAIT_S if limit is None else min(FIRST_WAIT_S, limit)
    if first > 0:  # (a zero timedelta means "no timeout" to c10d: never pass one)
        try:
            return work.wait(datetime.timedelta(seconds=first))  # phase 1: no Python on completion
        except RuntimeError:
            if fut.done():
                return work.wait()  # the real outcome (an error, or done just after the timeout)
            if limit is not None and limit <= first:
                raise
    lk = _thread.allocate_lock()
    lk.acquire()
    fut.add_done_callback(lambda _f: _release(lk))
    _park(lk, None if limit is None else limit - max(first, 0.0))
    if not fut.done():
        _check()
        # the caller's timeout passed: let torch raise its own error (or return if done)
        return work.wait(datetime.timedelta(milliseconds=1))
    return work.wait()


def _wait_helper(work, timeout):
    if work.is_completed():
        return work.wait() if timeout is None else work.wait(timeout)
    lk = _thread.allocate_lock()
    lk.acquire()
    outcome = []

    def job():
        try:
            outcome.append((True, work.wait() if timeout is None else work.wait(timeout)))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome.append((False, exc))
        _release(lk)

    _helpers.submit(job)
    _park(lk, None)
    if not outcome:
        _check()
        raise AssertionError("woken without an outcome or an abort")  # pragma: no cover
    ok, value = outcome[0]
    if ok:
        return value
    raise value


def _make_work_class():
    import torch.distributed as dist

    class InterruptibleWork(dist.Work):
        """A c10d ``Work`` whose ``wait()`` is :func:`wait`; everything else delegates.

        An instance of ``torch.distributed.Work`` (isinstance checks hold), returned by
        the patched async ops on gloo groups (Megatron's DDP stores it and calls
        ``.wait()``; its p2p code calls ``req.wait()``)."""

        def __init__(self, work):
            super().__init__()
            self._work = work

        def wait(self, timeout=None):
            return wait(self._work, timeout)

        def is_completed(self):
            return self._work.is_completed()

        def is_success(self):
            return self._work.is_success()

        def exception(self):
            return self._work.exception()

        def result(self):
            return self._work.result()

        def source_rank(self):
            return self._work.source_rank()

        def _source_rank(self):
            return self._work._source_rank()

        def get_future(self):
            return self._work.get_future()

        def get_future_result(self):
            return self._work.get_future_result()

        def synchronize(self):
            return self._work.synchronize()

        def block_current_stream(self):
            return self._work.block_current_stream()

        def boxed(self):
            return self._work.boxed()

        def _get_op_type(self):
            return self._work._get_op_type()

        def _get_duration(self):
            return self._work._get_duration()

        def __getattr__(self, name):
            if name == "_work":  # not set yet: no recursion
                raise AttributeError(name)
            return getattr(self._work, name)

        def __repr__(self):
            return f"InterruptibleWork({self._work!r})"

    return InterruptibleWork


class _LazyWork:
    """``InterruptibleWork`` is a subclass of torch's ``Work``; built on first use so that
    importing this module does not import torch."""

    cls = None


def __getattr__(name):  # module attribute InterruptibleWork, built lazily
    if name == "InterruptibleWork":
        return _work_class()
    raise AttributeError(name)


def _work_class():
    if _LazyWork.cls is None:
        _LazyWork.cls = _make_work_class()
    return _LazyWork.cls


def interruptible(work):
    """``work`` wrapped in an :class:`InterruptibleWork` (None and wrapped ones as they are)."""
    cls = _work_class()
    if work is None or isinstance(work, cls):
        return work
    return cls(work)


# --------------------------------------------------------------------------- wrappers
def _param_positions(fn, *names):
    params = list(inspect.signature(fn).parameters)
    return tuple(params.index(n) if n in params else None for n in names)


def _arg(args, kwargs, pos, name, default=None):
    if pos is not None and len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


def collective(name: str):
    """Wrapper (``wrapt`` signature) for ``torch.distributed.<name>``, a function with
    ``group`` (and, except ``isend``/``irecv``, ``async_op``) parameters.

    On a gloo group: refuses to launch when aborted, launches asynchronously, calls the
    fault hook, then waits interruptibly (sync call) or returns an
    :class:`InterruptibleWork` (async call). Inside torch's coalescing context the call
    is recorded by torch, not launched: it passes. Other groups: refuses when aborted,
    otherwise unchanged (the hook runs after the call)."""
    spec = []

    def wrapper(wrapped, instance, args, kwargs):
        if not spec:
            spec.extend(_param_positions(wrapped, "group", "async_op"))
        gpos, apos = spec
        group = _resolve(_arg(args, kwargs, gpos, "group"))
        mode = _mode(group)
        if mode is _EXEMPT or getattr(_local, "inside", False):
            return wrapped(*args, **kwargs)
        _check()
        if mode is _PASS or group in _c10d()._world.pg_coalesce_state:
            result = wrapped(*args, **kwargs)
            if _hook is not None and mode is _PASS:
                _hook(name, group)
            return result
        async_op = True
        if apos is not None:
            if len(args) > apos:
                async_op = bool(args[apos])
                args = args[:apos] + (True,) + args[apos + 1:]
            else:
                async_op = bool(kwargs.get("async_op", False))
                kwargs["async_op"] = True
        work = wrapped(*args, **kwargs)
        if work is None:  # this rank is not in the group
            return None
        if _hook is not None:
            _hook(name, group)
        if async_op:
            return interruptible(work)
        wait(work)
        return None

    wrapper.__name__ = f"interruptible_{name}"
    return wrapper


def batch_isend_irecv(wrapped, instance, args, kwargs):
    """Wrapper for ``batch_isend_irecv``: on gloo, the requests come back as
    :class:`InterruptibleWork` (the isend/irecv inside pass, launched once)."""
    ops = _arg(args, kwargs, 0, "p2p_op_list")
    group = _resolve(ops[0].group) if ops else None
    mode = _mode(group)
    if mode is _EXEMPT or getattr(_local, "inside", False):
        return wrapped(*args, **kwargs)
    _check()
    if mode is _PASS:
        works = wrapped(*args, **kwargs)
        if _hook is not None:
            _hook("batch_isend_irecv", group)
        return works
    _local.inside = True
    try:
        works = wrapped(*args, **kwargs)
    finally:
        _local.inside = False
    if _hook is not None:
        _hook("batch_isend_irecv", group)
    return [interruptible(w) for w in works]


def coalescing_manager(wrapped, instance, args, kwargs):
    """Wrapper for ``torch.distributed._coalescing_manager(group, device, async_ops)``.

    On gloo (no ``device``: torch's "fast path" records all_reduce / all_gather_into_tensor
    / reduce_scatter_tensor and launches them as one coalesced op at exit) it runs torch's
    manager with ``async_ops=True``; at exit it waits the launched work interruptibly
    (sync) or puts InterruptibleWorks in ``cm.works`` (async: ``cm.wait()`` waits each).
    When the body raises :class:`CollectiveAborted`, the group's recorded-op list, which
    torch leaves behind on an exception, is dropped."""
    group_arg, device, async_ops = _coalescing_args(wrapped, args, kwargs)
    group = _resolve(group_arg)
    mode = _mode(group)
    if mode is _EXEMPT or getattr(_local, "inside", False):
        return wrapped(*args, **kwargs)
    _check()
    if mode is _PASS or device is not None:
        return wrapped(*args, **kwargs)
    return _interruptible_coalescing(wrapped, group, async_ops)


_coalescing_spec = []


def _coalescing_args(wrapped, args, kwargs):
    if not _coalescing_spec:
        _coalescing_spec.extend(_param_positions(wrapped, "group", "device", "async_ops"))
    gpos, dpos, apos = _coalescing_spec
    return (_arg(args, kwargs, gpos, "group"), _arg(args, kwargs, dpos, "device"),
            bool(_arg(args, kwargs, apos, "async_ops", False)))


def _interruptible_coalescing(wrapped, group, async_ops):
    import contextlib

    @contextlib.contextmanager
    def manager():
        try:
            with wrapped(group, None, async_ops=True) as cm:
                yield cm
        except CollectiveAborted:
            _c10d()._world.pg_coalesce_state.pop(group, None)
            raise
        if cm.works and _hook is not None:
            _hook("_coalescing_manager", group)
        if async_ops:
            cm.works[:] = [interruptible(w) for w in cm.works]
        else:
            works, cm.works[:] = list(cm.works), []
            for w in works:
                wait(w)

    return manager()
