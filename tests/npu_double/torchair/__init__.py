"""CPU test double of ``torchair`` (Ascend's graph-mode converter library; tests only).

MindSpeed's op builders import it at module level to register graph converters for their
fused NPU kernels; on CPU no graph is ever converted, so registration is a no-op."""

from . import ge


def register_fx_node_ge_converter(*args, **kwargs):
    def register(fn):
        return fn
    return register
