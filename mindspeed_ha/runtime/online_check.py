"""The online check a paused rank runs on its training thread (``mindspeed-ha check``).

Tests, in this order (each times itself; codes 0 ok, 1 not run, 2 fault, 3 timeout):

Each test's ``seconds`` is its wall time on this rank.

* ``gemm`` (ranks under test and, as references, every other rank): C = A @ B with A, B of
  :data:`GEMM_N` x :data:`GEMM_N` float32 drawn from a private generator seeded with
  :data:`SEED` (on the CPU, then moved: the same inputs on every device; the training RNG
  is never touched), :data:`GEMM_REPEATS` products timed; the SHA-256 of C's bytes goes to
  the controller, which compares it across the DP replicas (``control/policy/pause_task.py``).
  On an NPU with ``torch_npu.npu.stress_detect`` (the reference's AI-core stress test), it
  runs too, mode ``"aic"``: a non-zero return is a fault. The injector's
  ``point=check,fault=corrupt,what=gemm`` flips one bit of C before the digest (a test double).
* ``memory`` (ranks under test): a block of ``min(MEMORY_BYTES (64 MiB; on the host 16 MiB),
  10 % of free)`` bytes of the device (CUDA / NPU: ``mem_get_info``; CPU: ``psutil``
  available host memory) written
  with the patterns 0x00, 0xFF, 0x55, 0xAA and an address-like ramp, each read back and
  compared; freed after (and the device cache emptied). A mismatch is a fault.
* ``p2p`` and ``allreduce`` (every rank: the collectives need every member): on each of the
  job's own groups of more than one rank (megatron-core's TP, PP, DP), a ring exchange with
  the next rank (isend / irecv) and an all-reduce of :data:`COMM_BYTES` bytes, one
  warm-up then :data:`COMM_REPEATS` timed; per link its GB/s. On NPU with ``stress_detect``:
  mode ``"hccs"`` too. Before each of them every rank agrees over the world group whether
  the budget still allows it (one all-reduce of one int), so no rank waits on a test its
  peers skipped: over budget -> 3 on every rank.

The state (parameters, optimizer shard, every RNG) is digested before and after
(``state_unchanged``); nothing of the model, optimizer, data or RNG is used.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Dict, List, Optional, Tuple

from mindspeed_ha.control.policy.pause_task import FAULT, NOT_RUN, OK, TIMEOUT, worst

log = logging.getLogger("mindspeed_ha.runtime")

SEED = 20240607
GEMM_N = 256
GEMM_REPEATS = 4
MEMORY_BYTES = 64 << 20
HOST_MEMORY_BYTES = 16 << 20
COMM_BYTES = 1 << 20
COMM_REPEATS = 3
PATTERNS = (0x00, 0xFF, 0x55, 0xAA)


def compute_device():
    """The device the rank trains on: CUDA's current, the NPU's, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return torch.device("npu", npu.current_device())
    return torch.device("cpu")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def stress_detect(mode: str) -> Optional[int]:
    """``torch_npu.npu.stress_detect(mode)``'s return where it exists (0 ok), else None."""
    try:
        import torch_npu  # noqa: F401
        import torch
    except ImportError:
        return None
    fn = getattr(getattr(torch, "npu", None), "stress_detect", None)
    if fn is None:
        return None
    return int(fn(mode))


def gemm(device, flip=None) -> Dict[str, Any]:
    """The GEMM test (see the module doc); ``flip(tensor)``: the injector's hook, or None."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(SEED)
    a = torch.randn(GEMM_N, GEMM_N, generator=gen, dtype=torch.float32).to(device)
    b = torch.randn(GEMM_N, GEMM_N, generator=gen, dtype=torch.float32).to(device)
    c = torch.mm(a, b)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(GEMM_REPEATS):
        c = torch.mm(a, b)
    _sync(device)
    seconds = (time.perf_counter() - t0) / GEMM_REPEATS
    host = c.cpu().contiguous()
    if flip is not None:
        flip(host)
    out = {"code": OK, "product_seconds": round(seconds, 6), "n": GEMM_N, "dtype": "float32",
           "gflops": round(2 * GEMM_N ** 3 / seconds / 1e9, 3) if seconds > 0 else None,
           "digest": hashlib.sha256(host.numpy().tobytes()).hexdigest()}
    rc = stress_detect("aic") if device.type == "npu" else None
    if rc is not None:
        out["stress_detect_aic"] = rc
        if rc != 0:
            out["code"] = FAULT
    return out


def _free_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "npu":
        return int(torch.npu.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def memory(device, limit_bytes: Optional[int] = None) -> Dict[str, Any]:
    """The memory pattern test (see the module doc); ``limit_bytes`` None: :data:`MEMORY_BYTES`
    on a device, :data:`HOST_MEMORY_BYTES` on the host."""
    import torch

    if limit_bytes is None:
        limit_bytes = HOST_MEMORY_BYTES if device.type == "cpu" else MEMORY_BYTES
    size = max(1 << 20, min(int(limit_bytes), _free_bytes(device) // 10)) // 8 * 8
    t0 = time.perf_counter()
    errors, first = 0, None
    block = torch.empty(size, dtype=torch.uint8, device=device)
    try:
        words = block.view(torch.int64)
        for p in PATTERNS:
            block.fill_(p)
            if bool((words != int.from_bytes(bytes([p]) * 8, "little", signed=True)).any()):  # 8 bytes a compare
                bad = int((block != p).sum())
                first = first or f"pattern 0x{p:02x}: {bad} bytes read back wrong"
                errors += bad
        ramp = torch.arange(size // 8, dtype=torch.int64, device=device)
        words.copy_(ramp)
        bad = int((words != ramp).sum())
        if bad:
            first = first or f"address ramp: {bad} words read back wrong"
            errors += bad
        del ramp, words
        _sync(device)
    finally:
        del block
        if device.type == "cuda":
            torch.cuda.empty_cache()
        elif device.type == "npu":
            torch.npu.empty_cache()
    out = {"code": FAULT if errors else OK, "bytes": size, "errors": errors,
           "GBps": round(size * (len(PATTERNS) + 1) * 2 / max(time.perf_counter() - t0, 1e-9) / 1e9, 3)}
    if first:
        out["first_error"] = first
    return out


def job_groups() -> List[Tuple[str, Any]]:
    """(name, group) of megatron-core's TP, PP and DP groups of more than one rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = []
    for name, get in (("tp", ps.get_tensor_model_parallel_group), ("pp", ps.get_pipeline_model_parallel_group),
                      ("dp", ps.get_data_parallel_group)):
        try:
            g = get()
        except (AssertionError, RuntimeError):
            continue
        if g is not None and dist.get_world_size(g) > 1:
            out.append((name, g))
    return out


def _comm_device(group):
    from mindspeed_ha.accelerator import collective_device

    return collective_device(group)


def p2p(groups) -> Dict[str, Any]:
    """Ring exchange with the next rank of each group: seconds and GB/s per link."""
    import torch
    import torch.distributed as dist

    links = []
    for name, g in groups:
        n, me = dist.get_world_size(g), dist.get_rank(g)
        ranks = dist.get_process_group_ranks(g)
        dev = _comm_device(g)
        send = torch.ones(COMM_BYTES // 4, dtype=torch.float32, device=dev)
        recv = torch.empty_like(send)
        nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
        for i in range(COMM_REPEATS + 1):
            if i == 1:
                _sync(dev)
                t0 = time.perf_counter()
            reqs = [dist.isend(send, nxt, group=g), dist.irecv(recv, prv, group=g)]
            for r in reqs:
                r.wait()
        _sync(dev)
        s = (time.perf_counter() - t0) / COMM_REPEATS
        links.append({"group": name, "to": nxt, "from": prv, "bytes": COMM_BYTES, "seconds": round(s, 6),
                      "GBps": round(COMM_BYTES / s / 1e9, 3) if s > 0 else None})
    out: Dict[str, Any] = {"code": OK, "links": links}
    rc = stress_detect("hccs") if any(_comm_device(g).type == "npu" for _, g in groups) else None
    if rc is not None:
        out["stress_detect_hccs"] = rc
        out["code"] = FAULT if rc != 0 else OK
    return out


def allreduce(groups) -> Dict[str, Any]:
    """An all-reduce of COMM_BYTES on each group: seconds and bus GB/s (2 (n-1)/n bytes)."""
    import torch
    import torch.distributed as dist

    rows = []
    for name, g in groups:
        n = dist.get_world_size(g)
        dev = _comm_device(g)
        t = torch.ones(COMM_BYTES // 4, dtype=torch.float32, device=dev)
        for i in range(COMM_REPEATS + 1):
            if i == 1:
                _sync(dev)
                t0 = time.perf_counter()
            dist.all_reduce(t, group=g)
        _sync(dev)
        s = (time.perf_counter() - t0) / COMM_REPEATS
        rows.append({"group": name, "size": n, "bytes": COMM_BYTES, "seconds": round(s, 6),
                     "bus_GBps": round(2 * (n - 1) / n * COMM_BYTES / s / 1e9, 3) if s > 0 else None})
    return {"code": OK, "groups": rows}


def _all_within_budget(ok: bool) -> bool:
    """Every rank agrees (one all-reduce MIN of one int over the world group)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_comm_device(None))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def state_digest(ctx) -> str:
    """SHA-256 over the live model's and optimizer shard's digests and every RNG state."""
    import random

    import numpy as np
    import torch

    from mindspeed_ha.checkpoint.integrity import live_model_digest, live_shard_digest

    h = hashlib.sha256()
    if ctx is not None:
        for fn in (live_model_digest, live_shard_digest):
            h.update(fn(ctx, check_finite=False)[1].encode())
    h.update(torch.get_rng_state().numpy().tobytes())
    h.update(repr(random.getstate()).encode())
    h.update(repr(np.random.get_state()[1].tolist()).encode())
    if torch.cuda.is_available():
        for s in torch.cuda.get_rng_state_all():
            h.update(s.numpy().tobytes())
    try:
        from megatron.core import tensor_parallel

        for name, s in sorted(tensor_parallel.get_cuda_rng_tracker().get_states().items()):
            h.update(name.encode() + s.numpy().tobytes())
    except (ImportError, AttributeError, RuntimeError):
        pass
    return h.hexdigest()


def run_check(params: Dict[str, Any], budget_s: float, rank: int, ctx=None, flip=None) -> Tuple[int, str, Dict]:
    """Run the check's tests on this rank: (code, detail, result). See the module doc.

    Args:
        params: ``ranks`` (under test), ``tests`` (names, in any order).
        budget_s: seconds for the whole check, from this call.
        ctx: the runtime's DyingContext (model, optimizer) for the state digests, or None.
        flip: the injector's hook on the GEMM result, or None.
    """
    t0 = time.perf_counter()
    before = state_digest(ctx)
    tests = list(params.get("tests") or ())
    mine = rank in set(params.get("ranks") or ())
    device = compute_device()
    results: Dict[str, Dict[str, Any]] = {}

    def left() -> float:
        return budget_s - (time.perf_counter() - t0)

    for name in ("gemm", "memory"):
        if name not in tests or (name == "memory" and not mine):
            continue
        if left() <= 0:
            results[name] = {"code": TIMEOUT, "detail": "budget exceeded before this test"}
            continue
        t = time.perf_counter()
        results[name] = gemm(device, flip) if name == "gemm" else memory(device)
        results[name]["seconds"] = round(time.perf_counter() - t, 6)
    groups = job_groups() if ("p2p" in tests or "allreduce" in tests) else []
    for name in ("p2p", "allreduce"):
        if name not in tests:
            continue
        if not _all_within_budget(left() > 0):
            results[name] = {"code": TIMEOUT, "detail": "budget exceeded on some rank before this test"}
            continue
        t = time.perf_counter()
        results[name] = p2p(groups) if name == "p2p" else allreduce(groups)
        results[name]["seconds"] = round(time.perf_counter() - t, 6)
    seconds = time.perf_counter() - t0
    unchanged = state_digest(ctx) == before
    if seconds > budget_s:
        for r in results.values():
            if r["code"] == OK:
                r["code"] = TIMEOUT
    code = worst(r["code"] for r in results.values()) if results else NOT_RUN
    if not unchanged:
        code = FAULT
    bad = [f"{n}: {r.get('first_error') or r.get('detail') or 'code %d' % r['code']}"
           for n, r in results.items() if r["code"] != OK]
    detail = ("; ".join(bad) + ("; " if bad else "")) if bad else ""
    if not unchanged:
        detail += "the training state changed during the check"
    return code, detail, {"tests": results, "device": str(device), "seconds": round(seconds, 6),
                          "state_unchanged": unchanged, "under_test": mine}


__all__ = ["compute_device", "gemm", "memory", "p2p", "allreduce", "run_check", "state_digest", "stress_detect"]
