"""End a whole process tree: what the launcher and the demo do when they are interrupted.

torchrun starts every worker in a session of its own (torch 2.13
``multiprocessing/subprocess_handler/subprocess_handler.py``: ``start_new_session``), so a
signal to the launcher's process group never reaches them, and a worker whose launcher
died is re-parented to init and keeps running. Two tools close that gap:

* :func:`become_subreaper`: Linux ``prctl(PR_SET_CHILD_SUBREAPER)`` (linux/prctl.h: 36):
  a descendant whose parent dies is re-parented to this process instead of init, so it
  stays in this process's tree and :func:`end_tree` still finds it.
* :func:`interrupt_on_signal`: SIGINT / SIGTERM to a command that runs jobs (the demo)
  end its whole tree at once, then raise ``KeyboardInterrupt``.
* :func:`end_tree`: SIGSTOP every descendant, top down, until a walk finds no new one
  (a stopped process cannot fork, so nothing is started behind the walk's back), then
  SIGKILL each of them and each one's process group (the workers lead theirs), and wait,
  bounded, until every one is gone or a zombie. Processes are never reaped here: a
  direct child belongs to whoever holds its ``Popen`` (reaping it would make
  ``Popen.poll()`` report exit 0).

Imports psutil only (no torch): the demo and the launcher use it before torch is loaded.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Dict, List, Optional

import psutil

#: seconds :func:`end_tree` waits for the SIGKILLed processes to be gone (a process in
#: uninterruptible sleep can take longer; it is then reported, not waited for)
END_WAIT_S = 10.0
_POLL_S = 0.02  # polling an observable state (process gone), not a synchronisation sleep


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (Linux only).

    Returns:
        True when set; False where ``prctl`` is missing (not Linux) or refused.
    """
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def is_subreaper() -> bool:
    """Whether this process is a child subreaper (``PR_GET_CHILD_SUBREAPER``, linux/prctl.h:
    37); False where ``prctl`` is missing."""
    try:
        import ctypes

        flag = ctypes.c_int(0)
        ok = ctypes.CDLL(None, use_errno=True).prctl(37, ctypes.byref(flag), 0, 0, 0) == 0
        return ok and flag.value == 1
    except (OSError, AttributeError):
        return False


def _freeze(root: psutil.Process) -> Dict[int, psutil.Process]:
    """Every descendant of ``root``, each SIGSTOPped (top down, until a walk finds no new one)."""
    found: Dict[int, psutil.Process] = {}
    while True:
        try:
            new = [p for p in root.children(recursive=True) if p.pid not in found]
        except psutil.NoSuchProcess:
            return found
        if not new:
            return found
        for p in new:
            found[p.pid] = p
            try:
                p.suspend()
            except psutil.Error:
                pass


def end_tree(pid: Optional[int] = None, include_root: bool = False, wait_s: float = END_WAIT_S) -> List[int]:
    """SIGKILL every descendant of ``pid`` (default: this process), and ``pid`` itself when
    ``include_root``; wait until they are gone or zombies.

    Args:
        pid: the root of the tree (default ``os.getpid()``; never killed when it is this process).
        include_root: end ``pid`` too (it is stopped first, so it cannot start another child).
        wait_s: seconds to wait for the killed processes to be gone.

    Returns:
        The PIDs still alive after ``wait_s`` (uninterruptible sleep), normally [].
    """
    me = os.getpid()
    pid = me if pid is None else pid
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    own_group = os.getpgrp()
    if include_root and pid != me:
        try:
            root.suspend()
        except psutil.Error:
            pass
    procs = _freeze(root)
    if include_root and pid != me:
        procs[pid] = root
    groups = set()
    for p in procs.values():
        try:
            groups.add(os.getpgid(p.pid))
        except OSError:
            pass
        try:
            p.kill()
        except psutil.Error:
            pass
    for pgid in groups - {own_group}:  # what a worker started in its group and lost track of
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    end = time.monotonic() + wait_s
    alive = list(procs.values())
    while alive and time.monotonic() < end:
        alive = [p for p in alive if _running(p)]
        if alive:
            time.sleep(_POLL_S)
    return [p.pid for p in alive]


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ignore(signum, frame) -> None:
    """A signal after the first: the process is ending already (not SIG_IGN: a signal
    already caught when the handler changes would print a warning)."""


def interrupt_on_signal() -> Callable[[], None]:
    """For a command that runs jobs as its children (``mindspeed-ha demo``, ``soak``): the
    first SIGINT or SIGTERM SIGKILLs every descendant (:func:`end_tree`: the launchers and
    their workers, which live in sessions of their own) and raises ``KeyboardInterrupt(signum)``;
    later ones are ignored. Off the main thread nothing is installed.

    Returns:
        A function that puts the previous handlers back.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_signal(signum, frame):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _ignore)
        end_tree()
        raise KeyboardInterrupt(signum)

    saved = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(sig, handler) for sig, handler in saved.items()]
