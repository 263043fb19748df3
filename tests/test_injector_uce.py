"""Fault injector: fault=uce (damage a whole tensor, then CUDA's ECC error) and
fault=network (a collective fails right after launch, through the comm fault hook)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mindspeed_ha.faults import FaultKind, classify
from mindspeed_ha.testing import injector
from mindspeed_ha.testing.injector import FaultSpec, InjectedFault, Injector


def test_uce_and_network_specs():
    spec = FaultSpec.parse("rank=1,iteration=4,point=forward,fault=uce")
    assert (spec.fault, spec.what) == ("uce", "param")
    assert FaultSpec.parse("rank=0,iteration=2,point=between,fault=uce,what=exp_avg_sq").what == "exp_avg_sq"
    assert FaultSpec.parse("rank=0,iteration=2,point=backward,fault=uce,what=grad").what == "grad"
    for point in ("grad_sync", "pp", "tp"):
        assert FaultSpec.parse(f"rank=0,iteration=2,point={point},fault=network").point == point
    for bad, why in [("rank=0,iteration=1,point=grad_sync,fault=uce", r"fault=uce fires only at points"),
                     ("rank=0,iteration=1,point=forward,fault=uce,what=bias", r"fault=uce takes what="),
                     ("rank=0,iteration=1,point=forward,fault=uce,how=nan", r"how= goes with fault=corrupt"),
                     ("rank=0,iteration=1,point=forward,fault=network", r"fault=network fires only at points"),
                     ("rank=0,iteration=1,point=pp,fault=kill", r"point='pp' takes fault=network only"),
                     ("rank=0,iteration=1,point=tp,fault=network,what=param", r"what= and how= go with"),
                     ("rank=0,iteration=1,point=between,fault=corrupt,what=grad", "needs what=")]:
        with pytest.raises(ValueError, match=why):
            FaultSpec.parse(bad)


def test_the_injected_texts_classify_as_uce_and_network():
    assert classify(InjectedFault(injector.UCE_MESSAGE)) is FaultKind.UCE
    assert classify(RuntimeError(injector.NETWORK_MESSAGE.format(port=29500))) is FaultKind.NETWORK


class _Opt:
    """Megatron optimizer shape: the torch optimizer is ``.optimizer``."""

    def __init__(self, params):
        self.optimizer = torch.optim.Adam(params, lr=0.1)


@pytest.fixture
def state(monkeypatch):
    """A model (one Linear with a DDP-style main_grad) and an optimizer after one update,
    published as the runtime's ctx in iteration 3."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = _Opt(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.optimizer.step()
    for p in model.parameters():
        p.main_grad = torch.ones_like(p)
    ctx = types.SimpleNamespace(model=model, optimizer=opt)
    import mindspeed_ha.runtime as runtime

    monkeypatch.setattr(runtime, "_runtime", types.SimpleNamespace(ctx=ctx, current=3))
    return ctx


@pytest.mark.parametrize("what", ["param", "grad", "main_param", "exp_avg", "exp_avg_sq"])
def test_uce_overwrites_the_whole_tensor_then_raises_the_cuda_text_once(state, what):
    inj = Injector(0, [FaultSpec.parse(f"rank=0,iteration=3,point=forward,fault=uce,what={what}")])
    target = injector._target_tensor(state, what)
    before = target.clone()
    with pytest.raises(InjectedFault) as info:
        inj.fire("forward", 3)  # no target: the runtime's ctx
    assert classify(info.value) is FaultKind.UCE
    assert torch.all(target == injector.UCE_GARBAGE) and not torch.equal(target, before)
    inj.fire("forward", 3)  # the re-run of the step after a repair: no second fault
    assert inj.armed("forward", 3) is None


def test_uce_damage_without_state_names_the_problem(monkeypatch):
    import mindspeed_ha.runtime as runtime

    monkeypatch.setattr(runtime, "_runtime", None)
    inj = Injector(0, [FaultSpec.parse("rank=0,iteration=1,point=forward,fault=uce")])
    with pytest.raises(RuntimeError, match="no model/optimizer to damage"):
        inj.fire("forward", 1)


@pytest.fixture
def comm_stub(monkeypatch):
    """A stand-in for mindspeed_ha.recovery.comm (only set_fault_hook is used)."""
    import mindspeed_ha.recovery as recovery

    stub = types.ModuleType("mindspeed_ha.recovery.comm")
    stub.hooks = []
    stub.set_fault_hook = stub.hooks.append
    monkeypatch.setitem(sys.modules, "mindspeed_ha.recovery.comm", stub)
    monkeypatch.setattr(recovery, "comm", stub, raising=False)
    return stub


@pytest.fixture
def groups(monkeypatch):
    from megatron.core import parallel_state as mpu

    tp, dp = object(), object()
    monkeypatch.setattr(mpu, "get_tensor_model_parallel_group", lambda check_initialized=True: tp)
    monkeypatch.setattr(mpu, "get_data_parallel_group", lambda **kw: dp)
    return types.SimpleNamespace(tp=tp, dp=dp)


def _set_iteration(monkeypatch, k):
    import mindspeed_ha.runtime as runtime

    monkeypatch.setattr(runtime, "_runtime", types.SimpleNamespace(ctx=None, current=k))


def test_network_fires_at_the_first_matching_collective_of_its_iteration(comm_stub, groups, monkeypatch):
    specs = [FaultSpec.parse(t) for t in ("rank=0,iteration=2,point=pp,fault=network",
                                          "rank=0,iteration=3,point=tp,fault=network",
                                          "rank=0,iteration=4,point=grad_sync,fault=network",
                                          "rank=1,iteration=2,point=pp,fault=network")]
    inj = Injector(0, specs)
    assert comm_stub.hooks == [inj.on_collective]
    hook = comm_stub.hooks[0]
    _set_iteration(monkeypatch, 1)
    hook("send", None)  # not armed in iteration 1
    _set_iteration(monkeypatch, 2)
    hook("all_reduce", groups.tp)  # not a p2p op
    inj.fire("pp", 2)  # network faults fire from the hook only
    with pytest.raises(InjectedFault) as info:
        hook("isend", None)
    assert classify(info.value) is FaultKind.NETWORK
    hook("isend", None)  # once
    _set_iteration(monkeypatch, 3)
    hook("all_reduce", groups.dp)  # not the TP group
    with pytest.raises(InjectedFault):
        hook("all_reduce", groups.tp)
    _set_iteration(monkeypatch, 4)
    hook("all_reduce", groups.dp)  # the loss all-reduce: same DP group, outside the grad sync

    def start_grad_sync():  # DDP's bucket group issuing the gradient all-reduce
        hook("all_reduce", groups.dp)

    with pytest.raises(InjectedFault):
        start_grad_sync()
    start_grad_sync()  # once
    inj2 = Injector(0, [specs[2]])

    def start_grad_sync():  # on gloo: torch's coalescing manager launches the bucket's ops
        inj2.on_collective("_coalescing_manager", groups.dp)

    with pytest.raises(InjectedFault):
        start_grad_sync()
    inj.fire("grad_sync", 4)  # the grad_sync point's own hook does nothing for network


def test_no_network_spec_installs_no_hook(comm_stub):
    Injector(0, [FaultSpec.parse("rank=0,iteration=2,point=forward,fault=uce")])
    Injector(0, [FaultSpec.parse("rank=1,iteration=2,point=pp,fault=network")])  # another rank's
    assert comm_stub.hooks == []


def test_hold_released_one_iteration_at_a_time(tmp_path, monkeypatch):
    """fault=hold: an empty release file releases every hold, one holding an iteration the
    holds up to it (tests/test_pause_job.py holds its job before each operator step)."""
    path = str(tmp_path / "release")
    monkeypatch.setenv("MINDSPEED_HA_INJECT_RELEASE", path)
    assert not injector.released(path, 1)
    injector.release(path, 4)
    assert injector.released(path, 4) and not injector.released(path, 5)
    # a straggler's sleep at every iteration does not hide a hold of a later one at the same point
    hold = FaultSpec.parse("rank=0,iteration=4,point=between,fault=hold")
    inj = Injector(0, [FaultSpec.parse("rank=0,iteration=1,point=between,fault=slow,sleep=0.01"), hold])
    assert inj.armed("between", 4) == hold and inj.armed("between", 3).fault == "slow"
    inj.fire("between", 4)  # returns: released (a wrong reading would hold it HOLD_MAX_S)
    assert inj.armed("between", 4).fault == "slow"  # the hold fired, once
    monkeypatch.setattr(injector, "HOLD_MAX_S", 0.0)
    injector._hold(5)  # not released: goes on after HOLD_MAX_S, logged
    injector.release(path)
    assert injector.released(path, 10 ** 6) and not [n for n in tmp_path.iterdir() if n.name != "release"]
    with open(path, "w") as f:
        f.write("x")
    with pytest.raises(ValueError, match="MINDSPEED_HA_INJECT_RELEASE"):
        injector.released(path, 1)
