"""Creating the files of a checkpoint: new names only, never through a link, the user's umask.

``<save>`` may be shared (a group's project directory), so every file the dying
checkpoint creates is opened ``O_CREAT | O_EXCL | O_NOFOLLOW`` at a name nobody can
guess in advance (:func:`temp_name`): a file or symbolic link planted at that name makes
the open fail instead of writing through it. Modes are what Megatron-LM's own writes get
(``torch.save(path)`` and the tracker's ``open(path, "w")``): ``0o666`` and directories
``0o777``, less the user's umask. Imports nothing but the standard library.
"""

from __future__ import annotations

import os
import secrets
import threading
from contextlib import contextmanager
from typing import Iterator, List

#: the mode Megatron-LM's files get before the umask (Python's ``open(path, "w")``)
FILE_MODE = 0o666
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
#: open flags of an existing file we write (never through a link)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def temp_name(path: str) -> str:
    """A hidden name beside ``path`` that nobody can predict (pid and 64 random bits)."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}.{secrets.token_hex(8)}.tmp")


def create_new(path: str, mode: int = FILE_MODE) -> int:
    """Open a new file for writing: ``O_EXCL | O_NOFOLLOW``, ``mode`` less the umask.

    Raises:
        FileExistsError: something (a file, a link) is there already.
    """
    return os.open(path, _NEW, mode)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, data: bytes, fsync: bool = True) -> None:
    """``path`` replaced by a file holding ``data``: written at a :func:`temp_name`
    (:func:`create_new`), fsynced, renamed over ``path`` (the directory is not fsynced).

    Raises:
        OSError: the write failed (the temporary file is removed).
    """
    tmp = temp_name(path)
    fd = create_new(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class BackgroundFsync:
    """Called like ``os.fsync(fd)``, but the fsync runs in a thread on a duplicate of ``fd``
    (``fd`` may be closed meanwhile): the disk's wait overlaps the caller's next writes
    (fsync releases the GIL). Nothing is durable before :meth:`wait` returns."""

    def __init__(self):
        self._threads: List[threading.Thread] = []
        self._errors: List[BaseException] = []

    def __call__(self, fd: int) -> None:
        dup = os.dup(fd)
        t = threading.Thread(target=self._run, args=(dup,), name="mindspeed-ha-fsync", daemon=True)
        self._threads.append(t)
        t.start()

    def _run(self, fd: int) -> None:
        try:
            os.fsync(fd)
        except BaseException as exc:  # re-raised by wait()
            self._errors.append(exc)
        finally:
            os.close(fd)

    def wait(self) -> None:
        """Join every fsync started.

        Raises:
            OSError: the first fsync that failed.
        """
        for t in self._threads:
            t.join()
        self._threads = []
        if self._errors:
            raise self._errors[0]


@contextmanager
def fsync_in_background() -> Iterator[BackgroundFsync]:
    """A :class:`BackgroundFsync` whose fsyncs are all joined when the block ends (their
    error raised then); on an error inside the block they are joined too, that error wins."""
    bg = BackgroundFsync()
    try:
        yield bg
    except BaseException:
        try:
            bg.wait()
        except OSError:
            pass  # the block's own error is the one to report
        raise
    bg.wait()
