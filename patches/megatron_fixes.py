"""Fixes for megatron-core 0.12.1 bugs on the no-TransformerEngine / plain torch AdamW path.

Feature ``core`` (always on). Each wrapper acts only where stock megatron-core would
crash or silently compute the wrong thing, and passes every other call through:

* ``quantize_param_shard`` raises "Invalid Transformer Engine version" after every
  DistributedOptimizer step even with no fp8 params: skipped when there are none.
* ``DistributedOptimizer.state_dict`` asserts exactly one AdamW ``step``; on a fresh
  optimizer (no state yet) there is none: report step 0 instead of failing.
* ``DistributedOptimizer.load_state_dict`` gives every param one *shared* ``step``
  tensor that torch AdamW then advances once per param (resume silently wrong): each
  param gets its own copy.
* ``DistributedOptimizer.load_state_dict`` re-applies saved param groups by position
  (distrib_optimizer.py ``load_state_dict``); under ``torch_dist`` with
  ``fully_sharded_model_space`` the groups come from global rank 0 only, so a pipeline
  stage whose groups are in another order resumes with weight decay on the wrong
  params, silently, on every device. Saved groups are matched to this optimizer's by
  their key ``(wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)`` (the key
  megatron-core's ``_get_param_groups`` builds them from) before the stock load.
* ``DistributedOptimizer._set_main_param_and_optimizer_states`` raises KeyError
  ``'step'`` (torch AdamW keeps ``step`` in its state, the parameter file does not) and
  copies into leaf params outside ``no_grad``: the current ``step`` is kept, copy runs
  under ``no_grad`` (also under MindSpeed's stand-in Apex FusedAdam, its own AdamW).
* A ``torch_dist`` resume at another tensor-parallel size reads uninitialised memory
  (dist_checkpointing/strategies/resharding.py ``reformulate_single_nd_flattened_tensor``,
  its ``sh_ten_merge_fn``): a distributed-optimizer state (``fp32_param``, ``exp_avg``,
  ``exp_avg_sq``) is reassembled in a ``torch.empty`` tensor of the new local shape and
  only the part the checkpoint holds is copied in. For a tensor whose global shape may
  differ (``allow_shape_mismatch``: the word embeddings and output layer, whose vocabulary
  is padded to a multiple of ``--make-vocab-size-divisible-by`` x TP, e.g. 4224 rows at
  TP1, 4352 at TP2) the new padding rows keep whatever the allocator left there; the
  ``fp32_param`` is then copied into the parameter (fp32: the same memory), so the
  padded logits, the loss and every later step depend on it: resumed TP1 PP2 -> TP2 PP1,
  the same command gave bitwise-equal runs, a loss of 35.2 or NaN. Megatron-core's
  stated rule for these tensors (strategies/torch.py ``_mcore_to_torch_sharded_tensor``:
  "initialized with zeros prior to loading (not all parts of the tensor will be read
  from the checkpoint)", which it applies to the parameter itself) is applied to the
  reassembled state: what lies outside the checkpoint's global shape is zero.
"""

from __future__ import annotations

from .registry import Patch

_DO = "megatron.core.optimizer.distrib_optimizer"


def _plain_adamw() -> bool:
    """True when megatron fell back to torch AdamW (no Apex, no TransformerEngine)."""
    import sys

    return not getattr(sys.modules[_DO], "HAVE_APEX_OR_TE", True)


def _no_real_apex_or_te() -> bool:
    """True unless megatron's ``Adam`` is a real Apex or TransformerEngine FusedAdam.

    MindSpeed registers a dummy ``apex.optimizers.FusedAdam`` (its own AdamW,
    mindspeed/features_manager/megatron_basic/requirements_basic.py ``optimizer_selection``),
    so ``HAVE_APEX_OR_TE`` is True with neither installed: the copy into the main params
    on resume still needs ``no_grad``."""
    import sys

    mod = sys.modules[_DO]
    if not getattr(mod, "HAVE_APEX_OR_TE", True):
        return True
    origin = getattr(getattr(mod, "Adam", None), "__module__", "") or ""
    return not origin.startswith(("apex.", "transformer_engine."))


def _quantize_param_shard(wrapped, instance, args, kwargs):
    model_params = args[0] if args else kwargs.get("model_params")
    if model_params is not None and len(model_params) == 0:
        return None  # no fp8 params: nothing to quantize (stock raises without TE)
    return wrapped(*args, **kwargs)


def _state_dict(wrapped, instance, args, kwargs):
    if not (_plain_adamw() and len(instance.optimizer.state) == 0):
        return wrapped(*args, **kwargs)
    # Fresh torch AdamW: no 'step' yet. Same layout as stock, step 0.
    inner = instance.optimizer.state_dict()
    out = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
    for group in out["optimizer"]["param_groups"]:
        del group["params"]
        group["step"] = 0
    if instance.grad_scaler:
        out["grad_scaler"] = instance.grad_scaler.state_dict()
    return out


def _load_state_dict(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if _plain_adamw():
        seen = set()
        for state in instance.optimizer.state.values():
            step = state.get("step")
            if step is not None and id(step) in seen:
                state["step"] = step.detach().clone()
            elif step is not None:
                seen.add(id(step))
    return result


_GROUP_KEY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def _group_key(group):
    return tuple(group.get(k) for k in _GROUP_KEY)


def _param_groups_by_key(wrapped, instance, args, kwargs):
    state_dict = args[0] if args else kwargs.get("state_dict")
    saved = (state_dict or {}).get("optimizer", {}).get("param_groups")
    own = instance.optimizer.param_groups
    if saved and len(saved) == len(own):
        by_key = {_group_key(g): g for g in saved}
        want = [_group_key(g) for g in own]
        if len(by_key) == len(saved) and set(want) == set(by_key) and want != [_group_key(g) for g in saved]:
            state_dict["optimizer"] = dict(state_dict["optimizer"], param_groups=[by_key[k] for k in want])
    return wrapped(*args, **kwargs)


def _set_main_param_and_optimizer_states(wrapped, instance, args, kwargs):
    import torch

    model_param = args[0] if args else kwargs["model_param"]
    tensors = args[1] if len(args) > 1 else kwargs["tensors"]
    if (not _no_real_apex_or_te() or instance.ddp_config.use_custom_fsdp
            or instance.config.use_precision_aware_optimizer):
        return wrapped(*args, **kwargs)
    group_index, group_order = instance.model_param_group_index_map[model_param]
    main_param = instance.optimizer.param_groups[group_index]["params"][group_order]
    state = instance.optimizer.state.get(main_param, {})
    if "step" in state and "step" not in tensors:
        tensors = dict(tensors, step=state["step"])  # keep the loaded step (copy onto itself)
    with torch.no_grad():
        return wrapped(model_param, tensors)


def _reshard_outside_checkpoint_zeroed(wrapped, instance, args, kwargs):
    """``reformulate_single_nd_flattened_tensor(sh_ten, reformulation_metadata)``: its
    factory's merge zeroes the elements of ``sh_ten``'s local chunk that lie outside the
    checkpoint's global shape (``allow_shape_mismatch`` tensors only; others are covered
    whole by the checkpoint)."""
    factory = wrapped(*args, **kwargs)
    sh_ten = args[0] if args else kwargs["sh_ten"]
    rmd = args[1] if len(args) > 1 else kwargs["reformulation_metadata"]
    if not getattr(sh_ten, "allow_shape_mismatch", False) or not hasattr(factory, "merge_fn"):
        return factory
    skip = sh_ten.prepend_axis_num
    offsets = sh_ten.global_offset[skip:]
    saved = rmd.ckpt_orig_global_shape[skip:]
    # per dimension, how many leading local rows exist in the checkpoint (padding is at the end)
    inside = [max(0, min(n, s - o)) for n, s, o in zip(sh_ten.local_shape, saved, offsets)]
    if list(inside) == list(sh_ten.local_shape):
        return factory
    merge, flat_range = factory.merge_fn, sh_ten.flattened_range

    def merge_fn(sub_state_dict):
        flat = merge(sub_state_dict)
        _zero_outside(flat, sh_ten.local_shape, inside, flat_range.start if flat_range is not None else 0)
        return flat

    factory.merge_fn = merge_fn
    return factory


#: elements whose coordinates one pass of :func:`_zero_outside` computes (bounded memory)
_ZERO_CHUNK = 1 << 22


def _zero_outside(flat, shape, inside, start: int) -> None:
    """Zero the elements of ``flat`` (elements ``start..`` of a row-major tensor of ``shape``)
    whose coordinate in some dimension d is >= ``inside[d]``; coordinates are computed
    ``_ZERO_CHUNK`` elements at a time, so memory stays bounded for a large embedding."""
    import torch

    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(shape[d + 1])
    n = flat.numel()
    with torch.no_grad():
        for lo in range(0, n, _ZERO_CHUNK):
            hi = min(n, lo + _ZERO_CHUNK)
            rest = torch.arange(start + lo, start + hi, dtype=torch.int64)
            outside = torch.zeros(hi - lo, dtype=torch.bool)
            for stride, limit in zip(strides, inside):
                outside |= (rest // stride) >= limit
                rest = rest % stride
            flat[lo:hi].masked_fill_(outside.to(flat.device), 0)


PATCHES = [
    Patch("fix.quantize_param_shard", _DO, "quantize_param_shard", _quantize_param_shard, "core",
          doc="skip fp8 quantize when there are no fp8 params (stock raises without TE)"),
    Patch("fix.dist_opt_state_dict", _DO, "DistributedOptimizer.state_dict", _state_dict, "core",
          doc="fresh torch-AdamW DistributedOptimizer.state_dict(): step 0 instead of assert"),
    Patch("fix.dist_opt_load_state_dict", _DO, "DistributedOptimizer.load_state_dict",
          _load_state_dict, "core",
          doc="torch AdamW: one step tensor per param after load (stock shares one)"),
    Patch("fix.dist_opt_param_groups_by_key", _DO, "DistributedOptimizer.load_state_dict",
          _param_groups_by_key, "core",
          doc="load: saved param groups matched by (wd_mult, lr_mult, ...) key, not by position"),
    Patch("fix.dist_ckpt_reshard_padding", "megatron.core.dist_checkpointing.strategies.resharding",
          "reformulate_single_nd_flattened_tensor", _reshard_outside_checkpoint_zeroed, "core",
          doc="torch_dist resume at another TP: optimizer state outside the saved shape (vocab padding) is zero, "
              "not uninitialised memory"),
    Patch("fix.dist_opt_set_states", _DO, "DistributedOptimizer._set_main_param_and_optimizer_states",
          _set_main_param_and_optimizer_states, "core",
          doc="torch AdamW: keep 'step' and copy under no_grad when loading parameter state"),
]
