"""The launcher's side of ``MINDSPEED_HA_FORKSERVER=1``: workers forked from one pre-imported
process per node (:mod:`mindspeed_ha.forkserver`), in the shape torch's process context
expects of a worker.

torchrun's ``SubprocessContext`` (torch 2.13 ``torch/distributed/elastic/multiprocessing/
api.py``) starts each worker with ``get_subprocess_handler(entrypoint, args, env, stdout,
stderr, local_rank_id, numa_options)`` and from then on uses only the handler's ``.proc``
(``pid``, ``poll()``, ``wait(timeout)``) and ``.close(death_sig)`` (``os.killpg`` of the
worker's session). While :func:`forked_workers` is active that name is bound to
:func:`start_handler`: a worker whose command line is ``python [-u] -m mindspeed_ha.boot
...`` (``mindspeed-ha-run``'s), without NUMA binding, is forked by the node's fork server
and waited for by PID (it is this process's child once the middle process exited: the
launcher is a child subreaper); any other worker, or when the fork server cannot fork,
starts as torchrun starts it. The worker-reboot agent's restarts use the same function.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import struct
import subprocess
import time
from typing import Dict, Iterator, Optional, Sequence

from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler, get_subprocess_handler

from mindspeed_ha import spare
from mindspeed_ha.spare import boot_argv

log = logging.getLogger("mindspeed_ha.launch")

#: seconds the launcher waits for the fork server's answer (its imports come first)
REPLY_TIMEOUT_S = 300.0
#: seconds between two polls of a forked worker in :meth:`ForkedProcess.wait`
WAIT_POLL_S = 0.01
_PID = struct.Struct(">i")


class ForkedProcess:
    """A worker forked by the fork server and re-parented to this process, in the shape of
    ``subprocess.Popen`` that torch's process context uses: ``pid``, ``returncode``
    (negative: the signal that ended it), ``poll()``, ``wait(timeout)``,
    ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, pid: int, args: Sequence[str]):  # noqa: D107
        self.pid = pid
        self.args = list(args)
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = 255
                log.warning("forked worker pid %d was reaped by someone else; exit status unknown (255)", self.pid)
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """The exit status; polls every :data:`WAIT_POLL_S` s.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(WAIT_POLL_S)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


class ForkedHandler(SubprocessHandler):
    """torch's ``SubprocessHandler`` shape around a :class:`ForkedProcess` (its ``close``
    is torch's: ``os.killpg`` of the worker's session, which it leads)."""

    def __init__(self, proc: ForkedProcess, local_rank_id: int):  # noqa: D107 (torch's __init__ starts a process)
        self._stdout = self._stderr = None
        self.local_rank_id = local_rank_id
        self.proc = proc


class ForkServer:
    """The node's fork server process (:mod:`mindspeed_ha.forkserver`), started by the
    launcher in a session of its own; it ends on EOF of its request pipe (:meth:`close`,
    or this process's death).

    Args:
        entrypoint: the workers' interpreter.
        sys_path: the script's directory, first on the server's ``sys.path`` (None: ``-m``).
    """

    def __init__(self, entrypoint: str, sys_path: Optional[str]):  # noqa: D107
        self.entrypoint, self.sys_path = entrypoint, sys_path
        req_r, self._req_w = os.pipe()
        self._reply_r, reply_w = os.pipe()
        cmd = [entrypoint, "-u", "-m", "mindspeed_ha.forkserver", str(req_r), str(reply_w)]
        if sys_path:
            cmd += ["--sys-path", sys_path]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(req_r, reply_w), start_new_session=True)
        finally:
            os.close(req_r)
            os.close(reply_w)
        self.usable = True
        log.info("fork server started: pid %d", self.proc.pid)

    def fork(self, message: bytes) -> Optional[int]:
        """The PID of a new worker (``message``: :func:`mindspeed_ha.spare.worker_message`), or
        None: the server cannot fork (it says why on the console) or is gone; it is not asked
        again."""
        if not self.usable:
            return None
        try:
            spare.write_all(self._req_w, message)
            ready, _, _ = select.select([self._reply_r], [], [], REPLY_TIMEOUT_S)
            raw = spare.read_exact(self._reply_r, _PID.size) if ready else None
        except OSError as exc:
            log.warning("fork server (pid %d) unusable (%s): workers start as torchrun starts them", self.proc.pid, exc)
            raw = None
        pid = _PID.unpack(raw)[0] if raw else -1
        if pid <= 0:
            self.usable = False
            if raw is None:
                log.warning("fork server (pid %d) did not answer: workers start as torchrun starts them",
                            self.proc.pid)
            return None
        return pid

    def close(self) -> None:
        """EOF to the server (it exits), then reap it."""
        for fd in (self._req_w, self._reply_r):
            try:
                os.close(fd)
            except OSError:
                pass
        self._req_w = self._reply_r = -1
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_SERVERS: Dict[tuple, ForkServer] = {}
_ACTIVE = False


def start_handler(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options=None) -> SubprocessHandler:
    """torch's ``get_subprocess_handler``, forking ``mindspeed_ha.boot`` workers from the fork
    server while :func:`forked_workers` is active (see the module docstring)."""
    argv = boot_argv(entrypoint, args) if _ACTIVE and numa_options is None else None
    if argv is not None:
        sys_path = None if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0]))
        key = (entrypoint, sys_path)
        server = _SERVERS.get(key)
        if server is None:
            server = _SERVERS[key] = ForkServer(entrypoint, sys_path)
        try:
            message = spare.worker_message(argv, env, stdout, stderr)
        except ValueError as exc:  # larger than a message may be: this worker as torchrun starts it
            log.warning("worker %d not forked: %s", local_rank_id, exc)
            message = None
        pid = server.fork(message) if message is not None else None
        if pid is not None:
            return ForkedHandler(ForkedProcess(pid, (entrypoint, *map(str, args))), local_rank_id)
    return get_subprocess_handler(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                                  local_rank_id=local_rank_id, numa_options=numa_options)


@contextlib.contextmanager
def forked_workers(enabled: bool) -> Iterator[None]:
    """While the job runs: torch's process context starts workers with :func:`start_handler`
    (``enabled``), and the fork servers are closed at the end."""
    global _ACTIVE
    if not enabled:
        yield
        return
    import torch.distributed.elastic.multiprocessing.api as mp_api

    saved, mp_api.get_subprocess_handler = mp_api.get_subprocess_handler, start_handler
    _ACTIVE = True
    try:
        yield
    finally:
        _ACTIVE = False
        mp_api.get_subprocess_handler = saved
        servers = list(_SERVERS.values())
        _SERVERS.clear()
        for server in servers:
            server.close()
