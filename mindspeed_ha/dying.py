"""Dying checkpoint [TTP]: surviving ranks write one consistent Megatron checkpoint.

Runs in the processor's action thread while the training thread may be blocked in a
collective with a dead peer, so nothing here uses a collective. Three phases, each
driven by the controller (``control.policy``):

1. ``dump``: every chosen *shard saver* writes its distributed-optimizer shard (main
   params, ``exp_avg``, ``exp_avg_sq``; fp32) in place into the stage's
   ``iter_XXXXXXX/mp_rank_TT[_PPP]/distrib_optim.pt`` under
   ``<save>/.mindspeed_ha_dying_iter_XXXXXXX/``: the file is megatron-core's DP-zero
   format (the layout ``DistributedOptimizer.get_parameter_state_dp_zero`` produces and
   ``load_parameter_state`` reads; megatron/core/optimizer/distrib_optimizer.py,
   core_v0.12.1), DP-size independent (buckets unpadded), a ``torch.save`` archive whose
   layout every saver of the stage computes alike (:mod:`.recovery.dp_zero`), so each
   byte is written once, by the saver that holds it, in parallel with the others. Every
   chosen *model saver* writes ``model_optim_rng.pt`` there.
2. ``assemble``: one rank per (TP, PP) checks that the shard savers' ranges tile
   ``distrib_optim.pt`` exactly and sets its CRC-32 fields (a few bytes).
3. ``commit``: one rank validates the staged ``iter_XXXXXXX``, fsyncs, renames it into
   ``<save>`` and updates ``latest_checkpointed_iteration.txt`` (temp + fsync + rename).
   Until then a loader cannot see anything: the staging dir starts with a dot and the
   tracker still points at the previous checkpoint.

The state saved is the one consistent at the end of iteration ``k``: the controller
only picks ranks whose optimizer status is UPDATED(k) and that are frozen (they will
not start the update of ``k+1``); the RNG state is the snapshot taken when iteration
``k``'s optimizer update ended (:class:`IterationSnapshot`).

Failure (any exception in a phase, e.g. a full disk, or a saver's death): the controller
ends the job with EXIT(77) and every rank that took part removes the staging dir
(:func:`discard`, from the runtime's exit handler); the tracker is never touched and a
half-committed ``iter_XXXXXXX`` is moved back first (:func:`commit`).
``MINDSPEED_HA_KEEP_FAILED_STAGING=1`` keeps the staging dir for inspection.

Megatron-LM's names and file contents come from :mod:`mindspeed_ha.integrations.megatron_lm`.
"""

from __future__ import annotations

from mindspeed_ha import env as ha_env
from mindspeed_ha.errors import IntegrityError  # noqa: F401  (one error tree)
import contextlib
import copy
import gc
import hashlib
import logging
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from mindspeed_ha.control.integrity import IntegrityReport
from mindspeed_ha.integrations import megatron_lm as mlm
from mindspeed_ha.recovery import leftovers

log = logging.getLogger("mindspeed_ha.dying")

_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")

#: set to "1" to keep the staging directory of a failed dying checkpoint (debugging)
ENV_KEEP_FAILED_STAGING = ha_env.KEEP_FAILED_STAGING


@dataclass
class IterationSnapshot:
    """What a regular save of ``iteration`` would write that the live objects may no longer
    hold when the dying checkpoint is written (the training thread moved on, or stopped
    half-way through Megatron-LM's bookkeeping). Each value is taken where Megatron-LM
    holds it for ``iteration``, never recomputed from the iteration number.

    Filled in this order (:class:`mindspeed_ha.runtime.HARuntime` and
    ``patches/megatron_state.py``):

    1. the optimizer update of ``iteration`` ended: ``rng_state``;
    2. ``train_step`` returned: ``rerun_state``, ``scheduler_state`` (stepped by
       ``train_step`` after the update), ``consumed_before`` (the training loop has not
       counted the iteration yet), ``rng_states`` (gathered over the DP group with
       ``--data-parallel-random-init``: a collective, impossible once a peer is dead),
       ``returned``;
    3. Megatron-LM's ``train`` counted the iteration (``num_floating_point_operations``
       called right after ``consumed_train_samples`` / ``skipped_train_samples`` were
       increased): ``args`` (provisional), ``flops``;
    4. ``checkpoint_and_decide_exit(iteration, ..., num_floating_point_operations_so_far,
       ...)``, where Megatron-LM's periodic save of ``iteration`` runs (after the
       evaluation of ``iteration``): ``args`` and ``flops`` final, as that save sees them.
       Without Megatron-LM's loop (the built-in trainer): ``args`` when the next
       ``train_step`` starts.

    Attributes:
        iteration: the iteration whose update completed.
        rng_state: this rank's RNG state (:func:`~mindspeed_ha.integrations.megatron_lm.collect_rng_state`).
        rerun_state: the rerun state machine's checkpoint entry.
        rng_states: Megatron-LM's ``rng_state`` list (one state per DP rank under
            ``--data-parallel-random-init``, else None: ``[rng_state]``).
        scheduler_state: ``opt_param_scheduler.state_dict()`` as ``train_step`` left it.
        returned: ``train_step`` of ``iteration`` returned.
        consumed_before: ``args.consumed_train_samples`` then (the loop's count of
            ``iteration`` adds the batch to it right after).
        args: shallow copy of the run's args after Megatron-LM counted ``iteration``
            (``consumed_train_samples``, ``skipped_train_samples``, ``consumed_valid_samples``...).
        args_final: ``args`` were taken where a regular save of ``iteration`` reads them.
        flops: ``num_floating_point_operations_so_far`` after ``iteration`` (FLOPs).
        flops_before: the same after the previous iteration (None: unknown).
    """

    iteration: int
    rng_state: Any
    rerun_state: Any = None
    rng_states: Optional[List[Any]] = None
    scheduler_state: Optional[Dict[str, Any]] = None
    returned: bool = False
    consumed_before: Optional[int] = None
    args: Any = None
    args_final: bool = False
    flops: Optional[float] = None
    flops_before: Optional[float] = None

    def take_args(self, args, final: bool, flops: Optional[float] = None) -> None:
        """Keep a shallow copy of ``args`` (and ``flops`` when given) unless final ones are held."""
        if self.args_final or args is None:
            return
        self.args = copy.copy(args)
        self.args_final = final
        if flops is not None:
            self.flops = flops

    def count_flops(self, flops_in_batch: float) -> bool:
        """Megatron-LM's ``num_floating_point_operations_so_far += flops_in_batch`` for this
        iteration, once, after ``train_step`` returned. Returns whether it counted."""
        if not self.returned or self.flops is not None or self.flops_before is None:
            return False
        self.flops = self.flops_before + flops_in_batch
        return True


def staging_root(save_dir: str, iteration: int) -> str:
    """Hidden staging directory for the dying checkpoint of ``iteration`` (same filesystem as ``save_dir``)."""
    return os.path.join(save_dir, f".mindspeed_ha_dying_iter_{iteration:07d}")


def _atomic_torch_save(obj, path: str) -> None:
    """``torch.save(obj)`` to ``path`` through a temporary name, fsynced (each storage
    written once, straight from memory: :func:`.recovery.torch_file.save`)."""
    from mindspeed_ha.recovery import torch_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    torch_file.save(obj, tmp)
    os.replace(tmp, path)


def _unwrap_distributed_optimizer(optimizer):
    """The single DistributedOptimizer inside ``optimizer`` (or None for non-distributed ones)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    dist = [o for o in opts if isinstance(o, DistributedOptimizer)]
    if not dist:
        return None
    if len(dist) != 1 or len(opts) != 1:
        raise NotImplementedError("dying checkpoint supports one DistributedOptimizer per rank")
    return dist[0]


def _num_shards(opt) -> int:
    import torch

    group = opt.data_parallel_group
    return group.size() if hasattr(group, "size") else torch.distributed.get_world_size(group)


def _shard_buckets(opt, num_shards: int) -> Iterator[Tuple[int, int, Any, int, Dict[str, Any]]]:
    """This rank's shard, one bucket at a time: ``(gbuf_idx, buffer numel_unpadded, dtype_key,
    bucket_idx, {"param", "exp_avg", "exp_avg_sq": CPU fp32 T, "gbuf_world_numel",
    "numel_unpadded"})`` (see :func:`local_optimizer_shard`).

    Raises:
        IntegrityError: a main param or state does not have the size of its shard range.
    """
    import torch

    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        buf_numel = opt.buffers[gbuf_idx].numel_unpadded
        for dtype_key, range_maps in gbuf_range_maps.items():
            for bucket_idx, range_map in enumerate(range_maps):
                bucket = opt.buffers[gbuf_idx].buckets[bucket_idx]
                world_numel = bucket.grad_data.numel()
                local_numel = world_numel // num_shards
                shard = {k: torch.zeros((local_numel,), dtype=torch.float32) for k in _STATE_KEYS}
                for model_param, param_range in range_map["param_map"].items():
                    tensors = opt._get_main_param_and_optimizer_states(model_param)
                    lo, hi = param_range["gbuf_local"].start, param_range["gbuf_local"].end
                    for k in _STATE_KEYS:
                        t = tensors[k]
                        if t.numel() != hi - lo or not t.is_floating_point():
                            raise IntegrityError(
                                f"{k} of buffer {gbuf_idx} bucket {bucket_idx} [{lo}:{hi}]: {t.dtype} "
                                f"{tuple(t.shape)}, expected {hi - lo} floating-point values")
                        shard[k][lo:hi].copy_(t.detach().reshape(-1).to("cpu", torch.float32))
                shard["gbuf_world_numel"] = world_numel
                shard["numel_unpadded"] = bucket.numel_unpadded
                yield gbuf_idx, buf_numel, dtype_key, bucket_idx, shard


def local_optimizer_shard(optimizer) -> Dict[str, Any]:
    """This rank's distributed-optimizer shard as CPU fp32 tensors, per buffer and bucket.

    Returns:
        ``{"num_shards": c, "buffers": {gbuf_idx: {"numel_unpadded": int, "dtypes":
        {dtype_key: [ {"gbuf_world_numel": int, "numel_unpadded": int, "param": T,
        "exp_avg": T, "exp_avg_sq": T} per bucket ]}}}}`` where each ``T`` has shape
        ``(gbuf_world_numel // c,)`` and ``c`` is the optimizer instance size.
    """
    opt = _unwrap_distributed_optimizer(optimizer)
    num_shards = _num_shards(opt)
    buffers: Dict[int, Any] = {}
    for gbuf_idx, buf_numel, dtype_key, _, shard in _shard_buckets(opt, num_shards):
        buf = buffers.setdefault(gbuf_idx, {"numel_unpadded": buf_numel, "dtypes": {}})
        buf["dtypes"].setdefault(dtype_key, []).append(shard)
    return {"num_shards": num_shards, "buffers": buffers}


# ---- integrity: the digests the policy compares (control.integrity) -------------------
class _Digest:
    """blake2b over names, dtypes, shapes and bytes, in a fixed order; counts non-finite values.

    ``check_finite=False`` skips the count (same digest): a saver matching a trusted digest
    needs no second finite pass, equal bytes are the bytes verified finite.
    """

    def __init__(self, check_finite: bool = True):
        self._h = hashlib.blake2b(digest_size=16)
        self.check_finite = check_finite
        self.problems: List[str] = []

    def meta(self, text: str) -> None:
        self._h.update(text.encode() + b"\0")

    def tensor(self, name: str, t) -> None:
        import torch

        t = t.detach()
        self.meta(f"{name}|{t.dtype}|{tuple(t.shape)}")
        if self.check_finite and t.is_floating_point() and t.numel():
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                bad = int(t.numel() - finite.sum())
                self.problems.append(f"{name}: {bad} of {t.numel()} values not finite")
        flat = t.reshape(-1).contiguous().cpu()
        if flat.dtype is torch.bool:
            flat = flat.to(torch.uint8)
        self._h.update(flat.view(torch.uint8).numpy())

    def value(self, name: str, v: Any) -> None:
        if hasattr(v, "detach"):
            self.tensor(name, v)
        elif isinstance(v, dict):
            for k in sorted(v, key=repr):
                self.value(f"{name}.{k!r}", v[k])
        elif isinstance(v, (list, tuple)):
            self.meta(f"{name}|len={len(v)}")
            for i, item in enumerate(v):
                self.value(f"{name}[{i}]", item)
        else:
            self.meta(f"{name}={v!r}")

    def result(self) -> Tuple[bool, str, str]:
        """``(ok, hex digest, problems)``."""
        return not self.problems, self._h.hexdigest(), "; ".join(self.problems[:5])


def _bucket_name(bucket) -> str:
    gbuf_idx, buf_numel, dtype_key, bucket_idx, _ = bucket
    return f"buffer {gbuf_idx} ({buf_numel}) {dtype_key} bucket {bucket_idx}"


def _digest_shard_buckets(num_shards: int, buckets, check_finite: bool = True) -> Tuple[bool, str, str]:
    d = _Digest(check_finite)
    d.meta(f"num_shards={num_shards}")
    for bucket in buckets:
        name, b = _bucket_name(bucket), bucket[4]
        d.meta(f"{name}|{b['gbuf_world_numel']}|{b['numel_unpadded']}")
        for k in _STATE_KEYS:
            d.tensor(f"{k} of {name}", b[k])
    return d.result()


class _StreamingShardDigest(_Digest):
    """:func:`_digest_shard_buckets` (same value, no finite count) fed chunk by chunk by
    :func:`.recovery.dp_zero.write_shard` with the bytes it is about to write."""

    def __init__(self, num_shards: int):
        super().__init__(check_finite=False)
        self.meta(f"num_shards={num_shards}")
        self._bucket = ""

    def begin_bucket(self, item) -> None:
        self._bucket, b = _bucket_name(item), item[4]
        self.meta(f"{self._bucket}|{b['gbuf_world_numel']}|{b['numel_unpadded']}")

    def begin_tensor(self, name: str, t) -> None:
        self.meta(f"{name} of {self._bucket}|{t.dtype}|{tuple(t.shape)}")

    def update(self, data) -> None:
        self._h.update(data)


def shard_file_digest(shard: Dict[str, Any]) -> Tuple[bool, str, str]:
    """Digest of a shard as :func:`local_optimizer_shard` returns it (or as a shard file holds it)."""
    items = ((g, buf["numel_unpadded"], dk, i, b) for g, buf in sorted(shard["buffers"].items())
             for dk, buckets in buf["dtypes"].items() for i, b in enumerate(buckets))
    return _digest_shard_buckets(shard["num_shards"], items)


def _model_chunk_keys(n: int) -> List[str]:
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def _param_names(ctx: "DyingContext") -> Dict[str, List[str]]:
    chunks = mlm.unwrap_model(ctx.model)
    chunks = chunks if isinstance(chunks, list) else [chunks]
    return {key: sorted(name for name, _ in chunk.named_parameters())
            for key, chunk in zip(_model_chunk_keys(len(chunks)), chunks)}


def _digest_params(items, check_finite: bool = True) -> Tuple[bool, str, str]:
    d = _Digest(check_finite)
    for name, t in items:
        d.tensor(name, t)
    return d.result()


def model_state_digest(state: Dict[str, Any], names: Dict[str, List[str]],
                       check_finite: bool = True) -> Tuple[bool, str, str]:
    """Digest of the model parameters ``names`` (chunk key -> names) in a ``model_optim_rng.pt`` state."""
    return _digest_params(((f"{key}.{n}", state[key][n]) for key, ns in names.items() for n in ns), check_finite)


def _live_model_digest(ctx: "DyingContext", check_finite: bool = True) -> Tuple[bool, str, str]:
    chunks = mlm.unwrap_model(ctx.model)
    chunks = chunks if isinstance(chunks, list) else [chunks]
    params = {key: dict(chunk.named_parameters()) for key, chunk in zip(_model_chunk_keys(len(chunks)), chunks)}
    return _digest_params(((f"{key}.{n}", ps[n]) for key, ps in params.items() for n in sorted(ps)), check_finite)


def _live_shard_digest(ctx: "DyingContext", check_finite: bool = True) -> Tuple[bool, str, str]:
    """The optimizer part: the distributed optimizer's shard, else the whole optimizer state
    (a non-distributed optimizer, saved inside ``model_optim_rng.pt``); "" without optimizer."""
    opt = _unwrap_distributed_optimizer(ctx.optimizer)
    if opt is not None:
        num_shards = _num_shards(opt)
        return _digest_shard_buckets(num_shards, _shard_buckets(opt, num_shards), check_finite)
    if ctx.optimizer is None or getattr(ctx.args, "no_save_optim", False):
        return True, "", ""
    d = _Digest(check_finite)
    d.value("optimizer", ctx.optimizer.state_dict())
    return d.result()


def verify_state(ctx: "DyingContext", iteration: int) -> IntegrityReport:
    """The integrity of this rank's (frozen) state at ``iteration``: see :mod:`.control.integrity`.

    Reads every byte of the optimizer shard and of the model parameters once (copied to
    the CPU one bucket / one tensor at a time); called only after a fault, never per
    iteration. A layout error makes the part not ok instead of raising.
    """
    parts = {}
    with _gc_paused():
        for part, fn in (("shard", _live_shard_digest), ("model", _live_model_digest)):
            try:
                parts[part] = fn(ctx)
            except IntegrityError as exc:
                parts[part] = (False, "", str(exc))
    detail = "; ".join(f"{part}: {p[2]}" for part, p in parts.items() if p[2])
    return IntegrityReport(iteration, parts["shard"][0], parts["shard"][1], parts["model"][0],
                           parts["model"][1], detail)


def _expect(what: str, got: Tuple[bool, str, str], trusted: str) -> None:
    ok, digest, problems = got
    if not ok or digest != trusted:
        raise IntegrityError(f"{what}: digest {digest[:12]} != trusted {trusted[:12]}"
                             f"{f' ({problems})' if problems else ''}; the state changed after verification")


@dataclass
class DyingContext:
    """What a rank needs to take part in a dying checkpoint (set by the runtime)."""

    args: Any
    model: Any
    optimizer: Any
    opt_param_scheduler: Any
    tp_rank: int
    pp_rank: int
    pp_size: int
    shard_id: int


def checkpoint_format(args) -> str:
    """The run's ``--ckpt-format`` (``torch`` when the framework has no such flag)."""
    return getattr(args, "ckpt_format", None) or "torch"


def _model_state(ctx: DyingContext, iteration: int, snapshot: IterationSnapshot,
                 ckpt_format: str = "torch") -> Dict[str, Any]:
    """``model_optim_rng.pt`` of ``iteration`` as Megatron-LM's ``save_checkpoint`` writes it
    (key by key; ``tests/test_megatron_counters.py`` compares them), from ``snapshot``.

    What a fault kept Megatron-LM from doing for ``iteration`` is done on copies with
    Megatron-LM's own functions: the scheduler step when ``train_step`` did not return (a
    fault in the collectives after the optimizer update,
    :func:`~mindspeed_ha.integrations.megatron_lm.scheduler_after_step` and the param
    groups' learning rate it sets: a rank in the optimizer update's commit barrier or in
    the collectives after it), the training
    loop's count when the fault came before it
    (:func:`~mindspeed_ha.integrations.megatron_lm.count_iteration`).

    Raises:
        RuntimeError: ``--data-parallel-random-init`` and the DP ranks' RNG states of
            ``iteration`` were not gathered (a fault during that gather).
    """
    args, sched, flops = snapshot.args, snapshot.scheduler_state, snapshot.flops
    stepped = contextlib.nullcontext()
    if sched is None and ctx.opt_param_scheduler is not None:
        sched = mlm.scheduler_after_step(ctx.opt_param_scheduler, ctx.args)
        # ... and the learning rate / weight decay that step sets in the param groups
        stepped = mlm.param_groups_after_step(ctx.opt_param_scheduler, sched)
    if args is None:
        live = ctx.args
        if snapshot.returned and getattr(live, "consumed_train_samples", None) != snapshot.consumed_before:
            args = copy.copy(live)  # counted by the loop (the built-in trainer's: just before its save)
        else:
            args, flops = mlm.count_iteration(live, snapshot.flops_before)
    if flops is None:
        flops = getattr(args, "num_floating_point_operations_so_far", None)
    rng_states = snapshot.rng_states
    if rng_states is None:
        if mlm.needs_rng_gather(args):
            raise RuntimeError(f"iteration {iteration}: --data-parallel-random-init needs every data-parallel "
                               "rank's RNG state and they were not gathered (a fault during the gather)")
        rng_states = [snapshot.rng_state]
    with stepped:
        return mlm.generate_state_dict(
            args, mlm.unwrap_model(ctx.model), ctx.optimizer, ctx.opt_param_scheduler, rng_states,
            iteration=iteration, rerun_state=mlm.rerun_state(ckpt_format, snapshot.rerun_state),
            num_floating_point_operations_so_far=flops, ckpt_format=ckpt_format, scheduler_state=sched,
        )


class _Steps:
    """Seconds per named step of one phase on one rank (for the action's result line)."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def __str__(self) -> str:
        return " ".join(f"{k}={v:.3f}s" for k, v in self.seconds.items())


@contextmanager
def _gc_paused():
    """No cyclic garbage collection meanwhile: a full collection of a training process's
    heap takes tenths of a second (measured: 0.2-0.4 s in a stock Megatron-LM rank, hidden
    512), time a dying checkpoint does not have. The training thread is frozen; what the
    dump allocates is mostly tensors freed by reference counting."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _model_path(ctx: DyingContext, iteration: int) -> str:
    return mlm.get_checkpoint_name(staging_root(ctx.args.save, iteration), iteration,
                                   pipeline_parallel=ctx.pp_size > 1, tensor_rank=ctx.tp_rank,
                                   pipeline_rank=ctx.pp_rank)


def dump(ctx: DyingContext, iteration: int, snapshot: Optional[IterationSnapshot],
         write_shard: bool, write_model: bool, shard_digest: str = "", model_digest: str = "") -> str:
    """Phase 1 on one rank (garbage collection paused). Returns a one-line description of
    what was written, with the seconds of each step in brackets.

    ``shard_digest`` / ``model_digest``: the digests the policy trusted for this rank's
    shard / model (DumpPlan; "" = not verified). The bytes written are digested in memory,
    from the very buffers handed to the write, and must have them: the file then holds
    what the VERIFY round checked (finite, agreed by the majority) whatever the state did
    since. A mismatch fails the dump after the write; the staging dir is never
    published then (EXIT 77, :func:`discard`).

    Raises:
        RuntimeError: this rank has no snapshot for ``iteration`` (its state moved on).
        IntegrityError: what was written is not what was verified (the caller's action
            fails: EXIT 77, nothing published).
    """
    if snapshot is None or snapshot.iteration != iteration:
        have = None if snapshot is None else snapshot.iteration
        raise RuntimeError(f"no consistent state for iteration {iteration} (snapshot at {have})")
    with _gc_paused():
        return _dump(ctx, iteration, snapshot, write_shard, write_model, shard_digest, model_digest)


def _dump(ctx: DyingContext, iteration: int, snapshot: IterationSnapshot, write_shard: bool,
          write_model: bool, shard_digest: str, model_digest: str) -> str:
    steps = _Steps()
    if checkpoint_format(ctx.args) == "torch_dist":
        with steps("check"):
            if write_shard and shard_digest:
                _expect("optimizer shard in memory", _live_shard_digest(ctx, check_finite=False), shard_digest)
            if write_model and model_digest:
                _expect("model parameters in memory", _live_model_digest(ctx, check_finite=False), model_digest)
        with steps("write"):
            out = _dump_torch_dist(ctx, iteration, snapshot, write_shard, write_model)
        return f"{out} [{steps}]"
    opt = _unwrap_distributed_optimizer(ctx.optimizer)
    written = []
    if write_shard and opt is not None:
        written.append(_dump_dp_zero_shard(ctx, opt, iteration, shard_digest, steps))
    if write_model:
        written.append(_dump_model(ctx, opt, iteration, snapshot, shard_digest, model_digest, steps))
    return f"{', '.join(written)} [{steps}]" if written else "nothing"


def _dump_model(ctx: DyingContext, opt, iteration: int, snapshot: IterationSnapshot, shard_digest: str,
                model_digest: str, steps: "_Steps") -> str:
    """``model_optim_rng.pt``: state built, its parameters (and a non-distributed optimizer's
    state) digested in memory against the trusted digests, then written."""
    path = _model_path(ctx, iteration)
    rel = os.path.relpath(path, staging_root(ctx.args.save, iteration))
    with steps("model_state"):
        state = _model_state(ctx, iteration, snapshot)
    with steps("model_check"):
        if model_digest:
            _expect(f"model parameters of {rel}", model_state_digest(state, _param_names(ctx), False),
                    model_digest)
        if shard_digest and opt is None and "optimizer" in state:
            d = _Digest(check_finite=False)
            d.value("optimizer", state["optimizer"])
            _expect(f"optimizer state of {rel}", d.result(), shard_digest)
    with steps("model_write"):
        _atomic_torch_save(state, path)
    return rel


def _dump_dp_zero_shard(ctx: DyingContext, opt, iteration: int, shard_digest: str, steps: _Steps) -> str:
    """This rank's shard, written in place into the stage's ``distrib_optim.pt`` (:mod:`.recovery.dp_zero`),
    each chunk digested just before it is written; the digest must be the trusted one."""
    from mindspeed_ha.recovery import dp_zero

    num_shards = _num_shards(opt)
    path = mlm.get_distributed_optimizer_checkpoint_name(_model_path(ctx, iteration))
    rel = os.path.relpath(path, staging_root(ctx.args.save, iteration))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with steps("plan"):
        plan = dp_zero.FilePlan(dp_zero.layout_of(opt))
    digest = _StreamingShardDigest(num_shards) if shard_digest else None
    nbytes = dp_zero.write_shard(
        path, plan, ctx.shard_id, num_shards, _shard_buckets(opt, num_shards),
        staging_root(ctx.args.save, iteration), ctx.tp_rank, ctx.pp_rank, iteration, digest,
        timer=lambda step: steps(f"shard_{step}"))
    if digest is not None:
        _expect(f"shard {ctx.shard_id} written to {rel}", digest.result(), shard_digest)
    return f"{rel} shard {ctx.shard_id}/{num_shards} ({nbytes} B)"


def _load(path: str) -> Dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def parts_root(save_dir: str, iteration: int) -> str:
    """Where the savers of a ``torch_dist`` dying checkpoint write their parts."""
    return os.path.join(staging_root(save_dir, iteration), "parts")


def _dump_torch_dist(ctx: DyingContext, iteration: int, snapshot: IterationSnapshot,
                     write_shard: bool, write_model: bool) -> str:
    """Phase 1 for ``--ckpt-format torch_dist``: this saver's part(s), see :mod:`.recovery.torch_dist`.

    A shard saver writes the optimizer's sharded state of its (TP, PP, shard); a model
    saver everything else of its (TP, PP) position (model, RNG, rerun state), and the
    model saver of (TP 0, PP 0) the common state (``common.pt``), as global rank 0 does
    in a regular save.
    """
    from mindspeed_ha.recovery import torch_dist as td

    if not (write_shard or write_model):
        return "nothing"
    sharded, common = td.split_common(_model_state(ctx, iteration, snapshot, "torch_dist"))
    root = parts_root(ctx.args.save, iteration)
    written = []
    if write_shard:
        name = f"optim_tp{ctx.tp_rank:02d}_pp{ctx.pp_rank:03d}_s{ctx.shard_id:04d}"
        td.write_part({"optimizer": sharded.get("optimizer", {})}, os.path.join(root, name))
        written.append(name)
    if write_model:
        name = f"model_tp{ctx.tp_rank:02d}_pp{ctx.pp_rank:03d}"
        td.write_part({k: v for k, v in sharded.items() if k != "optimizer"}, os.path.join(root, name))
        if ctx.tp_rank == 0 and ctx.pp_rank == 0:
            td.write_common(common, os.path.join(root, name))
        written.append(name)
    return "torch_dist parts " + ", ".join(written)


def assemble(ctx: DyingContext, iteration: int) -> str:
    """Phase 2 on one rank per (TP, PP), after every saver: ``distrib_optim.pt`` checked
    complete (every byte of every tensor written by exactly one shard saver) and its
    CRC-32 fields set (:func:`.recovery.dp_zero.finalize`; ``torch``). ``torch_dist``
    parts are merged by :func:`commit`.

    Raises:
        DPZeroError: a shard saver's writes are missing or do not tile the file.
    """
    if checkpoint_format(ctx.args) == "torch_dist":
        return "torch_dist: parts are merged at commit"
    opt = _unwrap_distributed_optimizer(ctx.optimizer)
    if opt is None:
        return "no distributed optimizer: nothing to assemble"
    from mindspeed_ha.recovery import dp_zero

    steps = _Steps()
    path = mlm.get_distributed_optimizer_checkpoint_name(_model_path(ctx, iteration))
    with _gc_paused():
        with steps("plan"):
            plan = dp_zero.FilePlan(dp_zero.layout_of(opt))
        with steps("finalize"):
            dp_zero.finalize(path, plan, _num_shards(opt), staging_root(ctx.args.save, iteration),
                             ctx.tp_rank, ctx.pp_rank, iteration)
    return f"{os.path.relpath(path, staging_root(ctx.args.save, iteration))} complete [{steps}]"


def commit(save_dir: str, iteration: int) -> str:
    """Phase 3 on one rank: validate, rename into ``save_dir``, update the tracker.

    An ``iter_XXXXXXX`` of ``iteration`` that the tracker names (a regular save that
    completed) is kept instead. One the tracker does not name was left by a regular save
    the fault interrupted: it is never published; it is moved aside and deleted once this
    checkpoint is published (:mod:`.recovery.leftovers`; a later-iteration one too, unless
    it validates).

    Raises:
        CheckpointError, OSError: nothing was published: a staged directory already renamed
            to ``iter_XXXXXXX`` is moved back into the staging dir (for :func:`discard`)
            unless the tracker already names it; the tracker is untouched.
    """
    root = staging_root(save_dir, iteration)
    staged = mlm.get_checkpoint_name(root, iteration, return_base_dir=True)
    final = mlm.get_checkpoint_name(save_dir, iteration, return_base_dir=True)
    # A regular save interrupted by the fault left an unpublished (maybe half-written)
    # iter_XXXXXXX: never published, moved aside, deleted once this one is published.
    aside = leftovers.set_aside(save_dir, iteration)
    if os.path.isdir(final):
        # A periodic save of the same iteration already published it (the tracker names it): keep it.
        mlm.validate_checkpoint_dir(final, iteration)
        shutil.rmtree(root, ignore_errors=True)
        leftovers.remove(aside)
        return f"{final} (already saved by a periodic checkpoint)"
    steps = _Steps()
    try:
        parts = parts_root(save_dir, iteration)
        with _gc_paused():  # validation unpickles; a full collection here cost 0.2 s (measured)
            if os.path.isdir(parts):  # torch_dist: one DCP checkpoint from the savers' parts
                from mindspeed_ha.recovery import torch_dist as td

                with steps("merge"):
                    td.merge_parts([os.path.join(parts, n) for n in sorted(os.listdir(parts))], staged)
                    os.rmdir(parts)
            with steps("publish"):
                mlm.commit_checkpoint(staged, save_dir, iteration)
    except BaseException:
        renamed = os.path.isdir(final) and not os.path.exists(staged)
        if renamed and mlm.read_tracker_iteration(save_dir) != iteration:
            os.rename(final, staged)  # not published: a loader never sees a half-committed dir
        raise
    with steps("cleanup"):
        shutil.rmtree(root, ignore_errors=True)
        leftovers.remove(aside)
    return f"{final} [{steps}]"


def discard(save_dir: str, iteration: int) -> str:
    """Remove the staging dir of a failed dying checkpoint; never touches the tracker.

    Kept instead when ``MINDSPEED_HA_KEEP_FAILED_STAGING=1`` (to inspect what was written).
    Idempotent and safe to run on several ranks at once. Returns what was done.
    """
    root = staging_root(save_dir, iteration)
    leftovers.sweep(save_dir)  # what a failed commit moved aside: never a checkpoint to keep
    if os.environ.get(ENV_KEEP_FAILED_STAGING) == "1":
        return f"kept {root} ({ENV_KEEP_FAILED_STAGING}=1)"
    # Move it away (atomic) before deleting: a commit still running elsewhere (the
    # controller timed it out) has then either renamed its complete, validated
    # iter_XXXXXXX out already or fails on that rename; it never publishes a directory
    # that is being emptied. A saver still writing recreates ``root``, and removes it on
    # its own EXIT after its last write.
    trash = f"{root}.discard.{os.getpid()}"
    try:
        os.rename(root, trash)
    except FileNotFoundError:
        return f"{root}: already removed"
    shutil.rmtree(trash, ignore_errors=True)
    return f"removed {root}"
