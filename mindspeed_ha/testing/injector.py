"""Fault injector: kill or fail a rank at a named point of a named iteration.

Configured by the environment so that it reaches every rank started by a launcher::

    MINDSPEED_HA_INJECT="rank=1,iteration=3,point=backward,fault=kill"

Points (where in iteration ``k`` the fault fires):
    ``forward``     first micro-batch forward of iteration k
    ``backward``    backward through the first micro-batch output of iteration k
    ``grad_sync``   DDP gradient synchronisation of iteration k
    ``optimizer``   inside the optimizer update of iteration k (after begin_update)
    ``between``     after iteration k completed, before k+1 starts
    ``data``        where this rank fetches a training batch of iteration k (Megatron-LM's
                    ``get_batch_on_this_tp_rank``; ranks of the first and last PP stage)
    ``eval``        first forward step of the evaluation after iteration k (``--eval-interval``)
    ``save``        inside the periodic checkpoint save of iteration k, at its first barrier:
                    this rank's files are written, the tracker is not (a half-written save)
    ``final_save``  the same inside the final save at the end of training (iteration k)
    ``dying``       while this rank writes its part of a dying checkpoint
    ``check``       the online check (``mindspeed-ha check``) number k of this process (1: the
                    first): ``fault=corrupt,what=gemm,how=bitflip`` flips one bit of its GEMM
                    result before the digest (the check must report 2 naming this rank)
    ``recover``     during an in-place recovery that re-runs iteration k, after the clean-up,
                    before the process groups are rebuilt (a fault during recovery)
    ``handoff``     a hot switch's outgoing rank in the middle of its handoff: its parameters
                    and optimizer shard went to its new process, its progress not yet; k counts
                    the handoffs of this process (1: its first and only one, it exits after it);
                    ``fault=kill`` there is the case of the replica fallback
    ``pp``          the first pipeline send/recv this rank launches in iteration k
                    (``fault=network`` only)
    ``tp``          the first tensor-parallel collective this rank launches in iteration k
                    (``fault=network`` only)
Faults: ``kill`` (SIGKILL to itself: the process vanishes, nothing runs after),
``raise`` (raise :class:`InjectedFault`, a RuntimeError carrying a gloo-like message),
``stop`` (SIGSTOP to itself: a hang; every thread stops, heartbeats included, the
process and its connections stay; it goes on only if someone sends SIGCONT),
``term`` (SIGTERM to itself: a preempted worker), ``term_launcher`` / ``int_launcher`` /
``kill_launcher`` (SIGTERM / SIGINT / SIGKILL to its parent process, the launcher: a
preempted job / Ctrl-C / a lost controller host; the rank itself goes on),
``stop_launcher`` (SIGSTOP to the launcher: a controller host that freezes, e.g. a long
stall, and may come back: the split-brain case of controller failover), ``kill_node`` (a lost node: SIGKILL to its launcher first, so that nothing is restarted,
then to every other process the launcher started, the node's other workers included,
then to itself), ``slow`` (with ``sleep=S``: this rank sleeps S seconds at the point of
iteration k and of every later one, then goes on: a straggler for the sub-health detector;
points ``forward``, ``backward``, ``optimizer``, ``between``), ``hold`` (this rank waits at the point, its processor's heartbeats going on,
until the file ``MINDSPEED_HA_INJECT_RELEASE`` names exists and is empty or holds an
iteration >= k (:func:`release` writes it: several holds released one by one), at most :data:`HOLD_MAX_S`; its
peers wait in their next collective: a test looks at the running job meanwhile, e.g. scrapes
its metrics, and is sure the job has not ended), ``corrupt`` (silent data corruption of this rank's state, then training goes on; only at
the points the runtime fires with its state: ``optimizer``, ``between``, ``dying``)::

    MINDSPEED_HA_INJECT="rank=0,iteration=2,point=between,fault=corrupt,what=exp_avg,how=bitflip"

``what``: ``param`` (a model parameter), ``main_param`` / ``exp_avg`` / ``exp_avg_sq`` (the
fp32 main parameter / Adam state of the first parameter this rank's distributed-optimizer
shard holds); ``how``: ``nan`` (one value becomes NaN, default) or ``bitflip`` (the lowest
bit of one value flips: still finite, only a checksum sees it). The value changed is the
first element of the tensor.

``uce`` (an uncorrectable device-memory error, at ``forward``, ``backward``, ``optimizer``,
``between``): the WHOLE tensor ``what`` is overwritten with a fixed finite garbage value
(:data:`UCE_GARBAGE`; integer tensors :data:`UCE_GARBAGE_INT`), so a recovery that skips
the repair computes different numbers; then :class:`InjectedFault` is raised with CUDA's
text for ``cudaErrorECCUncorrectable`` (:data:`UCE_MESSAGE`, classified UCE).
``what``: ``param`` (default), ``grad`` (the DDP gradient buffer of the first parameter,
its ``main_grad``), ``main_param``, ``exp_avg``, ``exp_avg_sq`` (as for ``corrupt``). The
state comes from the runtime (its ``DyingContext``) where the point fires without it::

    MINDSPEED_HA_INJECT="rank=1,iteration=4,point=forward,fault=uce,what=exp_avg"

``network`` (a failed link, at ``grad_sync``, ``pp``, ``tp``): the first matching op
this rank launches in iteration k raises :class:`InjectedFault` with gloo's text for a
reset connection (:data:`NETWORK_MESSAGE`, classified NETWORK) right after it was
launched, so its peers stay blocked inside it (hook: ``mindspeed_ha.recovery.comm
.set_fault_hook``, installed when the injector is created). Matching: ``grad_sync`` an
``all_reduce`` / ``reduce_scatter`` (on gloo: the ``_coalescing_manager`` launching
them) on a data-parallel group issued by DDP's ``start_grad_sync``; ``pp`` a ``send`` /
``recv`` / ``isend`` / ``irecv`` / ``batch_isend_irecv``; ``tp`` any collective on megatron's tensor-parallel group (none
with TP 1: then nothing fires).

Every spec but ``slow`` fires at most once per process (a step re-run after an in-process recovery
does not fault again); a ``slow`` sleeps at its point whatever else fires there (e.g. a ``hold``
of a later iteration of the same rank and point).
Several specs may be joined with ``;``.
"""

from __future__ import annotations

from mindspeed_ha import env as ha_env
from mindspeed_ha.errors import InjectedFault  # noqa: F401  (one error tree)
import os
import signal
from typing import Any, List, Optional

from mindspeed_ha.faultspec import (  # noqa: F401  (the spec language, parsed by the launcher too)
    SIGNALS as _SIGNALS, CORRUPT_HOW, CORRUPT_POINTS, CORRUPT_WHAT, FAULTS, NETWORK_POINTS, POINTS, UCE_POINTS, UCE_WHAT,
    FaultSpec, parse_env,
)

ENV = ha_env.INJECT
ENV_LOG = ha_env.INJECT_LOG  # optional: append a JSON line per fired fault
#: value every element of the tensor hit by ``fault=uce`` gets (finite, positive: Adam's
#: ``exp_avg_sq`` stays a valid square, so training goes on with wrong numbers, not NaN)
UCE_GARBAGE = 1234.5
UCE_GARBAGE_INT = 12345
#: CUDA runtime's text for cudaErrorECCUncorrectable as torch raises it ("CUDA error: " +
#: cudaGetErrorString; CUDA Runtime API, error types), with torch's usual hint lines
UCE_MESSAGE = ("CUDA error: uncorrectable ECC error encountered\n"
               "CUDA kernel errors might be asynchronously reported at some other API call, so the "
               "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1")
#: gloo's text when the peer reset the TCP connection (gloo/transport/tcp/pair.cc, "Read
#: error " + peer address + ": " + strerror(ECONNRESET)); classified NETWORK, not PROCESS
NETWORK_MESSAGE = "[../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:{port}: Connection reset by peer"
_P2P_OPS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
_GRAD_SYNC_OPS = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
                  "all_reduce_coalesced", "reduce_scatter_coalesced",
                  # gloo: DDP's bucket ops are recorded inside torch's coalescing manager
                  # and launched as one at its exit, where comm's hook names the manager
                  "_coalescing_manager")


class Injector:
    """Fires the faults configured for this rank. Cheap when nothing is configured."""

    def __init__(self, rank: int, specs: List[FaultSpec]):
        self.rank = rank
        here = int(os.environ.get(ha_env.INCARNATION, "0") or 0)
        self.specs = [s for s in specs if s.rank == rank and s.incarnation == here]
        self._fired: set = set()  # specs that fired (each fires once per process)
        if any(s.fault == "network" for s in self.specs):
            self.install_comm_hook()

    @classmethod
    def from_env(cls, rank: int) -> "Injector":
        return cls(rank, parse_env(os.environ.get(ENV)))

    def armed(self, point: str, iteration: int) -> Optional[FaultSpec]:
        """The spec that fires at ``point`` of ``iteration``: one of that very iteration first,
        else a ``fault=slow`` of an iteration up to it (it fires at every one from its own
        on), else None."""
        slow = None
        for s in self.specs:
            if s.point != point or s in self._fired:
                continue
            if s.fault == "slow":
                if slow is None and iteration >= s.iteration:
                    slow = s
            elif s.iteration == iteration:
                return s
        return slow

    def _slow(self, point: str, iteration: int) -> None:
        """Every ``fault=slow`` of ``point`` armed at ``iteration`` sleeps (announced once)."""
        import time

        for spec in self.specs:
            if spec.fault != "slow" or spec.point != point or iteration < spec.iteration:
                continue
            if spec.iteration == iteration:
                self._announce(f"mindspeed-ha injector: slow rank {self.rank} at {point} from iteration {iteration}: "
                               f"{spec.sleep:g} s per iteration", spec, point, iteration)
            time.sleep(spec.sleep)

    def fire(self, point: str, iteration: int, target: Any = None) -> None:
        """Fire the fault armed for ``point`` of ``iteration``, if any.

        ``target``: the rank's state (an object with ``model`` and ``optimizer``, e.g. the
        runtime's ``DyingContext``), needed by ``fault=corrupt`` and ``fault=uce``; when
        None, the runtime's (``mindspeed_ha.runtime.get_runtime().ctx``). The runtime
        calls this through its fault points (``rt.injector``), which
        :func:`mindspeed_ha.patches.testing.attach_injector` sets to an Injector. ``fault=network``
        does nothing here: it fires from the communication hook (:meth:`on_collective`).

        Raises:
            InjectedFault: ``fault=raise``, ``fault=uce`` (after the damage).
            RuntimeError: ``corrupt`` / ``uce`` with no model or optimizer to damage.
        """
        self._slow(point, iteration)  # every iteration from the spec's on, whatever else fires here
        spec = self.armed(point, iteration)
        if spec is None or spec.fault in ("network", "slow"):
            return
        self._fired.add(spec)
        msg = f"mindspeed-ha injector: {spec.fault} rank {self.rank} at {point} of iteration {iteration}"
        if spec.fault in ("corrupt", "uce") and target is None:
            target = _runtime_target()
        if spec.fault == "corrupt":
            msg += f": {corrupt(target, spec.what, spec.how)}"
        if spec.fault == "uce":
            msg += f": {damage(target, spec.what)}"
        self._announce(msg, spec, point, iteration)
        if spec.fault == "kill_node":
            _kill_node()
        if spec.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return  # continued (SIGCONT): the hang is over
        if spec.fault == "hold":
            _hold(spec.iteration)
            return
        if spec.fault == "corrupt":
            return  # silent: training goes on with the corrupted state
        if spec.fault in _SIGNALS:
            who, sig = _SIGNALS[spec.fault]
            os.kill(os.getpid() if who == "self" else os.getppid(), getattr(signal, sig))
            return  # the signal's receiver acts; this rank goes on
        if spec.fault == "uce":
            raise InjectedFault(UCE_MESSAGE)
        raise InjectedFault(f"{msg} (Connection closed by peer [injected])")

    def _announce(self, msg: str, spec: FaultSpec, point: str, iteration: int) -> None:
        print(msg, flush=True)
        log_path = os.environ.get(ENV_LOG)
        if log_path:  # when it happened, for recovery-time measurements (wall clock, seconds)
            import json
            import time

            with open(log_path, "a") as f:
                f.write(json.dumps({"rank": self.rank, "point": point, "iteration": iteration,
                                    "fault": spec.fault, "pid": os.getpid(), "wall": time.time()}) + "\n")

    # ---- fault=network ----------------------------------------------------------------
    def install_comm_hook(self) -> None:
        """Make :meth:`on_collective` the fault hook of ``mindspeed_ha.recovery.comm``."""
        from mindspeed_ha.recovery import comm

        comm.set_fault_hook(self.on_collective)

    def on_collective(self, op_name: str, group) -> None:
        """The communication hook: called on the launching thread right after collective
        ``op_name`` on ``group`` was launched, before it is waited on. Raises the armed
        ``fault=network`` of the runtime's current iteration at the first match.

        Raises:
            InjectedFault: :data:`NETWORK_MESSAGE` (the peers stay inside the collective).
        """
        from mindspeed_ha.runtime import get_runtime

        rt = get_runtime()
        iteration = getattr(rt, "current", None)
        if iteration is None:
            return
        for spec in self.specs:
            if (spec.fault != "network" or spec.iteration != iteration or spec in self._fired
                    or not _matches(spec.point, op_name, group)):
                continue
            self._fired.add(spec)
            self._announce(f"mindspeed-ha injector: network rank {self.rank} at {spec.point} of iteration "
                           f"{iteration}: {op_name} failed", spec, spec.point, iteration)
            raise InjectedFault(NETWORK_MESSAGE.format(port=os.environ.get("MASTER_PORT", "29500")))


#: seconds a ``fault=hold`` waits for its release file at most, then goes on (logged)
HOLD_MAX_S = 300.0
_HOLD_POLL_S = 0.02  # polling an observable state (a file), not a synchronisation sleep


def _hold(iteration: int) -> None:
    """Wait until the release file (``MINDSPEED_HA_INJECT_RELEASE``) releases the hold of
    ``iteration`` (:func:`released`), at most :data:`HOLD_MAX_S`.

    Raises:
        ValueError: the variable is not set (a hold nobody can release), or the file holds
            something else than an iteration.
    """
    import time

    path = os.environ.get(ha_env.INJECT_RELEASE)
    if not path:
        raise ValueError(f"{ENV}: fault=hold needs {ha_env.INJECT_RELEASE} (the file that releases it)")
    end = time.monotonic() + HOLD_MAX_S
    while not released(path, iteration):
        if time.monotonic() > end:
            print(f"mindspeed-ha injector: hold not released after {HOLD_MAX_S:g} s ({path}): going on", flush=True)
            return
        time.sleep(_HOLD_POLL_S)


def released(path: str, iteration: int) -> bool:
    """Whether the release file ``path`` releases the hold of ``iteration``: it exists and is
    empty (every hold) or holds an integer >= ``iteration`` (the holds up to it: a test
    releases several holds one by one, writing the file with :func:`release`).

    Raises:
        ValueError: the file holds something else (naming it and ``MINDSPEED_HA_INJECT_RELEASE``).
    """
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return False
    if not text:
        return True
    try:
        return int(text) >= iteration
    except ValueError:
        raise ValueError(f"{ha_env.INJECT_RELEASE}: {path} holds {text[:40]!r}; accepted: nothing (every hold) "
                         "or an iteration (the holds up to it)") from None


def release(path: str, through: Optional[int] = None) -> None:
    """Release the holds of iterations up to ``through`` (every hold: None): the release
    file written whole under a temporary name, then renamed over ``path`` (a reader never
    sees it half-written, which would read as empty: every hold)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write("" if through is None else str(int(through)))
    os.replace(tmp, path)


def _kill_node() -> None:
    """SIGKILL this worker's launcher, then every other process it started, then this one."""
    import psutil

    launcher = psutil.Process(os.getppid())
    others = [p for p in launcher.children(recursive=True) if p.pid != os.getpid()]
    launcher.kill()
    for p in others:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def _op(op_name: str) -> str:
    return str(op_name).rsplit(".", 1)[-1]


def _matches(point: str, op_name: str, group) -> bool:
    """Whether collective ``op_name`` on ``group`` is one that ``point`` names (module docstring)."""
    op = _op(op_name)
    if point == "pp":
        return op in _P2P_OPS
    try:
        from megatron.core import parallel_state as mpu
    except ImportError:  # pragma: no cover - the injector runs with megatron-core
        return False
    if point == "tp":
        tp = mpu.get_tensor_model_parallel_group(check_initialized=False)
        return tp is not None and group is tp
    if point == "grad_sync":
        return op in _GRAD_SYNC_OPS and _is_dp_group(mpu, group) and _in_grad_sync()
    return False


def _is_dp_group(mpu, group) -> bool:
    candidates = []
    for kw in ({"with_context_parallel": True}, {"with_context_parallel": False},
               {"with_context_parallel": True, "partial_data_parallel": True}):
        try:
            candidates.append(mpu.get_data_parallel_group(**kw))
        except (AssertionError, TypeError, RuntimeError):
            pass
    for name in ("get_inter_partial_data_parallel_group", "get_expert_data_parallel_group"):
        fn = getattr(mpu, name, None)
        try:
            candidates.append(fn(check_initialized=False) if name == "get_expert_data_parallel_group" else fn())
        except (AssertionError, TypeError, RuntimeError):
            pass
    return any(group is g for g in candidates if g is not None)


def _in_grad_sync() -> bool:
    """Whether the caller runs inside DDP's gradient sync (a ``start_grad_sync`` frame):
    tells the gradient all-reduce from the loss all-reduce on the same DP group."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "start_grad_sync":
            return True
        frame = frame.f_back
    return False


def _runtime_target() -> Any:
    """The runtime's ``DyingContext`` (model, optimizer), or None."""
    try:
        from mindspeed_ha.runtime import get_runtime
    except ImportError:  # pragma: no cover
        return None
    rt = get_runtime()
    return getattr(rt, "ctx", None) if rt is not None else None


def _target_tensor(target: Any, what: str):
    """The tensor ``what`` names in ``target``'s model / optimizer (see the module docstring)."""
    if target is None:
        raise RuntimeError(f"fault=corrupt/uce,what={what}: no model/optimizer to damage (the runtime has none "
                           "before the first train_step)")
    if what == "gemm":  # point=check: the online check hands its GEMM result itself
        return target
    from mindspeed_ha.integrations import megatron_lm

    chunks = megatron_lm.unwrap_model(target.model)
    chunks = chunks if isinstance(chunks, list) else [chunks]
    params = [p for chunk in chunks for _, p in sorted(chunk.named_parameters())]
    if what == "param":
        return params[0]
    if what == "grad":
        grad = getattr(params[0], "main_grad", None)
        if grad is None:
            raise RuntimeError("fault=uce,what=grad: the first parameter has no main_grad (megatron DDP's "
                               "gradient buffer)")
        return grad
    from mindspeed_ha.checkpoint.shards import unwrap_distributed_optimizer as unwrap

    key = "param" if what == "main_param" else what
    opt = unwrap(target.optimizer)
    if opt is None:  # every DP rank holds the whole state: the inner optimizer's first main param
        opts = getattr(target.optimizer, "chained_optimizers", None) or [target.optimizer]
        for o in opts:
            inner = getattr(o, "optimizer", None)
            for group in getattr(inner, "param_groups", []):
                for p in group["params"]:
                    if key == "param":
                        return p
                    if key in inner.state.get(p, {}):
                        return inner.state[p][key]
        raise RuntimeError(f"fault={'corrupt/uce'},what={what}: the optimizer holds no {key} yet "
                           "(Adam's state appears at the first update)")
    for p in params:
        if p in opt.model_param_group_index_map:
            return opt._get_main_param_and_optimizer_states(p)[key]
    raise RuntimeError(f"fault=corrupt,what={what}: this rank's shard holds no parameter")


def corrupt(target: Any, what: str, how: str) -> str:
    """Corrupt the first element of the tensor ``what`` of ``target`` in place; describe it."""
    import torch

    t = _target_tensor(target, what)
    flat = t.data.view(-1)
    before = float(flat[0])
    with torch.no_grad():
        if how == "nan":
            flat[0] = float("nan")
        else:
            ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
            flat[:1].view(ints).bitwise_xor_(1)
    return f"{what} {tuple(t.shape)} {t.dtype}: element 0 {before!r} -> {float(flat[0])!r} ({how})"


def damage(target: Any, what: str) -> str:
    """Overwrite the WHOLE tensor ``what`` of ``target`` in place with :data:`UCE_GARBAGE`
    (integers: :data:`UCE_GARBAGE_INT`); describe it. What a UCE leaves: nothing of the
    tensor can be trusted."""
    import torch

    t = _target_tensor(target, what)
    with torch.no_grad():
        t.data.fill_(UCE_GARBAGE if t.is_floating_point() else UCE_GARBAGE_INT)
    return f"{what} {tuple(t.shape)} {t.dtype}: all {t.numel()} elements overwritten"
