"""CPU test double of ``torch_npu`` (tests only; never installed by the package).

The minimum MindSpeed 2.3.0_core_r0.12.1 and MindSpeed-LLM 2.3.0 need to import and train
on CPU with their NPU fusions off: names they import at module level, each answering as a
machine without an NPU would, or raising if a fused kernel is actually called. It marks
itself with ``IS_CPU_TEST_DOUBLE`` so mindspeed-ha's CPU backend does not take it for an
NPU (``mindspeed_ha.patches.cpu_backend.wanted``).
"""

import torch

IS_CPU_TEST_DOUBLE = True
__version__ = "2.7.1.cpu-test-double"


class _ProcessGroupHCCL:
    class Options:  # no ``hccl_config``: MindSpeed then leaves gloo's options alone
        pass


class _C:  # torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options
    class _distributed_c10d:
        ProcessGroupHCCL = _ProcessGroupHCCL


def _no_kernel(name):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"torch_npu test double: NPU kernel {name} called on CPU (turn its fusion off)")
    kernel.__name__ = name
    return kernel


def __getattr__(name):
    if name.startswith("npu_") or name.startswith("_npu"):
        return _no_kernel(name)
    raise AttributeError(f"torch_npu test double has no attribute {name!r}")


from . import npu  # noqa: E402

torch.npu = npu
