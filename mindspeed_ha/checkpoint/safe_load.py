"""Read checkpoint files without running code from them: what validation and the commit read.

A checkpoint directory in ``--save`` can be written by anyone who can write there, so
nothing here unpickles with Python's or torch's full unpickler (``pickle.load``,
``torch.load(weights_only=False)``: a pickle can name and call any function). Instead:

* :class:`SafeUnpickler` builds real objects only for the plain containers pickle makes
  itself (dict, list, tuple, str, numbers) and for an allow-list of harmless types
  (``collections.OrderedDict``, ``torch.Size``, torch dtypes / layouts / memory formats,
  the dataclasses of PyTorch Distributed Checkpoint's ``.metadata``). Every other name
  the pickle refers to (``argparse.Namespace`` of Megatron's ``args``, numpy arrays of the
  RNG state, a function) becomes an :class:`Inert` object that records its arguments and
  state and is never imported or called; :func:`field` reads a field from either.
* :func:`read_torch_file` reads a ``torch.save`` archive (zip, PKWARE APPNOTE 6.3) from
  its central directory, ``data.pkl`` through :class:`SafeUnpickler`, and checks that
  every storage the pickle refers to has its record, of the right size, inside the file
  (what ``torch.load(mmap=True)`` checks) without reading a tensor byte.

``torch.load(weights_only=True)`` is not enough for Megatron-LM checkpoints: ``args`` is
an ``argparse.Namespace`` holding enums and classes of megatron-core, and an allow-list
of them would have to follow every Megatron release; here they are never needed (a
validator reads a few integers of ``args``).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from typing import Any, Dict, List, Optional, Tuple

from mindspeed_ha.errors import CheckpointError

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # APPNOTE 4.3.7, 30 bytes
_LOCAL_SIG = 0x04034B50


class Inert:
    """An object a pickle named (``module.name``) that was neither imported nor called.

    Attributes:
        args: the arguments it was called (``REDUCE``) or created (``NEWOBJ``) with.
        state: what ``BUILD`` set (usually the instance ``__dict__``).
        items / list: what ``SETITEMS`` / ``APPENDS`` / ``ADDITEMS`` added (dict, list or
            set subclasses).
    """

    global_name: Tuple[str, str] = ("", "")

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.state, obj.items, obj.list = args, None, {}, []
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __setitem__(self, key, value):
        self.items[key] = value

    def append(self, value):
        self.list.append(value)

    def extend(self, values):
        self.list.extend(values)

    def add(self, value):
        self.list.append(value)

    def __repr__(self) -> str:
        return f"<inert {'.'.join(self.global_name)}>"


def field(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.name`` of a real object, or the ``name`` entry of an :class:`Inert` one's
    state (``__dict__``, or the dict of a ``(dict, slots)`` state); ``default`` if absent."""
    if isinstance(obj, Inert):
        state = obj.state
        if isinstance(state, tuple) and len(state) == 2:
            state = {**(state[0] or {}), **(state[1] or {})}
        return state.get(name, default) if isinstance(state, dict) else default
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _allowed() -> Dict[Tuple[str, str], Any]:
    """The globals a pickle may name that are built for real (each harmless to create)."""
    import collections

    import torch
    import torch.serialization

    out: Dict[Tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice,
        ("builtins", "complex"): complex,  # not bytearray: bytearray(n) allocates n bytes
        ("torch", "Size"): torch.Size,
    }
    if hasattr(torch.serialization, "_get_layout"):  # a dict look-up of torch's layouts by name
        out[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    try:
        from torch.distributed.checkpoint import filesystem, metadata
    except ImportError:  # a torch built without torch.distributed: no DCP metadata to read
        filesystem = metadata = None
    if metadata is not None:
        out[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
        for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"):
            if hasattr(metadata, name):
                out[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    for name, value in vars(torch).items():  # vars(): never torch's lazy module __getattr__
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            out[("torch", name)] = value
    return out


_ALLOWED: Optional[Dict[Tuple[str, str], Any]] = None


class SafeUnpickler(pickle.Unpickler):
    """Unpickles without importing or calling anything outside the allow-list (see the module).

    ``persistent_load`` records each persistent id (``torch.save``'s storages) in
    :attr:`storages` and returns an :class:`Inert` in its place.
    """

    def __init__(self, file):
        super().__init__(file)
        global _ALLOWED
        if _ALLOWED is None:
            _ALLOWED = _allowed()
        self._stubs: Dict[Tuple[str, str], type] = {}
        self.storages: List[Tuple[Any, ...]] = []

    def find_class(self, module, name):
        real = _ALLOWED.get((module, name))
        if real is not None:
            return real
        stub = self._stubs.get((module, name))
        if stub is None:
            stub = self._stubs[(module, name)] = type(str(name), (Inert,), {"global_name": (module, name)})
        return stub

    def persistent_load(self, pid):
        if not isinstance(pid, tuple):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        self.storages.append(pid)
        return Inert(*pid)


def loads(data: bytes) -> Any:
    """Unpickle ``data`` with :class:`SafeUnpickler`.

    Raises:
        CheckpointError: not a pickle, or a truncated one.
    """
    try:
        return SafeUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is an unreadable file
        raise CheckpointError(f"unreadable pickle: {exc}") from exc


def _storage_itemsize(storage_type: Any) -> int:
    """Bytes per element of a ``torch.<X>Storage`` named in a persistent id (1: untyped)."""
    import torch

    module, name = getattr(storage_type, "global_name", ("", ""))
    if module != "torch" or not name.endswith("Storage"):
        raise CheckpointError(f"unexpected storage type {module}.{name}")
    if name == "UntypedStorage":
        return 1
    cls = vars(torch).get(name)
    dtype = getattr(cls, "_dtype", None) or getattr(cls, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown storage type torch.{name}")
    return dtype.itemsize


def read_torch_file(path: str) -> Any:
    """The object a ``torch.save`` file holds, read safely, tensors left as :class:`Inert`.

    Reads the zip's central directory, ``data.pkl`` and one local header per storage
    record: never a tensor byte, never code from the file (``O_NOFOLLOW``: a link is
    refused).

    Raises:
        CheckpointError: not a zip ``torch.save`` archive, an unreadable ``data.pkl``, or a
            storage whose record is missing, of another size or past the end of the file.
        OSError: the file cannot be opened or read (EACCES, EIO...).
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            infos = {i.filename: i for i in zipfile.ZipFile(f).infolist()}
        except zipfile.BadZipFile as exc:
            raise CheckpointError(f"{path}: not a complete torch.save archive ({exc})") from exc
        pkl = [n for n in infos if n.endswith("data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise CheckpointError(f"{path}: {len(pkl)} data.pkl records, expected 1")
        prefix = pkl[0][:-len("data.pkl")]
        unpickler = SafeUnpickler(io.BytesIO(_record(f, infos[pkl[0]], size, path)))
        try:
            obj = unpickler.load()
        except Exception as exc:  # noqa: BLE001 - any malformed pickle is an unreadable file
            raise CheckpointError(f"{path}: unreadable data.pkl: {exc}") from exc
        for pid in unpickler.storages:
            if len(pid) < 5 or pid[0] != "storage":
                raise CheckpointError(f"{path}: unexpected persistent id {pid!r}")
            _, stype, key, _, numel = pid[:5]
            info = infos.get(f"{prefix}data/{key}")
            if info is None:
                raise CheckpointError(f"{path}: storage record data/{key} missing")
            want = int(numel) * _storage_itemsize(stype)
            if info.file_size != want:
                raise CheckpointError(f"{path}: data/{key} holds {info.file_size} bytes, expected {want}")
            _data_offset(f, info, size, path)
    return obj


def _data_offset(f, info: zipfile.ZipInfo, size: int, path: str) -> int:
    """Offset of a stored record's bytes, checked to lie inside the file."""
    f.seek(info.header_offset)
    head = f.read(_LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(head)[0] != _LOCAL_SIG:
        raise CheckpointError(f"{path}: {info.filename}: no local header at {info.header_offset}")
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointError(f"{path}: {info.filename}: compressed (torch.save stores records)")
    n, e = _LOCAL_HEADER.unpack(head)[-2:]
    start = info.header_offset + _LOCAL_HEADER.size + n + e
    if start + info.file_size > size:
        raise CheckpointError(f"{path}: {info.filename} ends at {start + info.file_size}, past the end ({size})")
    return start


def _record(f, info: zipfile.ZipInfo, size: int, path: str) -> bytes:
    start = _data_offset(f, info, size, path)
    f.seek(start)
    data = f.read(info.file_size)
    if len(data) != info.file_size:
        raise CheckpointError(f"{path}: {info.filename} truncated")
    return data


def read_pickle_file(path: str, limit: int = 1 << 30) -> Any:
    """A plain pickle file (DCP's ``.metadata``) read with :class:`SafeUnpickler`.

    Raises:
        CheckpointError: unreadable, or larger than ``limit`` bytes.
        OSError: the file cannot be opened or read.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path}: larger than {limit} bytes")
    try:
        return loads(data)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
