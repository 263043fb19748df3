"""A restarted worker rejoins a running job: its start-up collectives are replayed, not run.

Why: with worker reboot, a dead rank's process is started again (``MINDSPEED_HA_INCARNATION
= n >= 1``, ``mindspeed_ha.agent``) while the survivors stay alive, parked by the controller.
The new process runs the normal Megatron start-up, which performs collectives (barriers,
broadcasts of data-loader flags, ``Timer.start(barrier=True)``, the runtime's auth-key
broadcast...) and creates every process group (gloo's full-mesh connect needs every member):
the survivors do neither again, so the new process would hang. After the start-up, every rank
(survivors and the new one) builds a new generation of every group
(:func:`mindspeed_ha.recovery.groups.rebuild_process_groups`) and the new one is repaired
from a replica.

How:

* Recording (incarnation 0, feature ``ha`` on): from ``init_process_group`` (the creation of
  the default group, patch ``ha.rejoin.group_helper``) until :func:`startup_done`, every
  ``torch.distributed`` communication function patched by ``patches/comm.py`` that the
  recording thread (the one that called ``init_process_group``) calls records, in call order:
  the op name, the group's torch name and ranks, and the outputs the caller reads afterwards
  (dtype, shape, bytes): all_reduce / broadcast / reduce / scatter: the tensor after;
  all_gather, all_to_all: the output list; all_gather_into_tensor, _all_gather_base,
  reduce_scatter(_tensor), _reduce_scatter_base, all_to_all_single: the output tensor;
  gather: the gather list (none on a non-destination rank); irecv (so ``recv``): the tensor;
  batch_isend_irecv: every irecv's tensor; barrier, isend (so ``send``): nothing. An op
  launched asynchronously is recorded at the next recorded op of the thread once its work
  reports completion, else at :func:`startup_done` (the returned work is not wrapped: the
  caller's handle types stay torch's/comm's; a buffer changed between its wait and that point
  is recorded as changed -- Megatron's start-up makes no async call). Torch's object
  collectives are recorded as the tensor ops they call. Ops on a group this rank is not a
  member of, and calls from other threads, are not recorded. At :func:`startup_done` the
  record is written as ONE msgpack blob (:mod:`~mindspeed_ha.recovery.startup_blob`, no
  pickle) into the default store
  (torchrun's TCPStore, ``distributed_c10d._get_default_store()``) under
  ``mindspeed_ha/startup/<rank>`` (:data:`KEY`). A record over :data:`MAX_BLOB_BYTES` is
  written as a ``too_big`` marker (recording stops copying once past the limit, so memory
  stays bounded); one that saw an op it cannot replay (``_coalescing_manager``) as an
  ``unsupported`` marker; a rejoin refuses both with a clear error.
* Replay (incarnation >= 1): every process group created before :func:`startup_done`
  (``init_process_group``, ``new_group``) uses the backend :data:`BACKEND` (``ha_deferred``,
  :mod:`~mindspeed_ha.recovery.deferred`, registered with
  ``torch.distributed.Backend.register_backend``): a Python
  ``ProcessGroup`` that connects to nobody and refuses every op. The backend and timeout
  asked for are kept per group name in ``deferred.INTENDED_BACKENDS``, so
  ``rebuild_process_groups`` creates the real group (same name root, same ranks). Every
  collective of the start-up is served from the blob of this rank (read from the store at
  the first op; checked: op, group name, ranks, output count, dtypes and shapes equal, else
  :class:`RejoinMismatch` naming the call index and both sides), writing the recorded bytes
  into the caller's output tensors, without communicating; an async call returns a
  completed ``Work`` (its ``_source_rank()`` is not known: a ``recv`` from any source,
  ``src=None``, is not replayable). An output recorded without data (over :data:`MAX_OUTPUT_BYTES`) is left
  as the new process computed it and listed by :func:`omitted`. The replay ends at
  :func:`startup_done`, which raises if recorded ops were left unserved; an op past the end
  of the record raises too.

What the runtime must call (API):

* nothing to start: the group-creation patch starts recording or replay when
  ``init_process_group`` creates the default group with ``ha`` on;
* in a restarted process, in the middle of its start-up (right after
  ``setup_model_and_optimizer``, patches ``ha.rejoin.setup.*``:
  ``HARuntime.rejoin_after_setup``), the rejoin protocol inside :func:`live` (its own
  communication is real): every rank, survivors included,
  ``groups.rebuild_process_groups(generation)`` (the new process's deferred groups become
  the real ones there), then the repair from a replica, which must overwrite every tensor
  :func:`omitted` lists (model parameters). The rest of the start-up is replayed on the
  rebuilt groups (their ``.ha<n>`` suffix is ignored when compared with the record).
  Until the rebuild, any op on a deferred group raises :class:`RejoinError` (never
  hangs): the processor thread of the new process must not use the runtime's fallback
  group before it. Known gap: the runtime passes its controller-lost fallback group in
  ``exclude`` on every rebuild, a rejoin's included, because the processor thread may be
  using it; after a rejoin that group therefore stays deferred in the new process (its
  ops raise :class:`RejoinError`) and still has the dead process as a member on the
  survivors, so deciding without the controller over it fails after a rejoin;
* :func:`startup_done` on the training thread when the first ``train_step`` is entered
  (``HARuntime.enter_iteration``), before any collective of the step or of the runtime
  (pause point, commit barrier); later calls return None and do nothing. Every incarnation
  calls it (incarnation 0 writes the record; a later one ends its replay, after which
  :func:`rejoined` is True).

Tests and tools: :func:`begin` / :func:`reset`, :func:`mode`, :func:`load`, :func:`decode`.

Modules: this one holds the state and the record / replay of each op;
:mod:`~mindspeed_ha.recovery.startup_ops` describes one op (outputs, group, call site);
:mod:`~mindspeed_ha.recovery.startup_blob` is the blob's format, store key and lease copy;
:mod:`~mindspeed_ha.recovery.deferred` the peer-less groups. The names of the last two
that callers use are re-exported here.

Cost: with HA off nothing changes (the comm layer is gated); with HA on and not recording,
one global load per collective (``patches.comm.RECORDER is None``); while recording, a copy
of each start-up output to host memory.

Megatron-LM core_v0.12.1 start-up collectives, MEASURED (stock ``pretrain_gpt.py``, unmodified,
4 ranks on gloo under ``mindspeed-ha-run`` with ``--enable-high-availability``, the flags of
``mindspeed_ha.testing.megatron_lm.stock_gpt_args``: mock data, distributed optimizer, no
``--load``; the record of each rank decoded at its first ``train_step``; call sites as this
module records them, Megatron-LM's ``megatron/`` tree). In call order, on WORLD unless said:

 #  op                      output            call site
 0  all_gather              int64[1] x4       mindspeed-ha patches/replica.py:61 (after
                                              ``initialize_model_parallel``, initialize.py:341)
 1  barrier                 -                 training/initialize.py:219 ``_compile_dependencies``
 2  barrier                 -                 training/initialize.py:227 ``_compile_dependencies``
 3  all_reduce (MIN)        float64[1]        training/training.py:698 ``start_time_tensor``
 4  barrier                 -                 training.py:127 ``print_datetime``
 5  barrier                 -                 core/timers.py:135 (``model-and-optimizer-setup``
                                              ``.start(barrier=True)``, training.py:744)
 (PP > 1 only) all_reduce on the embedding group  float32[padded vocab, hidden]
                                              core/models/common/language_module/
                                              language_module.py:165
                                              ``setup_embeddings_and_output_layer``
 6  barrier                 -                 training.py:127 ``print_datetime``
 7  barrier                 -                 timers.py:135 (``train/valid/test-data-iterators-setup``)
 8-10 barrier x3            -                 core/datasets/blended_megatron_dataset_builder.py:540
                                              ``build_generic_dataset`` (one per split)
 11 broadcast (src 0)       int64[3]          training.py:2396 do_train/valid/test flags
 12 barrier                 -                 training.py:127 ``print_datetime``
 13 barrier                 -                 timers.py:262 (``timers.log(..., barrier=True)``,
                                              training.py:786)
 14 all_gather_into_tensor  float32[8]        timers.py:284 ``_get_elapsed_time_all_ranks``
                                              (2 timers x 4 ranks)
 15 barrier                 -                 timers.py:135 (``interval-time``, training.py:1864)
 16 barrier                 -                 training.py:127 ``print_datetime`` (l.1865)

Blob per rank: TP2 PP1 DP2 17 ops, 2,631-2,658 bytes; TP1 PP2 DP2 18 ops, 2,770 bytes (with
the embedding all_reduce's data kept it was 1,084,118 bytes: 4224 x 64 fp32 = 1,081,344 of
them, which is why outputs over :data:`MAX_OUTPUT_BYTES` are recorded without data; at real
sizes, e.g. vocab 128k x hidden 8k bf16, it would be 2 GB). The built-in Megatron-shaped
trainer (``mindspeed_ha.testing.trainer``, ``tiny_gpt_args``): TP2 3 ops (rows 0, the corpus
barrier of ``trainer/data.py``, one dataset barrier), 636 bytes; PP2 4 ops (plus the embedding
all_reduce, 384 x 64 fp32, kept), 99,050 bytes.

Exact? Every recorded output is replayed byte for byte, and that is the right value for the
new process in every row: the barriers carry nothing; the flags (11), the replica patch's
exchange (0) and the timer all_gather (14) are what the survivors saw and still act on; the
start-time MIN (3) only feeds a print. The exception is the embedding all_reduce (PP > 1):
it is model state (the last stage's output layer made equal to the first stage's
embedding), not replayed (:func:`omitted`), so the new process keeps its own freshly
initialised copy and the repair from a replica must overwrite it, as it does every
parameter. With ``--load`` the list gains the load's timer barriers and gather
(training.py:1163-1169) and one ``load_checkpoint`` entry in place of the load's own
collectives (:func:`load_section`: a restarted process does not load, so ``--load`` =
``--save`` with periodic checkpoints written since its first start is replayable). Not
measured here: ``--tp-comm-overlap``, the NCCL/HCCL path, and MindSpeed-LLM's start-up. The
list changes with the flags (e.g. the number of dataset splits), never between two
incarnations of one job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import List, Optional

from mindspeed_ha import env as ha_env
from mindspeed_ha.errors import RejoinError, RejoinMismatch
from mindspeed_ha.recovery import deferred, startup_blob, startup_ops
from mindspeed_ha.recovery.deferred import BACKEND, register_backend
from mindspeed_ha.recovery.startup_blob import FORMAT, KEY, VERSION, decode, encode, load

__all__ = [
    "BACKEND", "DONE", "FORMAT", "KEY", "LOAD_OP", "MAX_BLOB_BYTES", "MAX_OUTPUT_BYTES", "RECORD", "REPLAY", "VERSION",
    "RejoinError", "RejoinMismatch", "begin", "decode", "encode", "group_helper", "incarnation", "live", "load",
    "load_section", "mode", "omitted", "preload", "register_backend", "rejoined", "reset", "startup_done",
]

log = logging.getLogger("mindspeed_ha.recovery.rejoin")

#: bytes; a larger record is written as a ``too_big`` marker (a rejoin then refuses)
MAX_BLOB_BYTES = 4 * 1024 * 1024
#: bytes; a larger output is recorded without its data (dtype and shape only): the replay leaves
#: the caller's tensor as it is and lists the call in :func:`omitted` (measured: the only such
#: start-up output of Megatron-LM is the embedding-group all_reduce of the word embeddings with
#: PP > 1, model state that the repair from a replica overwrites)
MAX_OUTPUT_BYTES = 256 * 1024

RECORD, REPLAY, DONE = "record", "replay", "done"
#: the record entry that stands for the start-up's ``load_checkpoint`` (:func:`load_section`)
LOAD_OP = "load_checkpoint"
_ENTRY_OVERHEAD = 96  # bytes counted per recorded op (its header fields), for the size bound


# --------------------------------------------------------------------------- state
_lock = threading.RLock()
_mode: Optional[str] = None  # None (not started), RECORD, REPLAY, DONE
_thread: Optional[int] = None  # ident of the thread recorded / replayed
_entries: List[dict] = []  # RECORD: the entries in call order
_pending: List[dict] = []  # RECORD: entries of async ops not yet snapshotted
_size = 0  # RECORD: payload bytes so far
_problem: Optional[tuple] = None  # RECORD: ("too_big" | "unsupported", reason)
_blob: Optional[dict] = None  # REPLAY: the decoded record
_next = 0  # REPLAY: index of the next entry to serve
_local = threading.local()  # .inside: an op of ours is running (nested ops pass)
_omitted: List[str] = []  # REPLAY: calls whose recorded output had no data (described)
_replayed = False  # a replay ran to its end in this process


def incarnation() -> int:
    """This process's incarnation (``MINDSPEED_HA_INCARNATION``, ``ha_env.INCARNATION``, set by
    the launcher's agent on a restarted worker; 0 when unset).

    Raises:
        ValueError: the variable is not a non-negative integer.
    """
    raw = os.environ.get(ha_env.INCARNATION, "").strip() or "0"
    n = int(raw)
    if n < 0:
        raise ValueError(f"{ha_env.INCARNATION}={raw!r}: expected an integer >= 0")
    return n


def mode() -> Optional[str]:
    """``"record"``, ``"replay"``, ``"done"``, or None (not started)."""
    return _mode


def begin(replay: Optional[bool] = None) -> str:
    """Start recording (incarnation 0) or replaying (incarnation >= 1) on this thread.

    Called by the group-creation patch when ``init_process_group`` creates the default group
    with ``ha`` on; idempotent while started. ``replay`` overrides the incarnation (tests).
    Returns the mode.
    """
    global _mode, _thread, _next, _blob, _size, _problem
    with _lock:
        if _mode is not None:
            return _mode
        replaying = incarnation() >= 1 if replay is None else replay
        _thread = threading.get_ident()
        _entries.clear()
        _pending.clear()
        _omitted.clear()
        _size, _problem, _blob, _next = 0, None, None, 0
        if replaying:
            register_backend()
        _mode = REPLAY if replaying else RECORD
        _set_hook(_on_call)
        log.info("rejoin: %s the start-up collectives (incarnation %d)",
                 "replaying" if replaying else "recording", incarnation())
        return _mode


def reset() -> None:
    """Forget everything (tests): mode None, hook removed."""
    global _mode, _thread, _blob, _next, _size, _problem, _replayed
    with _lock:
        _set_hook(None)
        _mode, _thread, _blob, _next, _size, _problem = None, None, None, 0, 0, None
        _replayed = False
        _entries.clear()
        _pending.clear()
        _omitted.clear()


def startup_done() -> Optional[int]:
    """End of the start-up (the runtime calls it when the first train_step is entered).

    Recording: snapshots async ops never waited, writes the record into the default store
    under :data:`KEY` and returns its size in bytes. Replay: checks that every recorded op
    was served and returns None. Not started or already done: returns None.

    Raises:
        RejoinMismatch: replay ended with recorded ops left unserved (the start-up diverged).
        RuntimeError: the store write failed (recording).
    """
    with _lock:
        if _mode == RECORD:
            return _write_record()
        if _mode == REPLAY:
            _end_replay()
        return None


def _write_record() -> int:
    _settle(final=True)
    status, reason = _problem if _problem else ("ok", "")
    blob = encode(startup_blob.header(status, reason), _entries)
    if len(blob) > MAX_BLOB_BYTES:
        blob = encode(startup_blob.header("too_big", f"record of {len(_entries)} ops is {len(blob)} bytes "
                                          f"> {MAX_BLOB_BYTES}"), [])
    rank = startup_blob.save(blob)
    _finish()
    log.info("rejoin: start-up record of rank %d written: %d ops, %d bytes", rank, len(_entries), len(blob))
    return len(blob)


def _end_replay() -> None:
    global _blob, _replayed
    if _blob is None:  # no op was replayed: the record must be empty too
        _blob = load()
    served, total = _next, len(_blob["entries"])
    _finish()
    if served != total:
        raise RejoinMismatch(
            f"rejoin: start-up ended after {served} collective(s) but the first incarnation "
            f"recorded {total}; next recorded: {startup_ops.describe(_blob['entries'][served])}")
    _replayed = True
    log.info("rejoin: start-up replayed: %d ops served without communicating (%d without data)",
             served, len(_omitted))


def preload() -> None:
    """Replaying: read this rank's start-up record now, if no replayed op read it yet. The
    rejoin calls it before its group rebuild: the record is in the first generation's store,
    and after the rebuild the default group is another generation's (a start-up with no
    collective before the rejoin point, e.g. a job without optimizer replicas, then found no
    record at its first replayed op after the rejoin: found by the hot switch's job)."""
    global _blob
    with _lock:
        if _mode == REPLAY and _blob is None:
            _blob = load()


@contextlib.contextmanager
def live():
    """Inside, this thread's communication and the groups it creates are real: not
    recorded, not replayed, not deferred (a restarted process's rejoin, which runs in the
    middle of its start-up: the group rebuild and the repair transfer with the survivors)."""
    before = getattr(_local, "inside", False)
    _local.inside = True
    try:
        yield
    finally:
        _local.inside = before


def rejoined() -> bool:
    """Whether this process replayed its start-up (a restarted worker that must rejoin)."""
    return _replayed


def omitted() -> List[str]:
    """The replayed calls whose output was recorded without data (larger than
    :data:`MAX_OUTPUT_BYTES`): their tensors kept the new process's own values, so the repair
    must overwrite them (each described with its index, op, group and call site)."""
    return list(_omitted)


def _finish() -> None:
    global _mode
    _mode = DONE
    _set_hook(None)


def _set_hook(fn) -> None:
    from mindspeed_ha.patches import comm as comm_patches

    comm_patches.RECORDER = fn


# --------------------------------------------------------------------------- group creation
def group_helper(wrapped, instance, args, kwargs):
    """Wrapper of ``distributed_c10d._new_process_group_helper`` (feature ``ha``): starts
    :func:`begin` at the default group's creation; while replaying, creates the group with
    :data:`BACKEND` and keeps the backend and timeout asked for in
    ``deferred.INTENDED_BACKENDS[name]`` (also ``groups.INTENDED_BACKENDS``)."""
    try:
        bound = startup_ops.bind(wrapped, args, kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)
    a = bound.arguments
    if _mode is None and list(a.get("global_ranks_in_group") or []) == []:
        begin()
    if _mode != REPLAY or getattr(_local, "inside", False):  # live(): a rejoin's real groups
        return wrapped(*args, **kwargs)
    from torch.distributed import distributed_c10d as c10d

    intended = str(a["backend"])
    if intended == BACKEND:  # new_group(backend=None): the default group's backend
        default = c10d._world.default_pg
        intended = (deferred.intended_backend(str(c10d._world.pg_names.get(default))) or ("gloo", None))[0]
    a["backend"] = BACKEND
    pg, store = wrapped(*bound.args, **bound.kwargs)
    if pg is not None and pg is not c10d.GroupMember.NON_GROUP_MEMBER:
        deferred.INTENDED_BACKENDS[str(a["group_name"])] = (intended, a.get("timeout"))
    return pg, store


# --------------------------------------------------------------------------- the start-up load
def load_section(wrapped, instance, args, kwargs):
    """Wrapper of the script's ``load_checkpoint`` (patches ``ha.rejoin.load.*``): the
    start-up's ``--load`` is one record entry, not its collectives.

    Recording (the recording thread, before :func:`startup_done`): the load runs, its own
    collectives (tracker all_reduce, a ``torch_dist`` load's exchanges, barriers) are not
    recorded, one entry ``{"op": "load_checkpoint", "returned": [iteration, flops]}`` stands
    for them. Replay: the load is not run; that entry must be next (else
    :class:`RejoinMismatch`) and its value is returned: the restarted process sees the
    survivors' ``--load`` outcome (no checkpoint then, or the one they resumed), whatever
    ``--load`` holds now (``--load`` = ``--save``: the periodic checkpoints since). What a
    load sets comes at the rejoin from a replica (``transfer``, ``progress``), or, without
    one, from the checkpoint the rejoin loads (``reload.reload_for_rejoin``, in :func:`live`).
    Other calls (other threads, :func:`live`, after the start-up) pass through.
    """
    if (threading.get_ident() != _thread or getattr(_local, "inside", False)
            or _mode not in (RECORD, REPLAY)):
        return wrapped(*args, **kwargs)
    if _mode == REPLAY:
        return _skip_load()
    if _problem is not None:  # recording stopped (too big, unsupported)
        return wrapped(*args, **kwargs)
    return _record_load(wrapped, args, kwargs)


def _record_load(wrapped, args, kwargs):
    global _problem, _size
    _settle(final=False)
    entry = {"index": len(_entries), "op": LOAD_OP, "group": None, "ranks": [], "site": startup_ops.site(),
             "out": []}
    _local.inside = True
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _local.inside = False
    values = list(result) if isinstance(result, (tuple, list)) else []
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        _problem = ("unsupported", f"the start-up's load_checkpoint returned {result!r:.80}, not (iteration, flops)")
        _stop_recording()
        return result
    entry["returned"] = values
    _entries.append(entry)
    _size += _ENTRY_OVERHEAD
    return result


def _skip_load():
    global _blob, _next
    _blob = load() if _blob is None else _blob
    entries, index = _blob["entries"], _next
    rec = entries[index] if index < len(entries) else None
    if rec is None or rec["op"] != LOAD_OP:
        mine = {"index": index, "op": LOAD_OP, "group": None, "ranks": [], "site": startup_ops.site()}
        where = f"recorded {startup_ops.describe(rec)}" if rec else f"past the end of the record ({len(entries)} ops)"
        raise RejoinMismatch(f"rejoin: start-up call {index} differs from the record: now "
                             f"{startup_ops.describe(mine)}, {where}")
    _next = index + 1
    log.warning("rejoin: the start-up's load_checkpoint is not run in a restarted process (its state comes "
                "from the survivors): it returns %s, as at the first incarnation's start-up", rec["returned"])
    return tuple(rec["returned"])


# --------------------------------------------------------------------------- per op
def _snapshot(entry: dict) -> None:
    """Copy ``entry``'s output tensors (kept in ``entry['_tensors']``) into its ``out``."""
    global _size, _problem
    tensors = entry.pop("_tensors", None)
    if tensors is None:
        return
    out = []
    for t in tensors:
        meta = startup_ops.meta(t)
        if t.numel() * t.element_size() > MAX_OUTPUT_BYTES:
            data = None  # not kept: see MAX_OUTPUT_BYTES
        elif _problem is None:
            data = startup_ops.bytes_of(t)
            _size += len(data)
            if _size > MAX_BLOB_BYTES:
                _problem = ("too_big", f"start-up outputs exceed {MAX_BLOB_BYTES} bytes at call "
                                       f"{entry['index']} ({entry['op']})")
        else:
            data = b""
        out.append(meta + [data])
    entry["out"] = out
    _size += _ENTRY_OVERHEAD
    if _problem is None and _size > MAX_BLOB_BYTES:
        _problem = ("too_big", f"start-up record exceeds {MAX_BLOB_BYTES} bytes at call {entry['index']}")
    if _problem is not None:  # stop recording: memory and per-op cost stay bounded
        _stop_recording()


def _stop_recording() -> None:
    _entries.clear()
    _pending.clear()
    _set_hook(None)


def _on_call(name, fn, wrapped, instance, args, kwargs):
    """``patches.comm.RECORDER`` while recording or replaying: ``fn`` is the comm layer's
    wrapper (``fn(wrapped, instance, args, kwargs)`` performs the op)."""
    global _problem
    if (threading.get_ident() != _thread or getattr(_local, "inside", False)
            or _mode not in (RECORD, REPLAY)):
        return fn(wrapped, instance, args, kwargs)
    if name == "_coalescing_manager":
        if _mode == REPLAY:
            raise RejoinError("rejoin: _coalescing_manager during the start-up cannot be replayed")
        _problem = _problem or ("unsupported", "_coalescing_manager used during the start-up")
        _stop_recording()  # nothing more to record
        return fn(wrapped, instance, args, kwargs)
    a = startup_ops.bind(wrapped, args, kwargs).arguments
    gid = startup_ops.group_id(startup_ops.group_of(name, a))
    if gid is None:  # not a member: torch returns at once, nothing to record
        return fn(wrapped, instance, args, kwargs)
    if _mode == REPLAY:
        return _replay(name, a, gid)
    return _record(name, fn, wrapped, instance, args, kwargs, a, gid)


def _record(name, fn, wrapped, instance, args, kwargs, a, gid):
    if _pending:
        _settle(final=False)
    entry = {"index": len(_entries), "op": name, "group": gid[0], "ranks": gid[1], "site": startup_ops.site()}
    outputs = startup_ops.outputs(name, a)
    _local.inside = True
    try:
        result = fn(wrapped, instance, args, kwargs)
    finally:
        _local.inside = False
    _entries.append(entry)
    entry["_tensors"] = outputs
    works = result if isinstance(result, list) else [result] if result is not None else []
    if not works:  # synchronous: the outputs are final
        _snapshot(entry)
        return result
    entry["_works"] = works  # snapshotted once they completed (the caller waited), see _settle
    _pending.append(entry)
    return result


def _settle(final: bool) -> None:
    """Snapshot the pending async entries whose works all completed (all when ``final``)."""
    for e in list(_pending):
        works = e.get("_works", ())
        if final or all(_completed(w) for w in works):
            _pending[:] = [p for p in _pending if p is not e]
            e.pop("_works", None)
            _snapshot(e)


def _completed(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a work that cannot tell: wait for startup_done
        return False


def _replay(name, a, gid):
    global _blob, _next
    if _blob is None:
        _blob = load()
    entries = _blob["entries"]
    index = _next
    outputs = startup_ops.outputs(name, a)
    mine = {"index": index, "op": name, "group": gid[0], "ranks": gid[1],
            "out": [startup_ops.meta(t) for t in outputs], "site": startup_ops.site()}
    if index >= len(entries):
        raise RejoinMismatch(f"rejoin: start-up call {startup_ops.describe(mine)} is past the end of the "
                             f"record ({len(entries)} ops recorded by the first incarnation)")
    rec = entries[index]
    same = (rec["op"] == name and rec["group"] == gid[0] and list(rec["ranks"]) == gid[1]
            and [o[:2] for o in rec["out"]] == [[m[0], list(m[1])] for m in mine["out"]])
    if not same:
        raise RejoinMismatch(f"rejoin: start-up call {index} differs from the record: "
                             f"now {startup_ops.describe(mine)}, recorded {startup_ops.describe(rec)}")
    _serve(outputs, rec, index)
    _next = index + 1
    if name in ("isend", "irecv"):
        return _done_work()
    if name == "batch_isend_irecv":
        return [_done_work() for _ in a["p2p_op_list"]]
    if a.get("async_op"):
        return _done_work()
    return None


def _serve(outputs: list, rec: dict, index: int) -> None:
    """Write the recorded bytes of entry ``rec`` into the caller's ``outputs``."""
    import torch

    for t, (dtype, shape, data) in zip(outputs, rec["out"]):
        if data is None:  # recorded without its data (MAX_OUTPUT_BYTES): left as it is
            _omitted.append(startup_ops.describe(dict(rec, index=index)))
            continue
        if t.numel() == 0:
            continue
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(t.dtype).reshape(t.shape)
        with torch.no_grad():
            t.copy_(src)


def _done_work():
    import torch
    from torch._C import _distributed_c10d

    fut = torch.futures.Future()
    fut.set_result(None)
    return _distributed_c10d._create_work_from_future(fut)
