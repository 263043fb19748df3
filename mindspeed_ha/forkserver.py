"""The fork server of ``mindspeed-ha-run`` (``MINDSPEED_HA_FORKSERVER=1``): one pre-imported
process per node from which every worker is forked, instead of N interpreters that each
import torch and megatron-core.

Why: a rank of Megatron-LM's pretrain_gpt.py spends 3.9 CPU-seconds importing before it
does anything (torch 1.6, megatron-core 1.5, megatron/training the rest; measured on this
project's CPU machine, tests/_hidden notes the extra 4.1 of nvidia-modelopt); N workers
of a node pay it N times, at once, on the same cores. This is the pattern of Python's
``multiprocessing`` forkserver with ``set_forkserver_preload``, applied to torchrun's
binary workers.

``python -u -m mindspeed_ha.forkserver REQ_FD REPLY_FD [--sys-path DIR]`` imports what
:mod:`mindspeed_ha.spare` imports (torch, torch.distributed, megatron.core, mindspeed_ha and
its patches' hooks) plus the modules named in ``MINDSPEED_HA_FORKSERVER_PRELOAD``
(comma-separated; e.g. ``megatron.training`` of the script's tree, found through
``--sys-path``; one that fails to import is named on stderr and left to the worker), then serves requests on the pipe ``REQ_FD``: each is one
:func:`mindspeed_ha.spare.encode` message (argv after ``-m mindspeed_ha.boot``, the whole
env, the stdout/stderr paths). For each it forks twice: the grandchild becomes the worker
(its own session, as torch's ``Popen(start_new_session=True)``; env, streams and argv as a
warm spare's, :func:`mindspeed_ha.spare.become`; then :func:`mindspeed_ha.boot.main` and the
interpreter's normal exit: atexit handlers, exit status), the middle process exits at once,
so the worker is re-parented to the nearest child subreaper, the launcher
(:func:`mindspeed_ha.launch.proctree.become_subreaper`), which waits for it as for its own
child. The worker starts only after the server reaped the middle process (so its parent is
the launcher when it starts, for ``PR_SET_PDEATHSIG`` and ``getppid``). The reply on
``REPLY_FD`` is 4 bytes, big-endian signed: the worker's PID, or -1 (the server cannot
fork safely: a thread besides the main one exists after the imports; the launcher then
starts workers as torchrun does). EOF on ``REQ_FD`` ends the server (exit 0).

Same limits as a warm spare (see :mod:`mindspeed_ha.spare`): environment variables read
at import time are the launcher's. The workers also share the server's
``PYTHONHASHSEED``-derived hash seed (a fresh interpreter draws its own).
"""

from __future__ import annotations

import os
import struct
import sys
from typing import Any, Dict, List, Optional

from mindspeed_ha import spare
from mindspeed_ha.env import FORKSERVER_PRELOAD as ENV_PRELOAD
_PID = struct.Struct(">i")


def preload_names(raw: Optional[str]) -> List[str]:
    """The module names of ``MINDSPEED_HA_FORKSERVER_PRELOAD``.

    Raises:
        ValueError: a name that is not a dotted Python identifier.
    """
    names = [n.strip() for n in (raw or "").split(",") if n.strip()]
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"{ENV_PRELOAD}: {name!r} is not a module name (comma-separated dotted names)")
    return names


#: threads that survive a fork by design: jemalloc's background purging thread (pyarrow's
#: allocator, loaded with ``datasets`` / ``transformers``) is stopped by jemalloc's own
#: ``pthread_atfork`` handlers and started again on demand in the child
#: (jemalloc ``src/background_thread.c``, ``background_thread_postfork_child``)
FORK_SAFE_THREADS = ("jemalloc_bg_thd",)


def _threads() -> int:
    """Threads of this process that a fork would leave half-copied (the main one included)."""
    try:
        others = []
        for tid in os.listdir("/proc/self/task"):
            if int(tid) != os.getpid():
                with open(f"/proc/self/task/{tid}/comm") as f:
                    others.append(f.read().strip())
    except OSError:  # no procfs: Python's own count (native threads unseen)
        import threading

        return threading.active_count()
    return 1 + sum(1 for name in others if name not in FORK_SAFE_THREADS)


def _read_request(fd: int) -> Optional[bytes]:
    header = spare.read_exact(fd, 4)
    if header is None:
        return None
    (size,) = struct.unpack(">I", header)
    if size > spare.MAX_MESSAGE_BYTES:
        raise ValueError(f"request of {size} bytes: at most {spare.MAX_MESSAGE_BYTES}")
    return spare.read_exact(fd, size)


def _fork_worker(body: bytes, req_fd: int, reply_fd: int) -> Optional[Dict[str, Any]]:
    """Fork the worker of ``body``: its message in the worker, None in the server."""
    msg = spare.decode(body)
    go_r, go_w = os.pipe()
    pid_r, pid_w = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(go_w)
        os.close(pid_r)
        worker = os.fork()
        if worker == 0:
            os.close(pid_w)
            os.close(req_fd)
            os.close(reply_fd)
            os.setsid()
            os.read(go_r, 1)  # the server reaped the middle process: our parent is the launcher
            os.close(go_r)
            return msg
        spare.write_all(pid_w, _PID.pack(worker))
        os._exit(0)
    os.close(go_r)
    os.close(pid_w)
    raw = spare.read_exact(pid_r, _PID.size)
    os.close(pid_r)
    os.waitpid(middle, 0)
    worker = _PID.unpack(raw)[0] if raw else -1
    spare.write_all(reply_fd, _PID.pack(worker))
    spare.write_all(go_w, b"g")
    os.close(go_w)
    return None


def serve(req_fd: int, reply_fd: int) -> Dict[str, Any]:
    """Serve fork requests; returns only in a forked worker (its message). EOF: exit 0."""
    while True:
        body = _read_request(req_fd)
        if body is None:
            raise SystemExit(0)
        if _threads() != 1:
            print(f"mindspeed_ha.forkserver: {_threads()} threads after the imports: not forking "
                  "(the launcher starts this worker as torchrun does)", file=sys.stderr, flush=True)
            spare.write_all(reply_fd, _PID.pack(-1))
            continue
        msg = _fork_worker(body, req_fd, reply_fd)
        if msg is not None:
            return msg


def _retitle(argv: List[str]) -> None:
    """The worker's command line (``/proc/PID/cmdline``, what ``ps`` and psutil show) becomes
    what torchrun would have started, ``python -u -m mindspeed_ha.boot ARGS``, not the fork
    server's (setproctitle rewrites the argv area; the arguments come back separated by
    spaces, which psutil splits again)."""
    import setproctitle

    setproctitle.setproctitle(" ".join([sys.executable, "-u", "-m", spare.BOOT_MODULE, *argv]))


def main() -> None:
    args = sys.argv[1:]
    if len(args) == 4 and args[2] == "--sys-path":
        sys.path.insert(0, args[3])
    elif len(args) != 2:
        raise SystemExit("usage: python -m mindspeed_ha.forkserver REQ_FD REPLY_FD [--sys-path DIR]")
    req_fd, reply_fd = int(args[0]), int(args[1])
    spare.preimport()
    for name in preload_names(os.environ.get(ENV_PRELOAD)):
        try:
            __import__(name)
        except Exception as exc:  # the worker imports it itself (and meets the error there, if it must)
            print(f"mindspeed_ha.forkserver: {ENV_PRELOAD}: {name} not preloaded: {exc!r}", file=sys.stderr,
                  flush=True)
    msg = serve(req_fd, reply_fd)
    _retitle(msg["argv"])
    spare.become(msg)
    from mindspeed_ha import boot

    boot.main()


if __name__ == "__main__":
    main()
