"""UCE repair: copy a rank's model and optimizer state from a replica holder, in memory.

After an uncorrectable device-memory error (UCE) the damaged rank's tensors are suspect.
A *replica holder* (a rank with the same TP rank, PP rank and distributed-optimizer shard:
with ``--ha-replica-count`` N the same shard in another optimizer instance; without the
distributed optimizer any other DP rank) still holds the state of the last completed
iteration ``k``. :func:`send_state` / :func:`recv_state` copy it point to point, over a
process group holding both ranks, never through a file.

What is transferred: every piece of optimizer and model state a regular checkpoint holds
(megatron-core's ``optimizer.state_dict()``, the distributed optimizer's parameter state,
the model's ``state_dict()``), in two parts.

The tensors (:func:`state_tensors`, in this order):

* every model chunk's parameters (``named_parameters()`` sorted by name, after stripping
  DDP / Float16Module wrappers) and persistent buffers (``state_dict`` buffers);
* for every optimizer (each of a ``ChainedOptimizer``'s ``chained_optimizers``): the main
  parameters the inner ``torch.optim`` optimizer updates (``optimizer.param_groups``:
  the distributed optimizer's fp32 shard of its instance, the mixed-precision optimizer's
  fp32 copies, the fp32 optimizer's model parameters), then every tensor of its per-
  parameter state sorted by key (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``), then the
  tensors of its grad scaler (fp16 only).

The host state (:func:`host_state`: the Python values beside those tensors, read with the
libraries' own ``state_dict()``): per optimizer, every param group's settings (torch's
``optimizer.state_dict()["param_groups"]`` without ``params``: learning rate, weight
decay, betas, Megatron's ``wd_mult`` / ``lr_mult`` ...), the non-tensor per-parameter
state, and the grad scaler's non-tensor state (megatron-core ``DynamicGradScaler.
state_dict()``: ``growth_tracker`` and ``hysteresis_tracker``, Python ints; a restarted
process that kept its initial values doubled or halved its loss scale at another step than
its peers and unscaled its gradients with the wrong factor). The receiver sets them as a
checkpoint load would: param group keys and per-parameter values in place, the grad
scaler through its own ``load_state_dict``.

What is not, and why:

* gradients (``main_grad`` / the DDP grad buffers, ``.grad``): the re-run of the
  interrupted step zeroes them first (``zero_grad_buffer`` / ``optimizer.zero_grad``);
* what is not the model's or the optimizer's (the iteration number, the LR scheduler,
  Megatron-LM's args and counters, RNG states): the same in every replica holder and in
  host memory, which a device-memory fault does not damage; a restarted process receives
  them from its holder as its progress (:mod:`mindspeed_ha.recovery.progress`);
* the optimizer state of parameters with no state yet (before the first update both
  holders have none; the header check fails if only one has).

Protocol (sender -> receiver unless said): a fixed header (int64: protocol version, number
of tensors, length of the descriptor, total bytes, length of the host state), the
descriptor (UTF-8 JSON: name, shape, dtype of every tensor), the host state (msgpack, no
pickle; :func:`mindspeed_ha.recovery.progress.encode_value`), the receiver's verdict
(receiver -> sender: 0, or 1 + the index of the first mismatching tensor, or 2 when the
host state's structure differs; both sides then raise), then the tensors packed into one
contiguous buffer per dtype (split at ``max_message_bytes``: a few messages, not one per
tensor). The receiver copies each tensor in place (``copy_``): DDP's parameter buffers and
the distributed optimizer hold views of these tensors, so replacing them would break the
links; then it sets the host state. Messages go through ``torch.distributed.send`` / ``recv``.
"""

from __future__ import annotations

from mindspeed_ha.errors import StateMismatch  # noqa: F401  (one error tree)
import hashlib
import json
import re
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from mindspeed_ha.recovery.pair_link import PairLink

PROTOCOL_VERSION = 2
#: largest host-state message (bytes): a few hundred per param group and optimizer
MAX_HOST_BYTES = 1 << 20

#: largest packed message (bytes); bounds the extra memory a transfer needs on each side.
#: Measured (gloo, 2 ranks on one 2-core host, 256 MiB of fp32, median of 3): 4 MiB
#: messages 799 MiB/s, 16 MiB 912 MiB/s, 64 MiB 591 MiB/s, one 256 MiB message 551 MiB/s.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass
class TransferStats:
    """What a transfer moved: ``bytes`` of tensor data (header excluded), ``seconds`` (wall
    clock, header to last copy), ``tensors`` (count), ``messages`` (data messages)."""

    bytes: int
    seconds: float
    tensors: int
    messages: int

    def __str__(self) -> str:
        rate = self.bytes / self.seconds / 2**20 if self.seconds > 0 else float("inf")
        return (f"{self.tensors} tensors, {self.bytes} bytes in {self.messages} messages, "
                f"{self.seconds:.3f} s ({rate:.1f} MiB/s)")


def _chunks(model) -> List[Any]:
    from mindspeed_ha.integrations import megatron_lm

    chunks = megatron_lm.unwrap_model(model)
    return chunks if isinstance(chunks, list) else [chunks]


def _optimizers(optimizer) -> List[Any]:
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _persistent_buffers(chunk) -> List[Tuple[str, torch.Tensor]]:
    out = []
    for mod_name, mod in chunk.named_modules():
        skip = getattr(mod, "_non_persistent_buffers_set", set())
        for name, buf in mod._buffers.items():
            if buf is not None and name not in skip:
                out.append((f"{mod_name}.{name}" if mod_name else name, buf))
    seen, unique = set(), []
    for name, buf in sorted(out, key=lambda x: x[0]):
        if id(buf) not in seen:  # a buffer shared by two modules is sent once
            seen.add(id(buf))
            unique.append((name, buf))
    return unique


def state_tensors(model, optimizer) -> List[Tuple[str, torch.Tensor]]:
    """Every tensor defining this rank's model and optimizer state, in a fixed order.

    Args:
        model: a model chunk or a list of chunks (wrapped in DDP / Float16Module or not).
        optimizer: a Megatron optimizer (``DistributedOptimizer``,
            ``Float16OptimizerWithFloat16Params``, ``FP32Optimizer``, ``ChainedOptimizer``)
            or None.

    Returns:
        ``[(name, tensor)]``: the tensors themselves (parameters as ``.data``), so an
        in-place write changes the live state. Two replica holders get the same names,
        shapes and dtypes. See the module docstring for what is and is not included.
    """
    out: List[Tuple[str, torch.Tensor]] = []
    for i, chunk in enumerate(_chunks(model)):
        for name, p in sorted(chunk.named_parameters(), key=lambda x: x[0]):
            out.append((f"model{i}.param.{name}", p.data))
        for name, b in _persistent_buffers(chunk):
            out.append((f"model{i}.buffer.{name}", b))
    for j, opt in enumerate(_optimizers(optimizer)):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for g, group in enumerate(inner.param_groups):
            for i, p in enumerate(group["params"]):
                prefix = f"optimizer{j}.group{g}.param{i}"
                out.append((f"{prefix}.main", p.data))
                state = inner.state.get(p, {})
                for key in sorted(state):
                    value = state[key]
                    if torch.is_tensor(value):
                        out.append((f"{prefix}.{key}", value))
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None:
            for key in sorted(vars(scaler)):
                value = vars(scaler)[key]
                if torch.is_tensor(value):
                    out.append((f"optimizer{j}.grad_scaler.{key}", value))
    return out


def host_state(optimizer) -> List[Dict[str, Any]]:
    """The optimizer state held as Python values beside :func:`state_tensors`, one entry per
    optimizer (each of a ``ChainedOptimizer``'s ``chained_optimizers``), read with the
    libraries' own ``state_dict()``.

    Returns:
        ``[{"groups": [settings], "sizes": [params per group], "state": [[index, {key:
        value}]], "grad_scaler": {key: value} or None}]``: ``groups`` are torch's
        ``optimizer.state_dict()["param_groups"]`` without ``params``; ``state`` the
        non-tensor per-parameter values by torch's parameter index (empty for torch's Adam,
        whose ``step`` is a tensor); ``grad_scaler`` megatron-core's
        ``grad_scaler.state_dict()`` without its tensors (``DynamicGradScaler``:
        ``growth_tracker``, ``hysteresis_tracker``; ``ConstantGradScaler``: nothing).
    """
    out: List[Dict[str, Any]] = []
    for opt in _optimizers(optimizer):
        entry: Dict[str, Any] = {"groups": [], "sizes": [], "state": [], "grad_scaler": None}
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            packed = inner.state_dict()
            entry["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in packed["param_groups"]]
            entry["sizes"] = [len(g["params"]) for g in packed["param_groups"]]
            for index in sorted(packed["state"]):
                values = {k: v for k, v in packed["state"][index].items() if not torch.is_tensor(v)}
                if values:
                    entry["state"].append([int(index), values])
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None:
            entry["grad_scaler"] = {k: v for k, v in scaler.state_dict().items() if not torch.is_tensor(v)}
        out.append(entry)
    return out


def _host_mismatch(optimizer, theirs: List[Dict[str, Any]]) -> Optional[str]:
    """Why ``theirs`` (the sender's :func:`host_state`) cannot be set on ``optimizer``, or None."""
    mine = host_state(optimizer)
    if len(mine) != len(theirs):
        return f"{len(theirs)} optimizers sent, this rank has {len(mine)}"
    for j, (a, b) in enumerate(zip(mine, theirs)):
        if a["sizes"] != b["sizes"]:
            return f"optimizer {j}: parameters per group {b['sizes']} sent, this rank has {a['sizes']}"
        if (a["grad_scaler"] is None) != (b["grad_scaler"] is None):
            return f"optimizer {j}: grad scaler {'sent' if b['grad_scaler'] is not None else 'not sent'}, this " \
                   f"rank has {'one' if a['grad_scaler'] is not None else 'none'}"
    return None


def set_host_state(optimizer, host: List[Dict[str, Any]]) -> None:
    """Set :func:`host_state` ``host`` on ``optimizer`` as a checkpoint load would: each param
    group's settings and each parameter's non-tensor state in place (the groups keep their
    ``params``), the grad scaler through megatron-core's ``grad_scaler.load_state_dict`` (its
    scale tensor as this rank holds it: :func:`recv_state` copied it first).

    Raises:
        StateMismatch: another number of optimizers, param groups or parameters, or a grad
            scaler on one side only.
    """
    why = _host_mismatch(optimizer, host)
    if why is not None:
        raise StateMismatch(f"host state: {why}")
    for opt, entry in zip(_optimizers(optimizer), host):
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            for group, settings in zip(inner.param_groups, entry["groups"]):
                group.update({k: v for k, v in settings.items() if k != "params"})
            # torch numbers the parameters across the groups in order (Optimizer.state_dict)
            params = [p for group in inner.param_groups for p in group["params"]]
            for index, values in entry["state"]:
                inner.state[params[index]].update(values)
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None and entry["grad_scaler"]:
            merged = scaler.state_dict()
            merged.update(entry["grad_scaler"])
            scaler.load_state_dict(merged)


def _encode_host(optimizer) -> bytes:
    import msgpack

    from mindspeed_ha.recovery.progress import encode_value

    blob = msgpack.packb(encode_value(host_state(optimizer)), use_bin_type=True)
    if len(blob) > MAX_HOST_BYTES:
        raise StateMismatch(f"host state of {len(blob)} bytes > {MAX_HOST_BYTES}")
    return blob


def _decode_host(blob: bytes) -> List[Dict[str, Any]]:
    import msgpack

    from mindspeed_ha.recovery.progress import decode_value

    return decode_value(msgpack.unpackb(blob, raw=False, strict_map_key=False))


def _describe(tensors: List[Tuple[str, torch.Tensor]]) -> List[List[Any]]:
    return [[name, list(t.shape), str(t.dtype).replace("torch.", "")] for name, t in tensors]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _plan(tensors: List[Tuple[str, torch.Tensor]], max_message_bytes: int) -> List[List[int]]:
    """Indices of the tensors of each data message: grouped by dtype (first-seen order),
    consecutive, at most ``max_message_bytes`` each (a larger tensor travels alone)."""
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, (_, t) in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    messages: List[List[int]] = []
    for indices in by_dtype.values():
        current, size = [], 0
        for i in indices:
            n = _nbytes(tensors[i][1])
            if current and size + n > max_message_bytes:
                messages.append(current)
                current, size = [], 0
            current.append(i)
            size += n
        if current:
            messages.append(current)
    return [m for m in messages if sum(tensors[i][1].numel() for i in m) > 0]


def _device(group) -> torch.device:
    from mindspeed_ha.accelerator import collective_device

    if isinstance(group, PairLink):
        return group.device
    return collective_device(group)


def _send(t: torch.Tensor, dst: int, group) -> None:
    import torch.distributed as dist

    if isinstance(group, PairLink):
        group.send(t, dst)
    else:
        dist.send(t, dst=dst, group=group)


def _recv(t: torch.Tensor, src: int, group) -> None:
    import torch.distributed as dist

    if isinstance(group, PairLink):
        group.recv(t, src)
    else:
        dist.recv(t, src=src, group=group)


def _first_mismatch(mine: List[List[Any]], theirs: List[List[Any]]) -> int:
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return i
    return min(len(mine), len(theirs))


def _entry(desc: List[List[Any]], i: int) -> str:
    if i >= len(desc):
        return "(none: the list ends here)"
    name, shape, dtype = desc[i]
    return f"{name} {tuple(shape)} {dtype}"


def send_state(model, optimizer, dst: int, group=None,
               max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> TransferStats:
    """Send this rank's :func:`state_tensors` and :func:`host_state` to global rank ``dst``
    (which calls :func:`recv_state`).

    Args:
        dst: the receiver's global rank.
        group: a process group holding both ranks (None: the default group), or a
            :class:`~mindspeed_ha.recovery.pair_link.PairLink` (the peer is then named by
            its index in the link, 0 or 1).
        max_message_bytes: largest packed data message (bytes).

    Returns:
        :class:`TransferStats` (bytes of tensor data sent, seconds).

    Raises:
        StateMismatch: the receiver's tensors differ (it names the first difference).
        RuntimeError: (the backend) the receiver is gone or the link failed.
    """
    start = time.perf_counter()
    tensors = state_tensors(model, optimizer)
    desc = _describe(tensors)
    device = _device(group)
    blob = json.dumps(desc).encode()
    host = _encode_host(optimizer)
    total = sum(_nbytes(t) for _, t in tensors)
    _send(torch.tensor([PROTOCOL_VERSION, len(tensors), len(blob), total, len(host)], dtype=torch.int64,
                       device=device), dst, group)
    _send(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device), dst, group)
    _send(torch.frombuffer(bytearray(host), dtype=torch.uint8).to(device), dst, group)
    verdict = torch.zeros(2, dtype=torch.int64, device=device)
    _recv(verdict, dst, group)
    if int(verdict[0]) == 2:
        raise StateMismatch(f"state transfer to rank {dst}: the receiver's optimizer differs from this rank's "
                            "(param groups, parameters per group or grad scaler; the receiver names it)")
    if int(verdict[0]) != 0:
        i = int(verdict[1])
        raise StateMismatch(f"state transfer to rank {dst}: the receiver's state differs from this rank's "
                            f"at tensor {i}: this rank has {_entry(desc, i)} ({len(desc)} tensors)")
    plan = _plan(tensors, max_message_bytes)
    with torch.no_grad():
        for message in plan:
            parts = [tensors[i][1].reshape(-1).to(device) for i in message]
            _send(parts[0].contiguous() if len(parts) == 1 else torch.cat(parts), dst, group)
    return TransferStats(total, time.perf_counter() - start, len(tensors), len(plan))


_OPT_STATE = re.compile(r"^optimizer(\d+)\.group(\d+)\.param(\d+)\.(\w+)$")


def _materialize(optimizer, theirs: List[List[Any]]) -> int:
    """Create, as zeros, the optimizer state tensors the sender has and this rank lacks
    (a new optimizer, e.g. a restarted process's: torch's Adam makes ``exp_avg``,
    ``exp_avg_sq`` and ``step`` at its first step). Their values come with the transfer.
    Returns how many were created."""
    made = 0
    opts = _optimizers(optimizer)
    for name, shape, dtype in theirs:
        m = _OPT_STATE.match(name)
        if m is None or m.group(4) == "main":
            continue
        j, g, i, key = int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4)
        inner = getattr(opts[j], "optimizer", None) if j < len(opts) else None
        if inner is None or g >= len(inner.param_groups) or i >= len(inner.param_groups[g]["params"]):
            continue
        p = inner.param_groups[g]["params"][i]
        state = inner.state[p]
        if key not in state:
            state[key] = torch.zeros(shape, dtype=getattr(torch, dtype), device=p.device)
            made += 1
    return made


def recv_state(model, optimizer, src: int, group=None,
               max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, materialize: bool = False) -> TransferStats:
    """Overwrite this rank's :func:`state_tensors` in place with those of global rank ``src``,
    then set its :func:`host_state` (:func:`set_host_state`).

    Args:
        src: the sender's global rank (it calls :func:`send_state` with the same
            ``max_message_bytes``).
        group: a process group holding both ranks (None: the default group), or a
            :class:`~mindspeed_ha.recovery.pair_link.PairLink` (the peer is then named by
            its index in the link, 0 or 1).
        materialize: first create the optimizer state tensors the sender has and this
            rank lacks (:func:`_materialize`; a restarted process's fresh optimizer).

    Returns:
        :class:`TransferStats` (bytes of tensor data received, seconds).

    Raises:
        StateMismatch: number, names, shapes or dtypes differ, or the optimizers' structure
            (param groups, parameters per group, grad scaler); names the first
            difference. Nothing was overwritten; the sender raises too.
        RuntimeError: (the backend) the sender is gone or the link failed: the state may
            be partly overwritten (it was damaged anyway).
    """
    start = time.perf_counter()
    tensors = state_tensors(model, optimizer)
    desc = _describe(tensors)
    device = _device(group)
    header = torch.zeros(5, dtype=torch.int64, device=device)
    _recv(header, src, group)
    version, count, blob_len, total, host_len = (int(x) for x in header.tolist())
    if version != PROTOCOL_VERSION or not 0 < host_len <= MAX_HOST_BYTES:
        raise StateMismatch(f"state transfer from rank {src}: protocol version {version}, host state of "
                            f"{host_len} bytes (expected version {PROTOCOL_VERSION}, at most {MAX_HOST_BYTES} bytes)")
    blob = torch.zeros(blob_len, dtype=torch.uint8, device=device)
    _recv(blob, src, group)
    theirs = json.loads(bytes(blob.cpu().numpy().tobytes()).decode())
    host_blob = torch.zeros(host_len, dtype=torch.uint8, device=device)
    _recv(host_blob, src, group)
    host = _decode_host(bytes(host_blob.cpu().numpy().tobytes()))
    if materialize and theirs != desc and _materialize(optimizer, theirs):
        tensors = state_tensors(model, optimizer)
        desc = _describe(tensors)
    verdict = torch.zeros(2, dtype=torch.int64, device=device)
    mismatch = None
    host_why = _host_mismatch(optimizer, host)
    if host_why is not None:
        mismatch = f"state transfer from rank {src}: host state: {host_why}"
        verdict[0] = 2
    elif theirs != desc:
        i = _first_mismatch(desc, theirs)
        mismatch = (f"state transfer from rank {src}: tensor {i} differs: sender has {_entry(theirs, i)}, "
                    f"this rank has {_entry(desc, i)} (sender {count} tensors, {total} bytes; this rank "
                    f"{len(desc)} tensors, {sum(_nbytes(t) for _, t in tensors)} bytes)")
        verdict[0], verdict[1] = 1, i
    _send(verdict, src, group)
    if mismatch is not None:
        raise StateMismatch(mismatch)
    plan = _plan(tensors, max_message_bytes)
    with torch.no_grad():
        for message in plan:
            numel = sum(tensors[i][1].numel() for i in message)
            buf = torch.empty(numel, dtype=tensors[message[0]][1].dtype, device=device)
            _recv(buf, src, group)
            offset = 0
            for i in message:
                t = tensors[i][1]
                n = t.numel()
                t.copy_(buf[offset:offset + n].view(t.shape))
                offset += n
    set_host_state(optimizer, host)
    return TransferStats(total, time.perf_counter() - start, len(tensors), len(plan))


def state_digest(model, optimizer) -> str:
    """SHA-256 (hex) over every :func:`state_tensors` entry's name, shape, dtype and bytes and
    the :func:`host_state`: equal on two ranks exactly when their transferable state is
    bitwise equal."""
    h = hashlib.sha256()
    h.update(_encode_host(optimizer))
    for name, t in state_tensors(model, optimizer):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\0".encode())
        flat = t.detach().reshape(-1).cpu().contiguous()
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()
