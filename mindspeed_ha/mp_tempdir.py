"""The ``multiprocessing`` temporary directory of this process, removed before ``os._exit``.

Megatron's ``torch_dist`` save starts a ``multiprocessing`` manager
(megatron/core/dist_checkpointing/strategies/filesystem_async.py ``_get_write_results_queue``);
its address is an AF_UNIX socket in a ``pymp-*`` directory that ``multiprocessing`` makes
for this process (``multiprocessing.util.get_temp_dir``, recorded in
``current_process()._config["tempdir"]``) and removes only in its exit finalizer. A rank that
ends with ``os._exit`` (after a dying checkpoint, or to skip gloo's teardown) skips that
finalizer, so every such rank left one directory in ``/tmp``. The directory is provably this
process's own (made by this interpreter, named in its own config), so it is removed here,
as the interpreter would at a normal exit. Imports nothing but the standard library.

The same save starts that manager's server as a ``spawn`` child with its own ``pymp-*``
directory (its listener socket); the manager's exit finalizer shuts it down, which
``os._exit`` skips too: the server outlived the rank (an orphan until its process group
was killed) and its directory stayed (measured: one per rank and job; 2,181 in ``/tmp``
after a day of test runs). So the manager is shut down first, as its finalizer would
(the server exits normally and removes its own directory).
"""

from __future__ import annotations

import os
import shutil


#: the module whose ``_results_queue`` (a proxy of a ``spawn`` manager) a torch_dist save makes
_ASYNC_WRITER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def _shutdown_write_results_manager() -> None:
    """Shut down the manager behind megatron-core's write-results queue, if one was made:
    a shutdown request, then at most ``shutdown_timeout`` (1 s) for its server to exit
    before it is terminated (``multiprocessing.managers.BaseManager.shutdown``)."""
    import sys

    module = sys.modules.get(_ASYNC_WRITER)
    manager = getattr(getattr(module, "_results_queue", None), "_manager", None)
    if manager is not None and hasattr(manager, "shutdown"):
        manager.shutdown()


def release_mp_tempdir() -> None:
    """Shut down megatron-core's write-results manager (its server and its directory go
    with it), then remove this process's ``multiprocessing`` temp directory, if it made
    one. Never raises."""
    try:
        _shutdown_write_results_manager()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass
    release_own_tempdir()


def release_own_tempdir() -> None:
    """Remove this process's ``multiprocessing`` temp directory, if it made one (the one
    named in its own config, ``pymp-*``, not a link). Never raises."""
    try:
        from multiprocessing import process

        path = process.current_process()._config.get("tempdir")
        if path and os.path.basename(path).startswith("pymp-") and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass
