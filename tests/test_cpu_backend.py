"""CPU backend patch set and megatron-core fixes, in process (no ranks needed)."""

import pytest
import torch

import mindspeed_ha  # noqa: F401  (installs hooks, auto-enables cpu_backend here)
from mindspeed_ha.patches import cpu_backend, registry

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only process needed")


def test_autoenable_on_cpu_and_env_override(monkeypatch):
    assert registry.is_enabled("cpu_backend")
    monkeypatch.setenv(cpu_backend.ENV_OVERRIDE, "0")
    assert cpu_backend.wanted() is False
    monkeypatch.setenv(cpu_backend.ENV_OVERRIDE, "1")
    assert cpu_backend.wanted() is True
    monkeypatch.delenv(cpu_backend.ENV_OVERRIDE)
    assert cpu_backend.wanted() is True  # no CUDA, no torch_npu here


def test_patches_applied_after_megatron_import():
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel.schedules  # noqa: F401
    import megatron.core.tensor_parallel.random  # noqa: F401
    import megatron.core.transformer.utils  # noqa: F401
    import megatron.core.models.common.language_module.language_module  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.resharding  # noqa: F401  (fix.dist_ckpt_reshard_padding)

    names = {p.name for p in cpu_backend.PATCHES}
    active = set(registry.active("cpu_backend"))
    assert names <= active, names - active
    fixes = {r["name"]: r for r in registry.report() if r["name"].startswith("fix.")}
    assert fixes and all(r["active"] for r in fixes.values()), fixes


def test_torch_cuda_shims_only_when_enabled():
    assert torch.cuda.current_device() == torch.device("cpu")  # outside a CPU scope: usable as device=
    with cpu_backend.cpu_device_mode():  # inside: an index, as torch's (MindSpeed indexes generators with it)
        idx = torch.cuda.current_device()
        assert type(idx) is int and idx == 0
        assert torch.empty(2, device=idx).device.type == "cpu"  # which the scope maps to CPU
        assert torch.ones(2).to(idx).device.type == "cpu"
        assert [10][idx] == 10
    torch.cuda.synchronize()  # no-op
    registry.disable("cpu_backend")
    try:
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()  # pass-through: stock CPU-build behaviour
    finally:
        registry.enable("cpu_backend")


def test_device_factories_map_to_cpu():
    from megatron.core.transformer.utils import get_default_causal_mask

    mask = get_default_causal_mask(5)
    assert mask.device.type == "cpu" and mask.dtype == torch.bool
    assert mask.tolist() == torch.triu(torch.ones(5, 5), diagonal=1).bool().tolist()


def test_type_mapping_is_scoped():
    mode = cpu_backend.cpu_device_mode(True)
    t = torch.zeros(2, dtype=torch.bfloat16)
    with mode:
        assert t.type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
    assert t.type() == "torch.BFloat16Tensor"


def test_rng_tracker_really_forks_cpu_generator():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    torch.manual_seed(1)
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 4321)
    before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # default stream untouched
    with tracker.fork("model-parallel-rng"):
        b = torch.rand(4)  # the tracker's stream advanced
    gen = torch.Generator().manual_seed(4321)
    assert torch.equal(a, torch.rand(4, generator=gen))
    assert torch.equal(b, torch.rand(4, generator=gen))
    # checkpointed tracker state restores the stream
    saved = {k: v.clone() for k, v in tracker.get_states().items()}
    with tracker.fork("model-parallel-rng"):
        c = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork("model-parallel-rng"):
        assert torch.equal(torch.rand(4), c)


def test_quantize_param_shard_fix_is_guarded():
    from megatron.core.optimizer import distrib_optimizer

    assert distrib_optimizer.quantize_param_shard([], [], [], None) is None
    with pytest.raises(RuntimeError, match="Transformer Engine"):
        distrib_optimizer.quantize_param_shard([torch.zeros(1)], [torch.zeros(1)], [0], None)
