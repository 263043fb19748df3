"""Files on the shared filesystem that only the job can write: sealed with the job's key.

The lease directory (terms, lease counters, roster, the ranks' start-up records) lives on
the checkpoint filesystem, which other users of a shared cluster may also reach. Every
file there is *sealed*: its first line is the hex HMAC-SHA256, keyed with the job's auth
key (the key that already authenticates the control wire, :mod:`wire`), over a label,
the file's name and its payload::

    <64 hex digits>\\n<payload>
    mac = HMAC-SHA256(auth_key, b"mindspeed-ha/sealed/v1\\0" + name + b"\\0" + payload)

The name is inside the MAC, so a sealed file copied to another name (``term-1.json`` as
``term-9.json``, a counter as a term) does not verify. A reader treats a file that does
not verify, is not a regular file, is a symbolic link or is oversized as absent (its
owner logs it once); nothing read from the directory can raise past the reader.

Writes are safe against a stranger who can create names in the directory's parent: the
directory is made ``0700`` and must be a real directory owned by this user
(:func:`private_dir`); a file is written under a random temporary name created with
``O_CREAT | O_EXCL | O_NOFOLLOW`` (mode ``0600``: no symbolic link is followed, no
existing file is reused), fsynced, then linked (exclusive create, :func:`write`
``exclusive=True``) or renamed (replace) to its name. ``rename(2)`` and ``link(2)`` never
follow a symbolic link at the destination.

Sources: HMAC (RFC 2104); ``O_NOFOLLOW``, ``O_EXCL``, ``link(2)``, ``rename(2)``: the Linux
man pages (open(2): "If the trailing component ... of pathname is a symbolic link, then
the open fails").
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets
import stat
from typing import Optional

from mindspeed_ha.errors import HAError

log = logging.getLogger("mindspeed_ha.control.lease")

_LABEL = b"mindspeed-ha/sealed/v1\0"
_MAC_HEX = 64
#: default largest file read back, bytes
MAX_FILE_BYTES = 16 << 20


class SealError(HAError, ValueError):
    """A file that is not sealed with the job's key (forged, damaged, another job's)."""


def _mac(key: bytes, name: str, payload: bytes) -> bytes:
    return hmac.new(key, _LABEL + name.encode() + b"\0" + payload, hashlib.sha256).hexdigest().encode()


def seal(key: bytes, name: str, payload: bytes) -> bytes:
    """``payload`` with its MAC line for the file ``name`` (a base name)."""
    return _mac(key, name, payload) + b"\n" + payload


def unseal(key: bytes, name: str, data: bytes) -> bytes:
    """The payload of the sealed file ``name``.

    Raises:
        SealError: no MAC line, or the MAC does not match (not written with ``key`` under ``name``).
    """
    mac, sep, payload = data.partition(b"\n")
    if not sep or len(mac) != _MAC_HEX:
        raise SealError(f"{name}: not a sealed file (no MAC line)")
    if not hmac.compare_digest(mac, _mac(key, name, payload)):
        raise SealError(f"{name}: its MAC does not match the job's key (forged, damaged or another job's)")
    return payload


def private_dir(path: str) -> None:
    """Make ``path`` (and missing parents) a directory only this user can use: created
    ``0700``; an existing one must be a real directory (not a symbolic link) owned by
    this user, and is set to ``0700`` if it was more open (logged).

    Raises:
        PermissionError: ``path`` is a symbolic link, not a directory, or another user's.
        OSError: the filesystem's errors.
    """
    parent = os.path.dirname(os.path.abspath(path))
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(errno.EPERM, "not a directory (a symbolic link or a file): refused", path)
    if st.st_uid != os.geteuid():
        raise PermissionError(errno.EPERM, f"owned by uid {st.st_uid}, not this user ({os.geteuid()}): refused",
                              path)
    if stat.S_IMODE(st.st_mode) & 0o077:
        log.warning("lease directory %s had mode %o: set to 0700 (only this user may write it)", path,
                    stat.S_IMODE(st.st_mode))
        os.chmod(path, 0o700)


def write(directory: str, name: str, data: bytes, *, exclusive: bool = False) -> bool:
    """Write ``data`` as ``directory/name`` whole (temporary name, fsync, then link or rename).

    Args:
        exclusive: create only if ``name`` does not exist (``link(2)``, atomic also on NFS).

    Returns:
        False if ``exclusive`` and the name exists, else True.

    Raises:
        OSError: the filesystem's errors (the temporary file is removed).
    """
    tmp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        final = os.path.join(directory, name)
        if not exclusive:
            os.replace(tmp, final)
            tmp = ""
            return True
        try:
            os.link(tmp, final)
            return True
        except FileExistsError:
            return False
    finally:
        if tmp:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def read(path: str, limit: int = MAX_FILE_BYTES) -> Optional[bytes]:
    """The bytes of the regular file ``path``, or None if it does not exist.

    Raises:
        SealError: a symbolic link, not a regular file, or over ``limit`` bytes.
        OSError: the filesystem's other errors.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SealError(f"{os.path.basename(path)}: a symbolic link, not ours") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SealError(f"{os.path.basename(path)}: not a regular file")
        if st.st_size > limit:
            raise SealError(f"{os.path.basename(path)}: {st.st_size} bytes, over the limit of {limit}")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise SealError(f"{os.path.basename(path)}: over the limit of {limit} bytes")
        return data
    finally:
        os.close(fd)


def read_sealed(key: bytes, directory: str, name: str, limit: int = MAX_FILE_BYTES) -> Optional[bytes]:
    """The payload of the sealed file ``directory/name``, or None if it does not exist.

    Raises:
        SealError: see :func:`read` and :func:`unseal`.
        OSError: the filesystem's other errors.
    """
    data = read(os.path.join(directory, name), limit)
    return None if data is None else unseal(key, name, data)


def write_sealed(key: bytes, directory: str, name: str, payload: bytes, *, exclusive: bool = False) -> bool:
    """:func:`write` of ``payload`` sealed with ``key`` (see :func:`write` for the result and errors)."""
    return write(directory, name, seal(key, name, payload), exclusive=exclusive)


__all__ = ["MAX_FILE_BYTES", "SealError", "private_dir", "read", "read_sealed", "seal", "unseal", "write",
           "write_sealed"]
