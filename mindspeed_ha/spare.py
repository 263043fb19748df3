"""A warm spare worker (``MINDSPEED_HA_WARM_SPARES=1`` with ``--enable-worker-reboot``).

``python -u -m mindspeed_ha.spare [--sys-path DIR]`` imports what is heavy and the same
for every rank (torch, torch.distributed, megatron.core when installed, mindspeed_ha and
the patches its post-import hooks apply to them), but not the user's script (it may read
its arguments at import), then parks: it blocks reading ONE message from stdin, sent by
:class:`mindspeed_ha.agent.WorkerRebootAgent` when a worker died:

* 4 bytes, big-endian unsigned: the length of the body (at most :data:`MAX_MESSAGE_BYTES`);
* the body, UTF-8 JSON (no pickle): ``{"v": 1, "argv": [...], "env": {...}, "stdout":
  path, "stderr": path}``; ``argv`` is what follows ``python -m mindspeed_ha.boot`` in the
  dead worker's command line; ``env`` is the whole environment of the new worker; a path
  ``""`` keeps the stream the spare inherited from the agent (the console).

On it the spare becomes that worker: ``os.environ`` is replaced by ``env``, fd 1 and 2
are redirected to the files (``os.dup2``, appended to: the agent created them; line
buffered), ``sys.argv`` is set and :func:`mindspeed_ha.boot.main` runs, as in a worker
that ``python -m mindspeed_ha.boot`` started. EOF on stdin before a whole message (the
agent ended or let it go) ends it with exit 0 and no output; a malformed message ends it
with exit 2 and one line on stderr.

``--sys-path DIR`` puts DIR first on ``sys.path`` before the imports, as ``boot`` does for
a script (its directory): a Megatron-LM tree's ``megatron/core`` then wins over an
installed megatron-core exactly as in a worker (``megatron`` is a namespace package).

Limit: environment variables read at import time (by torch, megatron.core) are the
agent's, not the worker's (e.g. a per-rank ``CUDA_VISIBLE_DEVICES`` is not supported);
torchrun's workers differ from the agent only by the ``RANK``/``LOCAL_RANK``/
``TORCHELASTIC_*`` family, which nothing reads at import. mindspeed-ha's own import-time
switches (``MINDSPEED_HA_INJECT``, ``MINDSPEED_HA_LOSS_LOG``, ``MINDSPEED_HA_PATCH_REPORT``,
``MINDSPEED_HA_CPU_BACKEND``: ``patches.testing.autoenable``, ``patches.cpu_backend.autoenable``)
are evaluated again under the worker's env.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Any, Dict, List, Optional

#: the module a worker of ``mindspeed-ha-run`` runs (``python -u -m mindspeed_ha.boot SCRIPT ARGS``)
BOOT_MODULE = "mindspeed_ha.boot"
#: message format version
VERSION = 1
#: largest message body accepted, bytes (argv + env of one worker)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")


def encode(argv, env: Dict[str, str], stdout: str, stderr: str) -> bytes:
    """The message that makes a spare the worker with ``argv`` (after ``-m mindspeed_ha.boot``),
    ``env`` (complete) and log files ``stdout``/``stderr`` (``""``: inherited stream).

    Raises:
        ValueError: the body is larger than :data:`MAX_MESSAGE_BYTES`.
    """
    body = json.dumps({"v": VERSION, "argv": [str(a) for a in argv], "env": {str(k): str(v) for k, v in env.items()},
                       "stdout": stdout or "", "stderr": stderr or ""}).encode("utf-8")
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError(f"warm spare message of {len(body)} bytes: at most {MAX_MESSAGE_BYTES}")
    return _HEADER.pack(len(body)) + body


def worker_message(argv, env: Dict[str, str], stdout: str, stderr: str) -> bytes:
    """:func:`encode` for the worker a spare or the fork server becomes: the log files are
    created (emptied) here, as torch's ``SubprocessHandler`` opens them, and the env is the
    caller's plus the worker's part (what that handler gives a worker).

    Raises:
        ValueError: the message is too large (:func:`encode`).
        OSError: a log file cannot be created.
    """
    for path in (stdout, stderr):
        if path and path != os.devnull:
            open(path, "w").close()
    full_env = os.environ.copy()
    full_env.update(env)
    return encode(argv, full_env, stdout or "", stderr or "")


def write_all(fd: int, data: bytes) -> None:
    """Every byte of ``data`` to ``fd`` (a pipe may take less per write)."""
    while data:
        data = data[os.write(fd, data):]


def read_exact(fd: int, n: int) -> Optional[bytes]:
    """``n`` bytes from ``fd``, or None on EOF before them."""
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def decode(body: bytes) -> Dict[str, Any]:
    """The checked message. Raises ValueError when it is not a version-1 message."""
    msg = json.loads(body.decode("utf-8"))
    if not isinstance(msg, dict) or msg.get("v") != VERSION:
        raise ValueError(f"unsupported warm spare message version {msg.get('v') if isinstance(msg, dict) else None!r}")
    argv, env = msg.get("argv"), msg.get("env")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ValueError("argv: expected a non-empty list of strings")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("env: expected an object of strings")
    for key in ("stdout", "stderr"):
        if not isinstance(msg.get(key), str):
            raise ValueError(f"{key}: expected a path string")
    return msg


def preimport() -> None:
    """Import what every rank imports the same way (torch, torch.distributed, mindspeed_ha
    and its post-import hooks, megatron.core when installed), not the user's script."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import mindspeed_ha  # noqa: F401  (post-import hooks: the patches apply as megatron.core loads)

    try:
        import megatron.core  # noqa: F401
        import megatron.core.parallel_state  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401
    except ImportError:  # a worker without megatron-core: nothing more to warm
        pass


def boot_argv(entrypoint: Any, args: tuple) -> Optional[List[str]]:
    """What follows ``-m mindspeed_ha.boot`` in a worker's command line ``entrypoint args``,
    or None when the worker is not ``python [-u] -m mindspeed_ha.boot ...`` (no spare can
    become it)."""
    if not isinstance(entrypoint, str):
        return None
    args = tuple(str(a) for a in args)
    for flags in (("-u",), ()):
        head = (*flags, "-m", BOOT_MODULE)
        if args[:len(head)] == head and len(args) > len(head):
            return list(args[len(head):])
    return None


def _redirect(fd: int, path: str, stream) -> None:
    if not path:
        return
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    stream.flush()
    os.dup2(target, fd)
    os.close(target)
    stream.reconfigure(line_buffering=True)


def become(msg: Dict[str, Any]) -> None:
    """This process becomes the worker of ``msg`` (:func:`decode`): its env, its log files on
    fd 1 and 2, mindspeed-ha's import-time switches read again, ``sys.argv`` for
    :func:`mindspeed_ha.boot.main`."""
    os.environ.clear()
    os.environ.update(msg["env"])
    _redirect(1, msg["stdout"], sys.stdout)
    _redirect(2, msg["stderr"], sys.stderr)
    from mindspeed_ha.patches.cpu_backend import autoenable as cpu_backend_autoenable
    from mindspeed_ha.patches.testing import autoenable as testing_autoenable

    testing_autoenable()  # import-time switches, read again under the worker's env
    cpu_backend_autoenable()
    sys.argv = ["mindspeed_ha.boot", *msg["argv"]]


def main() -> None:
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "--sys-path":
        sys.path.insert(0, args[1])
    elif args:
        raise SystemExit("usage: python -m mindspeed_ha.spare [--sys-path DIR]")
    preimport()
    header = read_exact(0, _HEADER.size)
    if header is None:
        raise SystemExit(0)
    (size,) = _HEADER.unpack(header)
    if size > MAX_MESSAGE_BYTES:
        print(f"mindspeed_ha.spare: message of {size} bytes: at most {MAX_MESSAGE_BYTES}", file=sys.stderr)
        raise SystemExit(2)
    body = read_exact(0, size)
    if body is None:
        raise SystemExit(0)
    try:
        msg = decode(body)
    except ValueError as exc:
        print(f"mindspeed_ha.spare: {exc}", file=sys.stderr)
        raise SystemExit(2)
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # fd 0 again, as a worker's stdin would be
    become(msg)
    from mindspeed_ha import boot

    boot.main()


if __name__ == "__main__":
    main()
