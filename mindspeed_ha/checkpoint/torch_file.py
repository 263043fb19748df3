"""One ``torch.save`` file written in place by several processes, each byte once.

``torch.save`` writes a zip archive (PyTorch's ``PyTorchStreamWriter``, miniz): records
``data.pkl`` (the pickled object, tensors as references to storages), a few small
records, one uncompressed record ``data/<key>`` per storage (64-byte aligned), then the
central directory. Its layout depends only on the object's structure and the storages'
sizes, never on their bytes. So:

1. :func:`plan` runs ``torch.save`` under ``torch.serialization.skip_data()`` (PyTorch's
   own "write everything but the storage bytes" mode, torch >= 2.5; before, the storage
   writes are recognised by their address and skipped) into memory: the *skeleton*
   (every byte but the storages') and where each tensor's bytes go. Its storage bytes
   do not matter: every process that plans the same structure gets the same layout.
2. Each writer opens the same file (no truncation), one of them writes the skeleton
   (:meth:`TorchFileLayout.write_skeleton`), each ``pwrite`` s its ranges of the
   storages (:meth:`TorchFileLayout.storage_offset`) and fsyncs. Nothing is written twice.
3. The storage records' CRC-32 fields (0 in a ``skip_data`` skeleton, as with
   ``torch.serialization.set_crc32_options(False)``; ``torch.load`` does not check
   them) are set afterwards from the writers' per-range CRCs (:func:`crc32_combine`,
   :meth:`TorchFileLayout.patch_crc`), so ``zipfile.testzip`` passes too. :func:`save`
   is the one-writer case (``model_optim_rng.pt``).

Zip facts used (PKWARE APPNOTE.TXT 6.3: local file header 4.3.7, central directory
header 4.3.12, end of central directory 4.3.16, zip64 end record and locator
4.3.14-4.3.15, zip64 extra field 4.5.3).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from mindspeed_ha.errors import TorchFileError

_LOCAL_SIG, _CENTRAL_SIG = 0x04034B50, 0x02014B50
_EOCD_SIG, _ZIP64_EOCD_SIG, _ZIP64_LOCATOR_SIG = 0x06054B50, 0x06064B50, 0x07064B50
_CRC_POLY = 0xEDB88320  # reflected CRC-32 (zlib.crc32)


@dataclass(frozen=True)
class Record:
    """A storage record: ``nbytes`` bytes at ``data_offset``; its CRC-32 fields at
    ``crc_offsets`` (local header, central directory)."""

    name: str
    data_offset: int
    nbytes: int
    crc_offsets: Tuple[int, int]


class _Recorder:
    """A write-only, seekable sink that keeps what is written and skips holes (``skip_data``).

    ``skip``: ``{address: nbytes}`` of storages whose bytes, when ``torch.save`` hands
    them over (one write, from the storage's own memory), are skipped too: the same
    skeleton on a torch without ``skip_data``.
    """

    def __init__(self, skip: Dict[int, int] = None):
        self.pos = 0
        self.size = 0
        self.chunks: List[Tuple[int, bytes]] = []
        self.skip = skip or {}

    def write(self, b) -> int:
        if self.skip:
            view = memoryview(b)
            if view.nbytes and self.skip.get(_address(view)) == view.nbytes:
                self.pos += view.nbytes
                self.size = max(self.size, self.pos)
                return view.nbytes
        b = bytes(b)
        if self.chunks and self.chunks[-1][0] + len(self.chunks[-1][1]) == self.pos:
            off, prev = self.chunks[-1]
            self.chunks[-1] = (off, prev + b)
        else:
            self.chunks.append((self.pos, b))
        self.pos += len(b)
        self.size = max(self.size, self.pos)
        return len(b)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def read_at(self, offset: int, n: int) -> bytes:
        for off, b in self.chunks:
            if off <= offset and offset + n <= off + len(b):
                return b[offset - off:offset - off + n]
        raise TorchFileError(f"zip structure at [{offset}, {offset + n}) is not in the skeleton")


class TorchFileLayout:
    """The skeleton of one ``torch.save`` file and where each planned tensor's bytes go."""

    def __init__(self, recorder: _Recorder, records: Dict[str, Record], tensor_keys: Dict[int, Tuple[str, int]],
                 storages: Dict[str, Any]):
        self.size = recorder.size
        self.chunks = recorder.chunks
        self.records = records
        self.storages = storages  # record key -> the UntypedStorage torch.save writes there
        self._tensor_keys = tensor_keys  # id(tensor) -> (storage key, element offset)

    def storage_offset(self, tensor) -> Tuple[str, int]:
        """``(record name, file offset of element 0)`` of a tensor of the planned object.

        Raises:
            TorchFileError: not a tensor of the planned object.
        """
        try:
            key, elem = self._tensor_keys[id(tensor)]
        except KeyError:
            raise TorchFileError("tensor is not part of the planned object") from None
        rec = self.records[key]
        return key, rec.data_offset + elem * tensor.element_size()

    def write_skeleton(self, fd: int) -> int:
        """Write every byte but the storages' at its place in ``fd``; returns bytes written."""
        for off, b in self.chunks:
            pwrite_all(fd, b, off)
        return sum(len(b) for _, b in self.chunks)

    def patch_crc(self, fd: int, key: str, crc: int) -> None:
        """Set the CRC-32 of record ``key`` (both copies: local header, central directory)."""
        raw = struct.pack("<I", crc & 0xFFFFFFFF)
        for off in self.records[key].crc_offsets:
            pwrite_all(fd, raw, off)


def _address(view: memoryview) -> int:
    import numpy as np

    return np.frombuffer(view.cast("B"), dtype=np.uint8).__array_interface__["data"][0]


def pwrite_all(fd: int, data, offset: int) -> None:
    """``os.pwrite`` all of ``data`` at ``offset`` (a short write is continued)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def plan(obj: Any) -> TorchFileLayout:
    """The layout ``torch.save(obj)`` has, without touching the tensors' bytes.

    The tensors of ``obj`` must be CPU tensors each with its own storage (e.g.
    ``torch.empty``: never read, never written here).

    Raises:
        TorchFileError: the archive does not have the expected structure.
    """
    import torch

    if hasattr(torch.serialization, "skip_data"):
        rec = _Recorder()
        with torch.serialization.skip_data():
            torch.save(obj, rec)
    else:  # torch < 2.5: the same skeleton, storage bytes recognised by their address
        rec = _Recorder({s.data_ptr(): s.nbytes() for s in _storages(obj) if s.device.type == "cpu"})
        torch.save(obj, rec)
    entries = _central_directory(rec)
    prefix = {name.split("/", 1)[0] for name in entries}
    if len(prefix) != 1:
        raise TorchFileError(f"expected one archive directory, found {sorted(prefix)}")
    root = prefix.pop()
    records = {}
    for name, (lho, crc_at, usize) in entries.items():
        if not name.startswith(f"{root}/data/"):
            continue
        head = rec.read_at(lho, 30)
        if struct.unpack_from("<I", head, 0)[0] != _LOCAL_SIG:
            raise TorchFileError(f"{name}: no local file header at {lho}")
        n, e = struct.unpack_from("<HH", head, 26)
        records[name[len(root) + 6:]] = Record(name, lho + 30 + n + e, usize, (lho + 14, crc_at))
    refs = _TensorRefs(io.BytesIO(_record_bytes(rec, entries, f"{root}/data.pkl"))).load()
    tensor_keys, storages = {}, {}
    for tensor, (key, elem) in _pair(obj, refs):
        tensor_keys[id(tensor)] = (key, elem)
        storages[key] = tensor.untyped_storage()
    missing = set(storages) - set(records)
    if missing:
        raise TorchFileError(f"storages {sorted(missing)} have no record")
    return TorchFileLayout(rec, records, tensor_keys, storages)


def _write_with_torch_save(obj: Any, fd: int) -> int:
    import torch

    with os.fdopen(os.dup(fd), "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def save(obj: Any, path: str) -> int:
    """``torch.save(obj, path)`` by one writer, and fsync: the same archive (:func:`plan`),
    each storage written straight from its memory (GPU storages copied to the CPU first)
    with ``pwrite``, its CRC-32 computed on the way (``zlib``). Returns bytes written.

    ``path`` must be new: it is created ``O_EXCL | O_NOFOLLOW``, mode ``0o666`` less the
    umask (what ``torch.save(path)`` gives; :mod:`mindspeed_ha.checkpoint.files`).
    Tensors are found in dicts, lists, tuples and objects' ``__dict__``; if one is
    elsewhere, the file is written by ``torch.save`` itself (same content).

    Raises:
        TorchFileError, OSError (FileExistsError: ``path`` exists).
    """
    import torch

    from mindspeed_ha.checkpoint import files

    layout = plan(obj)
    fd = files.create_new(path)
    if set(layout.storages) != set(layout.records):
        # a tensor inside an object this module does not walk: let torch.save find it
        try:
            return _write_with_torch_save(obj, fd)
        finally:
            os.close(fd)
    try:
        os.ftruncate(fd, layout.size)
        written = layout.write_skeleton(fd)
        for key, storage in layout.storages.items():
            rec = layout.records[key]
            if storage.device.type != "cpu":
                storage = storage.cpu()
            if storage.nbytes() != rec.nbytes:
                raise TorchFileError(f"{rec.name}: storage of {storage.nbytes()} bytes, record of {rec.nbytes}")
            if rec.nbytes:
                data = memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())
                pwrite_all(fd, data, rec.data_offset)
                layout.patch_crc(fd, key, crc32(data))
                written += rec.nbytes
        os.fsync(fd)
    finally:
        os.close(fd)
    return written


def _record_bytes(rec: _Recorder, entries, name: str) -> bytes:
    lho, _, usize = entries[name]
    n, e = struct.unpack_from("<HH", rec.read_at(lho, 30), 26)
    return rec.read_at(lho + 30 + n + e, usize)


def _central_directory(rec: _Recorder) -> Dict[str, Tuple[int, int, int]]:
    """``name -> (local header offset, offset of its CRC field in the central directory,
    uncompressed size)``."""
    last_off, tail = rec.chunks[-1] if rec.chunks else (0, b"")
    if last_off + len(tail) != rec.size:
        raise TorchFileError("the archive does not end with its central directory")
    at = tail.rfind(struct.pack("<I", _EOCD_SIG))  # the directory ends the file, without holes
    if at < 0:
        raise TorchFileError("no end of central directory record")
    eocd = last_off + at
    total, cd_size, cd_off = struct.unpack_from("<HII", tail, at + 10)
    if total == 0xFFFF or 0xFFFFFFFF in (cd_size, cd_off):
        loc = rec.read_at(eocd - 20, 20)
        if struct.unpack_from("<I", loc, 0)[0] != _ZIP64_LOCATOR_SIG:
            raise TorchFileError("zip64 end of central directory locator missing")
        z64_off, = struct.unpack_from("<Q", loc, 8)
        z64 = rec.read_at(z64_off, 56)
        if struct.unpack_from("<I", z64, 0)[0] != _ZIP64_EOCD_SIG:
            raise TorchFileError("zip64 end of central directory record missing")
        total, cd_size, cd_off = struct.unpack_from("<QQQ", z64, 32)
    cd = rec.read_at(cd_off, cd_size)
    out: Dict[str, Tuple[int, int, int]] = {}
    pos = 0
    for _ in range(total):
        if struct.unpack_from("<I", cd, pos)[0] != _CENTRAL_SIG:
            raise TorchFileError(f"bad central directory entry at {cd_off + pos}")
        csize, usize, n, e, c = struct.unpack_from("<IIHHH", cd, pos + 20)
        lho, = struct.unpack_from("<I", cd, pos + 42)
        name = cd[pos + 46:pos + 46 + n].decode()
        if 0xFFFFFFFF in (usize, csize, lho):
            usize, csize, lho = _zip64_fields(cd[pos + 46 + n:pos + 46 + n + e], usize, csize, lho)
        out[name] = (lho, cd_off + pos + 16, usize)
        pos += 46 + n + e + c
    return out


def _zip64_fields(extra: bytes, usize: int, csize: int, lho: int) -> Tuple[int, int, int]:
    """Sizes and local header offset completed from a zip64 extra field (a field is there
    only where the central directory says 0xFFFFFFFF, in this order)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            field = pos + 4
            vals = []
            for v in (usize, csize, lho):
                if v == 0xFFFFFFFF:
                    v, = struct.unpack_from("<Q", extra, field)
                    field += 8
                vals.append(v)
            return vals[0], vals[1], vals[2]
        pos += 4 + size
    raise TorchFileError("zip64 extra field missing")


@dataclass(frozen=True)
class _Ref:
    key: str
    elem: int = 0


class _TensorRefs(pickle.Unpickler):
    """Reads ``data.pkl`` with every tensor replaced by ``_Ref(storage key, element offset)``."""

    def persistent_load(self, pid):
        # ("storage", storage_type, key, location, numel): torch.serialization._save's persistent_id
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise TorchFileError(f"unexpected persistent id {pid!r}")
        return _Ref(str(pid[2]))

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, *_: _Ref(storage.key, offset)
        return super().find_class(module, name)


def _storages(obj):
    """The storages of the tensors in ``obj`` (dicts, lists, tuples, objects' ``__dict__``)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj.untyped_storage()
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _storages(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _storages(v)
    elif isinstance(getattr(obj, "__dict__", None), dict):
        for v in vars(obj).values():
            yield from _storages(v)


def _pair(obj, refs):
    """``(tensor, (storage key, element offset))`` for each tensor of ``obj``."""
    import torch

    if isinstance(obj, torch.Tensor):
        if not isinstance(refs, _Ref):
            raise TorchFileError("pickled structure differs from the object")
        yield obj, (refs.key, refs.elem)
    elif isinstance(obj, dict):
        if not isinstance(refs, dict) or list(refs) != list(obj):
            raise TorchFileError("pickled dict differs from the object")
        for k in obj:
            yield from _pair(obj[k], refs[k])
    elif isinstance(obj, (list, tuple)):
        if not isinstance(refs, (list, tuple)) or len(refs) != len(obj):
            raise TorchFileError("pickled sequence differs from the object")
        for a, b in zip(obj, refs):
            yield from _pair(a, b)
    elif isinstance(getattr(obj, "__dict__", None), dict) and isinstance(getattr(refs, "__dict__", None), dict):
        a, b = vars(obj), vars(refs)
        if list(a) == list(b):
            for k in a:
                yield from _pair(a[k], b[k])


# ---- CRC-32 of a concatenation from the CRCs of its parts ----------------------------
def _gf2_mul(a: int, b: int) -> int:
    """``a * b mod P`` in the reflected CRC-32 representation (bit 31 = x^0)."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1
    return p


def _x_pow_8n(n: int) -> int:
    """``x^(8 n) mod P`` (reflected)."""
    result, power = 1 << 31, 1 << 23  # x^0; x^8 (one byte)
    while n:
        if n & 1:
            result = _gf2_mul(power, result)
        power = _gf2_mul(power, power)
        n >>= 1
    return result


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc1 = zlib.crc32(a)``, ``crc2 = zlib.crc32(b)`` and ``len(b)``.

    CRC-32 is linear over GF(2): appending ``len2`` bytes multiplies the first CRC by
    ``x^(8 len2)`` modulo the polynomial (the pre/post inversions cancel), as zlib's
    ``crc32_combine`` computes it.
    """
    return _gf2_mul(_x_pow_8n(len2), crc1) ^ crc2 if len2 else crc1


def combine_ranges(nbytes: int, ranges: List[Tuple[int, int, int]]) -> int:
    """CRC-32 of a record of ``nbytes`` from ``(offset, length, crc)`` of ranges that must
    tile ``[0, nbytes)`` exactly (any order).

    Raises:
        TorchFileError: a gap or an overlap (a byte written twice or by nobody).
    """
    crc, pos = 0, 0
    for off, length, part in sorted(ranges):
        if off != pos:
            what = "missing" if off > pos else "written twice"
            raise TorchFileError(f"bytes [{min(off, pos)}, {max(off, pos)}) {what}")
        crc = crc32_combine(crc, part, length)
        pos += length
    if pos != nbytes:
        raise TorchFileError(f"bytes [{pos}, {nbytes}) missing")
    return crc


def crc32(data) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF
