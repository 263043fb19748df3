"""mindspeed-ha: training fault tolerance for Megatron-LM core_v0.12.1 and MindSpeed-LLM.

Importing this package installs the patch registry's post-import hooks. Every patch
is a pass-through until its feature is enabled (by ``--enable-high-availability`` and
friends, parsed by Megatron's own argument parser), so a run with every HA flag off
behaves exactly as without this package. The CPU backend patch set switches itself
on only when neither CUDA nor an NPU is present; that check needs torch, so it runs
when torch is imported (at once if it already is). Importing this package therefore
loads neither torch nor megatron: the standalone controller
(``python -m mindspeed_ha.control.controller``) starts in a fraction of a second.
"""

from .version import __version__  # noqa: F401


def _install():
    import wrapt

    from mindspeed_ha.patches import all_patches, install
    from mindspeed_ha.patches.cpu_backend import autoenable as cpu_backend_autoenable

    install(all_patches())
    from mindspeed_ha.patches.testing import autoenable as testing_autoenable

    testing_autoenable()
    wrapt.register_post_import_hook(lambda _torch: cpu_backend_autoenable(), "torch")


_install()
