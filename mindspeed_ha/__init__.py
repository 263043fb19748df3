"""mindspeed-ha: training fault tolerance for Megatron-LM core_v0.12.1 and MindSpeed-LLM.

Importing this package installs the patch registry's post-import hooks. Every patch
is a pass-through until its feature is enabled (by ``--enable-high-availability`` and
friends, parsed by Megatron's own argument parser), so a run with every HA flag off
behaves exactly as without this package. The CPU backend patch set switches itself
on only when neither CUDA nor an NPU is present.
"""

from .version import __version__  # noqa: F401


def _install():
    from mindspeed_ha.patches import all_patches, install
    from mindspeed_ha.patches.cpu_backend import autoenable as cpu_backend_autoenable

    install(all_patches())
    cpu_backend_autoenable()


_install()
