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
"""

from __future__ import annotations

import os
import shutil


def release_mp_tempdir() -> None:
    """Remove this process's ``multiprocessing`` temp directory, if it made one. Never raises."""
    try:
        from multiprocessing import process

        path = process.current_process()._config.get("tempdir")
        if path and os.path.basename(path).startswith("pymp-") and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass
