"""Run MindSpeed-LLM's own, unmodified ``pretrain_gpt.py`` in tests (CPU/gloo).

MindSpeed-LLM 2.3.0 runs on MindSpeed 2.3.0_core_r0.12.1 and Megatron-LM core_v0.12.1;
none is on a package registry (shared/third_party/README.md). :func:`unpack` puts the
three trees in a directory; :func:`launch` starts ``mindspeed-ha-run <MindSpeed-LLM>/
pretrain_gpt.py ARGS`` with MindSpeed and Megatron-LM on ``PYTHONPATH`` (the Megatron-LM
tree before any installed megatron-core). On a machine without an NPU, MindSpeed needs a
CPU stand-in of ``torch_npu`` on the path too (``extra_path``; the project's
``tests/npu_double``, never installed by the package). Nothing here writes into the trees:
:func:`mindspeed_ha.testing.megatron_lm.tree_digest` lets a test prove it.
"""

from __future__ import annotations

import os
import tarfile
from typing import Dict, Mapping, Optional, Sequence

from mindspeed_ha.env import FORKSERVER_PRELOAD

from . import megatron_lm as mlm
from .harness import RunResult, launch as _launch, launcher_command

#: tarball names in shared/third_party (key -> file)
TARBALLS = {"mindspeed_llm": "MindSpeed-LLM-2.3.0.tar.gz", "mindspeed": "MindSpeed-2.3.0_core_r0.12.1.tar.gz",
            "megatron_lm": "Megatron-LM-core_v0.12.1.tar.gz"}
#: the file that marks each tree's root (Megatron-LM's ``megatron`` is a namespace package)
_MARKERS = {"mindspeed_llm": "mindspeed_llm/__init__.py", "mindspeed": "mindspeed/__init__.py",
            "megatron_lm": "megatron/core/__init__.py"}

#: MindSpeed-LLM's four high-availability flags, as the reference guide gives them
HA_FLAGS = ("--enable-high-availability", "--enable-hbmfault-repair", "--enable-worker-reboot",
            "--distributed-optimizer-no-replica")


def unpack(tarballs: Mapping[str, str], dest: str) -> Dict[str, str]:
    """Unpack each ``key -> tarball`` (keys of :data:`TARBALLS`) into its own folder of ``dest``.

    Returns:
        ``key -> tree root`` (the folder holding ``mindspeed_llm/``, ``mindspeed/``, ``megatron/``).

    Raises:
        FileNotFoundError: a tarball holds no such package folder.
    """
    roots = {}
    for key, tarball in tarballs.items():
        out = os.path.join(dest, key)
        with tarfile.open(tarball) as tar:
            tar.extractall(out, filter="data")
        for root, _dirs, _files in os.walk(out):
            if os.path.isfile(os.path.join(root, _MARKERS[key])):
                roots[key] = root
                break
        else:
            raise FileNotFoundError(f"{tarball}: no {_MARKERS[key]} inside")
    return roots


def env(roots: Mapping[str, str], extra_path: Sequence[str] = (), extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Environment of a run: ``PYTHONPATH`` = ``extra_path`` + MindSpeed + Megatron-LM + the
    caller's ``PYTHONPATH``; one thread per rank; a fork server (``MINDSPEED_HA_FORKSERVER=1``)
    preloads nothing of Megatron-LM's tree (MindSpeed patches it as the script imports it)."""
    path = [*extra_path, roots["mindspeed"], roots["megatron_lm"]]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    out = mlm.stock_env({"PYTHONPATH": os.pathsep.join(path)})
    out[FORKSERVER_PRELOAD] = ""  # megatron.training after MindSpeed's adaptor, as the script imports it
    out.update(extra or {})
    return out


def launch(roots: Mapping[str, str], train_args: Sequence[str], *, nproc: int = 4,
           extra_path: Sequence[str] = (), env_extra: Optional[Mapping[str, str]] = None,
           timeout_s: float = 400, cwd: Optional[str] = None) -> RunResult:
    """``mindspeed-ha-run --standalone --nproc-per-node N <MindSpeed-LLM>/pretrain_gpt.py ARGS``.

    ``cwd`` defaults to the MindSpeed-LLM root (as its scripts run); losses come from the
    ``testing.loss_log`` patch, exact.
    """
    root = roots["mindspeed_llm"]
    return _launch(nproc, list(train_args), env=env(roots, extra_path, env_extra), timeout_s=timeout_s,
                   launcher=launcher_command(nproc), cwd=cwd or root,
                   script=os.path.join(root, "pretrain_gpt.py"))
