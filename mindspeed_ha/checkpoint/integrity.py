"""The integrity digests of a rank's state: what the VERIFY round reports
(:class:`mindspeed_ha.control.integrity.IntegrityReport`) and what a saver checks the
bytes it writes against.

XXH3-128 (xxhash, 16 bytes; ~25 GB/s on one core here against blake2b's 0.9 GB/s, so the
savers' digest no longer bounds the dying checkpoint's write rate: docs/RESULTS.md) over
names, dtypes, shapes and bytes in a fixed order, plus a count of non-finite values; the
hex digest is tagged with its algorithm (``xxh3-128:<hex>``,
:data:`mindspeed_ha.control.integrity.DIGEST_ALGORITHM`): a digest of another version
(untagged blake2b-128 before issue 21) is refused with a message, never compared. Not
a cryptographic hash: it detects corruption (NaN, bit flips, a changed state) among
copies of the same job, it does not defend against an adversary choosing bytes. No
collectives; read only after a fault, never per iteration.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import xxhash

from mindspeed_ha.checkpoint.shards import STATE_KEYS, num_shards, shard_buckets, unwrap_distributed_optimizer
from mindspeed_ha.checkpoint.state import DyingContext
from mindspeed_ha.checkpoint.steps import gc_paused
from mindspeed_ha.control.integrity import IntegrityReport, foreign_digest, short_digest, tag_digest
from mindspeed_ha.errors import IntegrityError
from mindspeed_ha.integrations import megatron_lm as mlm


class Digest:
    """XXH3-128 over names, dtypes, shapes and bytes, in a fixed order; counts non-finite values.

    ``check_finite=False`` skips the count (same digest): a saver matching a trusted digest
    needs no second finite pass, equal bytes are the bytes verified finite.
    """

    def __init__(self, check_finite: bool = True):
        self._h = xxhash.xxh3_128()
        self.check_finite = check_finite
        self.problems: List[str] = []

    def meta(self, text: str) -> None:
        self._h.update(text.encode() + b"\0")

    def tensor(self, name: str, t) -> None:
        import torch

        t = t.detach()
        self.meta(f"{name}|{t.dtype}|{tuple(t.shape)}")
        if self.check_finite and t.is_floating_point() and t.numel():
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                bad = int(t.numel() - finite.sum())
                self.problems.append(f"{name}: {bad} of {t.numel()} values not finite")
        flat = t.reshape(-1).contiguous().cpu()
        if flat.dtype is torch.bool:
            flat = flat.to(torch.uint8)
        self._h.update(flat.view(torch.uint8).numpy())

    def value(self, name: str, v: Any) -> None:
        if hasattr(v, "detach"):
            self.tensor(name, v)
        elif isinstance(v, dict):
            for k in sorted(v, key=repr):
                self.value(f"{name}.{k!r}", v[k])
        elif isinstance(v, (list, tuple)):
            self.meta(f"{name}|len={len(v)}")
            for i, item in enumerate(v):
                self.value(f"{name}[{i}]", item)
        else:
            self.meta(f"{name}={v!r}")

    def result(self) -> Tuple[bool, str, str]:
        """``(ok, hex digest, problems)``."""
        return not self.problems, tag_digest(self._h.hexdigest()), "; ".join(self.problems[:5])


def _bucket_name(bucket) -> str:
    gbuf_idx, buf_numel, dtype_key, bucket_idx, _ = bucket
    return f"buffer {gbuf_idx} ({buf_numel}) {dtype_key} bucket {bucket_idx}"


def digest_shard_buckets(count: int, buckets, check_finite: bool = True) -> Tuple[bool, str, str]:
    """``(ok, digest, problems)`` of a shard of ``count`` given as its buckets
    (:data:`~mindspeed_ha.checkpoint.shards.ShardBucket`, in layout order)."""
    d = Digest(check_finite)
    d.meta(f"num_shards={count}")
    for bucket in buckets:
        name, b = _bucket_name(bucket), bucket[4]
        d.meta(f"{name}|{b['gbuf_world_numel']}|{b['numel_unpadded']}")
        for k in STATE_KEYS:
            d.tensor(f"{k} of {name}", b[k])
    return d.result()


class StreamingShardDigest(Digest):
    """:func:`digest_shard_buckets` (same value, no finite count) fed chunk by chunk by
    :func:`mindspeed_ha.checkpoint.dp_zero.write_shard` with the bytes it is about to write."""

    def __init__(self, count: int):
        super().__init__(check_finite=False)
        self.meta(f"num_shards={count}")
        self._bucket = ""

    def begin_bucket(self, item) -> None:
        self._bucket, b = _bucket_name(item), item[4]
        self.meta(f"{self._bucket}|{b['gbuf_world_numel']}|{b['numel_unpadded']}")

    def begin_tensor(self, name: str, t) -> None:
        self.meta(f"{name} of {self._bucket}|{t.dtype}|{tuple(t.shape)}")

    def update(self, data) -> None:
        self._h.update(data)


def shard_file_digest(shard: Dict[str, Any]) -> Tuple[bool, str, str]:
    """Digest of a whole shard held as ``{"num_shards": c, "buffers": {gbuf_idx:
    {"numel_unpadded": int, "dtypes": {dtype_key: [bucket, ...]}}}}``, each bucket
    ``{"gbuf_world_numel", "numel_unpadded", "param", "exp_avg", "exp_avg_sq"}`` (the
    values :func:`~mindspeed_ha.checkpoint.shards.shard_buckets` yields): the same value as
    :func:`digest_shard_buckets` over those buckets."""
    items = ((g, buf["numel_unpadded"], dk, i, b) for g, buf in sorted(shard["buffers"].items())
             for dk, buckets in buf["dtypes"].items() for i, b in enumerate(buckets))
    return digest_shard_buckets(shard["num_shards"], items)


def _model_chunk_keys(n: int) -> List[str]:
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def param_names(ctx: DyingContext) -> Dict[str, List[str]]:
    """The model's parameter names per chunk key (``model``, or ``model0``, ``model1``...), sorted."""
    chunks = mlm.unwrap_model(ctx.model)
    chunks = chunks if isinstance(chunks, list) else [chunks]
    return {key: sorted(name for name, _ in chunk.named_parameters())
            for key, chunk in zip(_model_chunk_keys(len(chunks)), chunks)}


def _digest_params(items, check_finite: bool = True) -> Tuple[bool, str, str]:
    d = Digest(check_finite)
    for name, t in items:
        d.tensor(name, t)
    return d.result()


def model_state_digest(state: Dict[str, Any], names: Dict[str, List[str]],
                       check_finite: bool = True) -> Tuple[bool, str, str]:
    """Digest of the model parameters ``names`` (chunk key -> names) in a ``model_optim_rng.pt`` state."""
    return _digest_params(((f"{key}.{n}", state[key][n]) for key, ns in names.items() for n in ns), check_finite)


def live_model_digest(ctx: DyingContext, check_finite: bool = True) -> Tuple[bool, str, str]:
    """The model part: every parameter of the live model chunks (the same value as
    :func:`model_state_digest` of a state holding them)."""
    chunks = mlm.unwrap_model(ctx.model)
    chunks = chunks if isinstance(chunks, list) else [chunks]
    params = {key: dict(chunk.named_parameters()) for key, chunk in zip(_model_chunk_keys(len(chunks)), chunks)}
    return _digest_params(((f"{key}.{n}", ps[n]) for key, ps in params.items() for n in sorted(ps)), check_finite)


def live_shard_digest(ctx: DyingContext, check_finite: bool = True) -> Tuple[bool, str, str]:
    """The optimizer part: the distributed optimizer's shard, else the whole optimizer state
    (a non-distributed optimizer, saved inside ``model_optim_rng.pt``); "" without optimizer."""
    opt = unwrap_distributed_optimizer(ctx.optimizer)
    if opt is not None:
        count = num_shards(opt)
        return digest_shard_buckets(count, shard_buckets(opt, count), check_finite)
    if ctx.optimizer is None or getattr(ctx.args, "no_save_optim", False):
        return True, "", ""
    d = Digest(check_finite)
    d.value("optimizer", ctx.optimizer.state_dict())
    return d.result()


def verify_state(ctx: DyingContext, iteration: int) -> IntegrityReport:
    """The integrity of this rank's (frozen) state at ``iteration``: see :mod:`.control.integrity`.

    Reads every byte of the optimizer shard and of the model parameters once (copied to
    the CPU one bucket / one tensor at a time); called only after a fault, never per
    iteration. A layout error makes the part not ok instead of raising.
    """
    parts = {}
    with gc_paused():
        for part, fn in (("shard", live_shard_digest), ("model", live_model_digest)):
            try:
                parts[part] = fn(ctx)
            except IntegrityError as exc:
                parts[part] = (False, "", str(exc))
    detail = "; ".join(f"{part}: {p[2]}" for part, p in parts.items() if p[2])
    return IntegrityReport(iteration, parts["shard"][0], parts["shard"][1], parts["model"][0],
                           parts["model"][1], detail)


def expect(what: str, got: Tuple[bool, str, str], trusted: str) -> None:
    """Check a digest ``got`` (``(ok, digest, problems)``) against the ``trusted`` one.

    Raises:
        IntegrityError: not ok, another digest (``what`` names the part), or a trusted
            digest of another algorithm (another mindspeed-ha version computed it).
    """
    foreign = foreign_digest(trusted)
    if foreign is not None:
        raise IntegrityError(f"{what}: the trusted {foreign}; nothing of this part is saved")
    ok, digest, problems = got
    if not ok or digest != trusted:
        raise IntegrityError(f"{what}: digest {short_digest(digest)} != trusted {short_digest(trusted)}"
                             f"{f' ({problems})' if problems else ''}; the state changed after verification")
