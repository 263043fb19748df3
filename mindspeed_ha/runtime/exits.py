"""How a rank ends: its exit status, a GOODBYE at interpreter exit, SIGTERM / SIGINT as a
graceful stop of the whole job."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Callable

from mindspeed_ha.mp_tempdir import release_mp_tempdir

#: ``code``: 1 once an exception reached ``sys.excepthook``; ``exit``: the script's exit status
_uncaught = {"code": 0}


def record_exit_status(code) -> None:
    """The status the script is exiting with (``SystemExit.code``; the worker entry
    :mod:`mindspeed_ha.boot` calls this), for the GOODBYE and for :func:`exit_now`."""
    if code is None:
        code = 0
    _uncaught["exit"] = code if isinstance(code, int) else 1


def exit_now(code: int) -> None:
    """End the process now, skipping the interpreter's teardown.

    After an in-place recovery the old process groups still hold the collectives the
    recovery abandoned (gloo cannot cancel them, see :mod:`mindspeed_ha.recovery.comm`).
    When the peers exit, those fail; during interpreter finalization the waiting thread
    cannot take the GIL back and the C++ runtime calls ``std::terminate`` (measured: exit
    -6 on every rank but the first to leave). Everything the job had to do is done here
    (the atexit hook runs after the script ended, the GOODBYE was sent), so: flush the
    streams and the logging handlers, then ``os._exit``.
    """
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - best effort before _exit
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    release_mp_tempdir()  # what the skipped interpreter teardown would remove
    os._exit(code)


def install_exit_hooks(get_runtime: Callable[[], object]) -> None:
    """Say GOODBYE at interpreter exit, so a finished rank is not taken for a dead one
    (``get_runtime``: the process's runtime at exit time, or None)."""
    import atexit

    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        _uncaught["code"] = 1
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook

    def goodbye():
        rt = get_runtime()
        if rt is None:
            return
        code = _uncaught["code"] if _uncaught.get("exit") is None else _uncaught["exit"]
        rt.close(code)
        if rt.recoveries:
            exit_now(code)

    atexit.register(goodbye)
    _install_sigterm_deferral(get_runtime)


def _install_sigterm_deferral(get_runtime: Callable[[], object]) -> None:
    """SIGTERM / SIGINT to a worker start a graceful stop of the whole job.

    How schedulers preempt (Kubernetes, Slurm: SIGTERM, then SIGKILL after a grace
    period, usually 30 s) and what Ctrl-C sends. The handler asks the controller for a
    graceful stop (:meth:`Processor.request_stop`) and returns: training goes on until
    every rank finished the iteration in progress and paused; the checkpoint of the last
    completed iteration is written and the controller's EXIT(75) ends the process. A
    rank already frozen by a fault round (plain torchrun SIGTERMs every worker when one
    fails) just keeps going: the dying checkpoint under way ends it.

    So a SIGTERM to a single worker never stalls the others: the job stops gracefully as
    a whole, within ``--ha-preemption-deadline``. When there is no controller to ask
    (not registered yet, or gone), or none acts within ``heartbeat_timeout_s``, the
    signal's default action runs (exit 143 for SIGTERM, KeyboardInterrupt for SIGINT).
    """
    import signal

    if threading.current_thread() is not threading.main_thread():
        return

    def on_signal(signum, frame):
        rt = get_runtime()
        proc = rt.processor if rt is not None else None
        name = signal.Signals(signum).name
        if proc is not None and proc.request_stop(f"{name} to rank {rt.rank} (pid {os.getpid()})", 128 + signum):
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
