"""Interruptible collectives (mindspeed_ha/recovery/comm.py, patches/comm.py) on real gloo
processes.

Each test runs two ranks (this file as a script: ``python tests/test_comm.py SCENARIO RANK
PORT``) around a TCPStore hosted by the test. Rank 1 stays out of rank 0's op by waiting
on a store key; rank 0 tells its aborting thread it is inside the op through the fault
hook or through a probe on the wait's parking step (no sleeps). Each rank prints
``STEP <name> <outcome>`` lines; the test asserts them and the exit codes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import timedelta

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORE_TIMEOUT = timedelta(seconds=60)


def _run_pair(scenario: str, timeout: float = 50.0):
    """Both ranks of ``scenario``; returns [(returncode, stdout)] per rank."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    try:
        for rank in (0, 1):
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), scenario, str(rank), str(store.port)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO))
        out = []
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, text))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        del store


def _steps(text: str) -> dict:
    steps = {}
    for line in text.splitlines():
        if line.startswith("STEP "):
            _, name, outcome = line.split(" ", 2)
            steps[name] = outcome
    return steps


def _assert_ok(results):
    for rank, (code, text) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{text}"


BLOCKING = ("all_reduce_sync", "refused_until_reset", "async_handle_wait", "recv", "send", "batch_isend_irecv",
            "barrier", "coalesced_reduce_scatter", "coalesced_all_reduce_async")


@pytest.mark.timeout(90)
def test_abort_unblocks_each_blocking_kind():
    """(a)(b)(c): rank 0 blocked in each kind of op while rank 1 stays out -> abort() ->
    CollectiveAborted; later ops refused until reset(); a fresh group then sums right."""
    results = _run_pair("blocked")
    _assert_ok(results)
    steps = _steps(results[0][1])
    for name in BLOCKING:
        assert steps.get(name) == "aborted", (name, results[0][1])
    assert steps["fresh_group_sum"] == "3.0", results[0][1]
    assert _steps(results[1][1])["fresh_group_sum"] == "3.0", results[1][1]


@pytest.mark.timeout(90)
def test_fault_hook_error_on_one_rank_peer_gets_out_after_abort():
    """(e): the hook raises a link error inside an all_reduce on rank 0; rank 1 goes on
    to the next all_reduce and blocks; abort() on rank 1 gets it out; fresh group works."""
    results = _run_pair("fault_hook")
    _assert_ok(results)
    s0, s1 = _steps(results[0][1]), _steps(results[1][1])
    assert s0["hook_error"] == "RuntimeError: Connection reset by peer (injected)", results[0][1]
    assert s1["first_all_reduce"] == "2.0" and s1["second_all_reduce"] == "aborted", results[1][1]
    assert s0["fresh_group_sum"] == s1["fresh_group_sum"] == "3.0"


@pytest.mark.timeout(90)
def test_results_bitwise_equal_to_unwrapped():
    """(d): every covered op, HA off then on, same inputs -> same bytes; handles are
    InterruptibleWork (a torch Work) only with HA on."""
    results = _run_pair("bitwise")
    _assert_ok(results)
    for rank, (_, text) in enumerate(results):
        steps = _steps(text)
        assert steps.get("compared", "").startswith("ops="), text
        mismatched = {k: v for k, v in steps.items() if k.startswith("op.") and v != "equal"}
        assert not mismatched, (rank, mismatched)
        assert steps["handle_types"] == "Work/InterruptibleWork", text


# =========================================================================== the ranks
def _init(rank: int, port: int, mindspeed_first: bool = False):
    if mindspeed_first:
        import mindspeed_ha  # noqa: F401 - patches land when torch is imported after
    import torch.distributed as dist

    import mindspeed_ha  # noqa: F401,F811
    from mindspeed_ha.patches import enable

    enable("ha")
    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=STORE_TIMEOUT)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    return store


def _step(name: str, outcome) -> None:
    print(f"STEP {name} {outcome}", flush=True)


def _fresh_group():
    import torch.distributed as dist

    return dist.new_group([0, 1], backend="gloo", use_local_synchronization=True)


def _expect_abort(name: str, fn, trigger: threading.Event, reason: str) -> None:
    """Run ``fn`` (expected to block) while a thread aborts once ``trigger`` is set."""
    from mindspeed_ha.recovery import comm

    aborter = threading.Thread(target=lambda: (trigger.wait(60), comm.abort(reason)), daemon=True)
    aborter.start()
    try:
        fn()
        _step(name, "returned")
    except comm.CollectiveAborted as exc:
        ok = exc.aborted and str(exc).startswith(f"collective aborted by mindspeed-ha recovery: {reason}")
        _step(name, "aborted" if ok else f"bad-exception {exc!r}")
    aborter.join(60)
    trigger.clear()


def _probe_parking(parked: threading.Event):
    """Set ``parked`` each time a wait parks (after its launch; abort wakes it from there)."""
    from mindspeed_ha.recovery import comm

    real = comm._park

    def park(lk, timeout):
        parked.set()
        return real(lk, timeout)

    comm._park = park


def _blocked(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    from mindspeed_ha.recovery import comm

    store = _init(rank, port)
    dist.all_reduce(torch.ones(1))  # connections up before anyone stays out
    inside, parked = threading.Event(), threading.Event()
    _probe_parking(parked)
    launched = []
    comm.set_fault_hook(lambda op, group: (launched.append(op), inside.set()))

    def refused():
        before = list(launched)
        try:
            dist.all_reduce(torch.ones(1))
            return "launched"
        except comm.CollectiveAborted:
            return "aborted" if launched == before else "launched-then-aborted"

    group = None  # the default group first, then a fresh one per kind
    kinds = [
        ("all_reduce_sync", inside, lambda g: dist.all_reduce(torch.ones(4), group=g)),
        ("async_handle_wait", parked, lambda g: dist.all_reduce(torch.ones(4), group=g, async_op=True).wait()),
        ("recv", parked, lambda g: dist.recv(torch.zeros(4), src=1, group=g)),
        ("send", parked, lambda g: dist.send(torch.ones(4), dst=1, group=g)),
        ("batch_isend_irecv", parked, lambda g: [r.wait() for r in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.ones(4), 1, g), dist.P2POp(dist.irecv, torch.zeros(4), 1, g)])]),
        ("barrier", parked, lambda g: dist.barrier(group=g)),
        ("coalesced_reduce_scatter", parked, lambda g: _coalesced_reduce_scatter(g, async_op=False)),
        ("coalesced_all_reduce_async", parked, lambda g: _coalesced_all_reduce_async(g)),
    ]
    for i, (name, trigger, op) in enumerate(kinds):
        inside.clear()
        parked.clear()
        if rank == 0:
            _expect_abort(name, lambda: op(group), trigger, f"test {name}")
            if i == 0:
                _step("refused_until_reset", refused())
            comm.reset()
            store.set(f"done/{i}", "1")
        else:
            store.wait([f"done/{i}"])
        group = _fresh_group()
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t, group=group)
    _step("fresh_group_sum", t[0].item())


def _coalesced_reduce_scatter(group, async_op):
    import torch
    import torch.distributed as dist

    with dist._coalescing_manager(group, async_ops=async_op) as cm:
        for _ in range(2):
            dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(4), group=group, async_op=async_op)
    if async_op:
        cm.wait()


def _coalesced_all_reduce_async(group):
    import torch
    import torch.distributed as dist

    with dist._coalescing_manager(group, async_ops=True) as cm:
        for _ in range(2):
            dist.all_reduce(torch.ones(4), group=group, async_op=True)
    cm.wait()


def _fault_hook(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    from mindspeed_ha.recovery import comm

    store = _init(rank, port)
    if rank == 0:
        def hook(op, group):
            comm.set_fault_hook(None)
            raise RuntimeError("Connection reset by peer (injected)")

        comm.set_fault_hook(hook)
        try:
            dist.all_reduce(torch.ones(1))
            _step("hook_error", "none")
        except RuntimeError as exc:
            _step("hook_error", f"{type(exc).__name__}: {exc}")
        store.set("failed", "1")  # what the control plane would learn from this rank
        store.wait(["recovered"])
    else:
        parked = threading.Event()
        _probe_parking(parked)
        t = torch.ones(1)
        dist.all_reduce(t)  # rank 0 launched it before its hook raised: it completes
        _step("first_all_reduce", t[0].item())

        def control_plane():
            store.wait(["failed"])
            parked.wait(60)
            comm.abort("rank 0 reported a link error")

        aborter = threading.Thread(target=control_plane, daemon=True)
        aborter.start()
        try:
            dist.all_reduce(t)
            _step("second_all_reduce", "returned")
        except comm.CollectiveAborted:
            _step("second_all_reduce", "aborted")
        aborter.join(60)
        comm.reset()
        store.set("recovered", "1")
    group = _fresh_group()
    t = torch.full((1,), float(rank + 1))
    dist.all_reduce(t, group=group)
    _step("fresh_group_sum", t[0].item())


def _bitwise_ops(rank: int):
    """name -> fn(group) returning the tensors it produced (inputs seeded per rank)."""
    import torch
    import torch.distributed as dist

    peer = 1 - rank

    def data(n, dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(1000 * seed + rank)
        return (torch.randn(n, generator=g) * 1e3).to(dtype)

    def all_reduce(g):
        t = data(1024, torch.bfloat16, 1)
        dist.all_reduce(t, group=g)
        return [t]

    def all_reduce_async(g):
        t = data(1 << 16, seed=2)
        dist.all_reduce(t, group=g, async_op=True).wait()
        return [t]

    def all_gather(g):
        out = [torch.zeros(64) for _ in range(2)]
        dist.all_gather(out, data(64, seed=3), group=g)
        return out

    def all_gather_into_tensor(g):
        out = torch.zeros(128)
        dist.all_gather_into_tensor(out, data(64, seed=4), group=g)
        return [out]

    def reduce_scatter_tensor(g):
        out = torch.zeros(64)
        dist.reduce_scatter_tensor(out, data(128, seed=5), group=g)
        return [out]

    def reduce_scatter(g):
        out = torch.zeros(32)
        dist.reduce_scatter(out, [data(32, seed=6), data(32, seed=7)], group=g)
        return [out]

    def broadcast(g):
        t = data(64, seed=8)
        dist.broadcast(t, src=1, group=g)
        return [t]

    def reduce(g):
        t = data(64, seed=9)
        dist.reduce(t, dst=0, group=g)
        return [t]

    def all_to_all_single(g):
        out = torch.zeros(64)
        dist.all_to_all_single(out, data(64, seed=10), group=g)
        return [out]

    def all_to_all(g):
        out = [torch.zeros(16) for _ in range(2)]
        dist.all_to_all(out, [data(16, seed=11), data(16, seed=12)], group=g)
        return out

    def gather(g):
        out = [torch.zeros(16) for _ in range(2)] if rank == 0 else None
        dist.gather(data(16, seed=13), out, dst=0, group=g)
        return out or []

    def scatter(g):
        out = torch.zeros(16)
        dist.scatter(out, [data(16, seed=14), data(16, seed=15)] if rank == 0 else None, src=0, group=g)
        return [out]

    def send_recv(g):
        t = data(32, seed=16)
        if rank == 0:
            dist.send(t, dst=1, group=g)
            return [t]
        dist.recv(t, src=0, group=g)
        return [t]

    def batch(g):
        out = torch.zeros(32)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, data(32, seed=17), peer, g),
                                       dist.P2POp(dist.irecv, out, peer, g)])
        for r in reqs:
            r.wait()
        return [out]

    def coalesced_megatron(g):
        outs = []
        for async_op in (False, True):
            buf = [data(128, seed=18 + i) for i in range(2)]
            out = [torch.zeros(64) for _ in range(2)]
            with dist._coalescing_manager(g, async_ops=async_op) as cm:
                for o, b in zip(out, buf):
                    dist.reduce_scatter_tensor(o, b, group=g, async_op=async_op)
            if async_op:
                cm.wait()
            outs += out
        return outs

    def objects(g):
        got = [None, None]
        dist.all_gather_object(got, {"rank": rank, "x": data(4, seed=20).tolist()}, group=g)
        lst = [data(4, seed=21).tolist()]
        dist.broadcast_object_list(lst, src=1, group=g)
        dist.barrier(group=g)
        return [torch.tensor(got[0]["x"] + got[1]["x"] + lst[0])]

    return dict(all_reduce=all_reduce, all_reduce_async=all_reduce_async, all_gather=all_gather,
                all_gather_into_tensor=all_gather_into_tensor, reduce_scatter_tensor=reduce_scatter_tensor,
                reduce_scatter=reduce_scatter, broadcast=broadcast, reduce=reduce,
                all_to_all_single=all_to_all_single, all_to_all=all_to_all, gather=gather, scatter=scatter,
                send_recv=send_recv, batch_isend_irecv=batch, coalesced_megatron=coalesced_megatron,
                objects=objects)


def _bitwise(rank: int, port: int) -> None:
    _init(rank, port, mindspeed_first=True)  # before torch: the import-hook path
    import torch
    import torch.distributed as dist

    from mindspeed_ha.patches import registry
    from mindspeed_ha.recovery import comm

    ops = _bitwise_ops(rank)
    group = _fresh_group()
    runs = {}
    types = []
    for ha in (False, True):
        (registry.enable if ha else registry.disable)("ha")
        types.append(type(dist.all_reduce(torch.ones(1), group=group, async_op=True)).__name__)
        runs[ha] = {name: [t.clone() for t in fn(group)] for name, fn in ops.items()}
    for name in ops:
        a, b = runs[False][name], runs[True][name]
        same = len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                                        for x, y in zip(a, b))
        _step(f"op.{name}", "equal" if same else "DIFFERENT")
    _step("handle_types", "/".join(types))
    assert comm.aborted() is None
    _step("compared", f"ops={len(ops)}")


class _CountingLock:
    """A lock that counts its releases (a Condition for the test to wait on)."""

    def __init__(self):
        self._lk, self.cond, self.released = threading.Lock(), threading.Condition(), 0

    def __enter__(self):
        self._lk.acquire()

    def __exit__(self, *exc):
        self._lk.release()
        with self.cond:
            self.released += 1
            self.cond.notify_all()


def test_comm_wait_helpers_keep_at_most_one_idle():
    """A helper still blocked on an op a recovery abandoned when the next wait comes: a
    second helper serves that wait; once both are done one of them stays idle, the other
    ends (keeping both grew a process by a thread now and then over its recoveries: the
    soak's flat-threads check failed on 75/76/77)."""
    from mindspeed_ha.recovery.comm import _Helpers

    helpers = _Helpers()
    helpers._lock = lock = _CountingLock()
    abandoned, done = threading.Event(), [threading.Event(), threading.Event()]

    def blocked():  # the abandoned op's wait, ending later (its group destroyed)
        abandoned.wait(30)
        done[0].set()

    helpers.submit(blocked)
    helpers.submit(done[1].set)  # the next wait, while the first helper is still blocked
    assert done[1].wait(30)
    abandoned.set()
    assert done[0].wait(30)
    with lock.cond:  # 2 submits + 2 helpers back from their jobs
        assert lock.cond.wait_for(lambda: lock.released >= 4, 30)
    assert len(helpers._idle) == 1


if __name__ == "__main__":
    scenario, rank_arg, port_arg = sys.argv[1:4]
    code = 0
    try:
        {"blocked": _blocked, "fault_hook": _fault_hook, "bitwise": _bitwise}[scenario](int(rank_arg), int(port_arg))
    except BaseException:  # noqa: BLE001 - reported, then the exit below
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # abandoned gloo ops must not hold up the exit (their threads never end)
