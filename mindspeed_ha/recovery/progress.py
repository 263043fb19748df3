"""A rank's training progress, handed to a restarted process (ARF) in memory.

A process the launcher restarted (``--enable-worker-reboot``) builds its model and
optimizer without loading a checkpoint; :mod:`mindspeed_ha.recovery.transfer` gives it
the tensors (parameters, optimizer shard) of a replica holder. What a checkpoint load
would also have set comes from the same holder as one small message (this module):

* Megatron-LM's counters of the last completed iteration k: ``iteration``,
  ``consumed_train_samples``, ``skipped_train_samples``, ``consumed_valid_samples``,
  ``num_floating_point_operations_so_far`` (Megatron-LM core_v0.12.1
  ``checkpointing.py`` ``load_checkpoint`` sets these on ``args``; ``training.py``
  ``train`` starts from ``args.iteration`` and ``args.num_floating_point_operations_so_far``,
  the data samplers from ``args.consumed_train_samples``);
* the learning-rate scheduler's ``state_dict()`` (``OptimizerParamScheduler.load_state_dict``
  takes it back and sets the param groups' learning rate);
* megatron-core's ``RerunStateMachine.current_iteration`` (a checkpoint holds it; a fresh
  process would count from 0);
* megatron-core's dist-checkpointing queue index (``dist_checkpointing.strategies.base.
  async_calls.call_idx``, megatron-core 0.12.1 ``async_utils.AsyncCallsQueue``): every
  ``torch_dist`` save all-reduces it and asserts all ranks agree ("Unmatched async
  calls"), so a restarted process counts the saves its holder made;
* the RNG state at the entry of step k+1 (python, numpy, torch, device, the
  tensor-parallel tracker: :func:`mindspeed_ha.integrations.megatron_lm.collect_rng_state`):
  a holder with the same tensor- and pipeline-parallel rank draws the same numbers
  (Megatron-LM seeds by ``seed + 100 * pp_rank`` and the TP rank, not the DP rank, unless
  ``--data-parallel-random-init``, which a rejoin refuses).

When the death hit the optimizer update of iteration j (roll forward with rejoin, see
:mod:`mindspeed_ha.control.recovery_plan`), the holder is inside that update: the message
then holds the progress at the entry of j's update (counters and scheduler of j-1, the
RNG after j's forward-backward, the rerun state machine's count of j-1) and a
``forward`` part: what the restarted process's catch-up step j answers instead of
computing (:func:`forward_part`): the forward-backward's per-micro-batch losses
(``losses_reduced``, same PP stage as the holder, DP-reduced by the loss function), the
gradient norm and zero count of j's ``optimizer.step()``, and the samples step j
consumed (``num_microbatches * micro_batch_size * data_parallel_size``, Megatron-LM
core_v0.12.1 ``train``).

Wire: msgpack (no pickle), versioned, at most :data:`MAX_BYTES`; sent point to point over
a process group as a length header (int64) and a uint8 tensor.
"""

from __future__ import annotations

from mindspeed_ha.errors import ProgressError  # noqa: F401  (one error tree)
import random  # noqa: F401  (documented source of the python RNG state)
from typing import Any, Dict, Optional

import msgpack
import numpy as np
import torch

VERSION = 1
#: largest progress message, bytes (the RNG states are ~5 KB, the rest < 1 KB)
MAX_BYTES = 1 << 20
#: the args fields a checkpoint load sets that a restarted process takes from its holder
ARGS_FIELDS = ("iteration", "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples",
               "num_floating_point_operations_so_far")


def _tensor(t: torch.Tensor) -> Dict[str, Any]:
    t = t.detach().cpu().contiguous()
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "data": t.numpy().tobytes()}


def _untensor(d: Dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"])
    return torch.frombuffer(bytearray(d["data"]), dtype=dtype).reshape(d["shape"]).clone()


def encode_rng(state: Dict[str, Any]) -> Dict[str, Any]:
    """``collect_rng_state()`` -> msgpack-able (tensors and numpy arrays as bytes)."""
    version, internal, gauss = state["random_rng_state"]
    name, keys, pos, has_gauss, cached = state["np_rng_state"]
    return {
        "random": [version, list(internal), gauss],
        "numpy": [name, np.asarray(keys, dtype=np.uint32).tobytes(), int(pos), int(has_gauss), float(cached)],
        "torch": _tensor(state["torch_rng_state"]),
        "device": _tensor(state["cuda_rng_state"]),
        "tracker": {k: _tensor(v) for k, v in state["rng_tracker_states"].items()},
    }


def decode_rng(d: Dict[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`encode_rng`."""
    version, internal, gauss = d["random"]
    name, keys, pos, has_gauss, cached = d["numpy"]
    return {
        "random_rng_state": (version, tuple(internal), gauss),
        "np_rng_state": (name, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached),
        "torch_rng_state": _untensor(d["torch"]),
        "cuda_rng_state": _untensor(d["device"]),
        "rng_tracker_states": {k: _untensor(v) for k, v in d["tracker"].items()},
    }


def encode_value(value: Any) -> Any:
    """A loss structure (dicts, lists, tuples of tensors, numbers, strings, None) ->
    msgpack-able, tensors as bytes (dtype and shape kept).

    Raises:
        ProgressError: a value of another type.
    """
    if isinstance(value, torch.Tensor):
        return {"__t": _tensor(value)}
    if isinstance(value, dict):
        return {"__d": [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ProgressError(f"cannot send a {type(value).__name__} in a progress message")


def decode_value(value: Any, device: Optional[torch.device] = None) -> Any:
    """The inverse of :func:`encode_value` (tensors on ``device``, default CPU)."""
    if isinstance(value, dict):
        if "__t" in value:
            t = _untensor(value["__t"])
            return t.to(device) if device is not None else t
        if "__d" in value:
            return {decode_value(k, device): decode_value(v, device) for k, v in value["__d"]}
        if "__tuple" in value:
            return tuple(decode_value(v, device) for v in value["__tuple"])
        raise ProgressError(f"malformed value in a progress message: keys {sorted(value)}")
    if isinstance(value, list):
        return [decode_value(v, device) for v in value]
    return value


def forward_part(iteration: int, losses: Any, grad_norm: Optional[float], num_zeros: Optional[float],
                 samples: int) -> Dict[str, Any]:
    """The ``forward`` part of a progress message (see the module docstring).

    Args:
        iteration: j, the step whose update the death hit.
        losses: the forward-backward's return of step j on the holder (``losses_reduced``).
        grad_norm: the gradient norm ``optimizer.step()`` of j computed (None: none).
        num_zeros: its zero count (None unless ``--log-num-zeros-in-grad``).
        samples: samples step j consumed (the loop adds them after ``train_step``).
    """
    return {"iteration": int(iteration), "losses": encode_value(losses),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "num_zeros": None if num_zeros is None else float(num_zeros), "samples": int(samples)}


def capture(args, iteration: int, scheduler_state: Optional[dict], rng_state: Optional[dict],
            flops: Optional[float] = None, rerun_iteration: Optional[int] = None,
            forward: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The progress of completed iteration ``iteration`` (see the module docstring).

    Args:
        args: the run's args as the training loop left them after counting ``iteration``.
        iteration: k.
        scheduler_state: ``opt_param_scheduler.state_dict()`` after step k (None: no scheduler).
        rng_state: ``collect_rng_state()`` at the entry of step k+1.
        flops: the training loop's FLOP count after k (None: ``args``' own).
        rerun_iteration: megatron-core's ``RerunStateMachine.current_iteration`` after k
            (it counts the steps this process ran; a checkpoint holds it).
        forward: :func:`forward_part` (roll forward with rejoin), or None.
    """
    fields = {f: getattr(args, f, None) for f in ARGS_FIELDS}
    fields["iteration"] = int(iteration)
    if flops is not None:
        fields["num_floating_point_operations_so_far"] = flops
    return {"v": VERSION, "args": fields, "scheduler": scheduler_state,
            "rng": encode_rng(rng_state) if rng_state is not None else None,
            "rerun_iteration": rerun_iteration, "forward": forward, "ckpt_call_idx": _ckpt_call_idx()}


_DIST_CKPT_BASE = "megatron.core.dist_checkpointing.strategies.base"


def _ckpt_call_idx() -> Optional[int]:
    """The dist-checkpointing queue's index of the last save (None: that module was never
    imported here, i.e. no ``torch_dist`` save)."""
    import sys

    mod = sys.modules.get(_DIST_CKPT_BASE)
    calls = getattr(mod, "async_calls", None) if mod is not None else None
    idx = getattr(calls, "call_idx", None)
    return int(idx) if isinstance(idx, int) else None


def encode(progress: Dict[str, Any]) -> bytes:
    blob = msgpack.packb(progress, use_bin_type=True)
    if len(blob) > MAX_BYTES:
        raise ProgressError(f"progress message of {len(blob)} bytes > {MAX_BYTES}")
    return blob


def decode(blob: bytes) -> Dict[str, Any]:
    if len(blob) > MAX_BYTES:
        raise ProgressError(f"progress message of {len(blob)} bytes > {MAX_BYTES}")
    try:
        progress = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    except (ValueError, msgpack.exceptions.ExtraData) as exc:
        raise ProgressError(f"malformed progress message: {exc}") from exc
    if not isinstance(progress, dict) or progress.get("v") != VERSION:
        raise ProgressError(f"progress message of version {progress.get('v') if isinstance(progress, dict) else '?'}"
                            f", expected {VERSION}")
    return progress


def send(progress: Dict[str, Any], dst: int, group=None, device: Optional[torch.device] = None) -> int:
    """Send ``progress`` to global rank ``dst`` (which calls :func:`recv`). Returns bytes sent."""
    import torch.distributed as dist

    from mindspeed_ha.recovery.pair_link import PairLink

    blob = encode(progress)
    device = device or torch.device("cpu")
    send_one = group.send if isinstance(group, PairLink) else (lambda t, peer: dist.send(t, peer, group=group))
    send_one(torch.tensor([VERSION, len(blob)], dtype=torch.int64, device=device), dst)
    send_one(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device), dst)
    return len(blob)


def recv(src: int, group=None, device: Optional[torch.device] = None) -> Dict[str, Any]:
    """Receive a progress message from global rank ``src``.

    Raises:
        ProgressError: another version, or larger than :data:`MAX_BYTES`.
    """
    import torch.distributed as dist

    from mindspeed_ha.recovery.pair_link import PairLink

    device = device or torch.device("cpu")
    recv_one = group.recv if isinstance(group, PairLink) else (lambda t, peer: dist.recv(t, peer, group=group))
    head = torch.zeros(2, dtype=torch.int64, device=device)
    recv_one(head, src)
    version, n = int(head[0]), int(head[1])
    if version != VERSION or not 0 < n <= MAX_BYTES:
        raise ProgressError(f"progress header from rank {src}: version {version}, {n} bytes (expected version "
                            f"{VERSION}, at most {MAX_BYTES})")
    buf = torch.zeros(n, dtype=torch.uint8, device=device)
    recv_one(buf, src)
    return decode(bytes(buf.cpu().numpy().tobytes()))


def apply(progress: Dict[str, Any], args, opt_param_scheduler=None) -> None:
    """Set ``args``' counters and the scheduler's state from ``progress`` (as a checkpoint
    load would). The RNG state is not set here: the caller sets it at the step's entry
    (:func:`decode_rng`)."""
    for field, value in progress["args"].items():
        if value is not None:
            setattr(args, field, value)
    if opt_param_scheduler is not None and progress.get("scheduler") is not None:
        opt_param_scheduler.load_state_dict(progress["scheduler"])
    if progress.get("ckpt_call_idx") is not None:
        import importlib

        calls = getattr(importlib.import_module(_DIST_CKPT_BASE), "async_calls", None)
        if calls is not None and hasattr(calls, "call_idx"):
            calls.call_idx = int(progress["ckpt_call_idx"])
    if progress.get("rerun_iteration") is not None:
        try:
            from megatron.core.rerun_state_machine import get_rerun_state_machine
        except ImportError:  # pragma: no cover - megatron-core always has it
            return
        get_rerun_state_machine().current_iteration = int(progress["rerun_iteration"])


__all__ = ["VERSION", "MAX_BYTES", "ARGS_FIELDS", "ProgressError", "capture", "encode", "decode", "send", "recv",
           "apply", "encode_rng", "decode_rng", "encode_value", "decode_value", "forward_part"]
