"""Moved to :mod:`mindspeed_ha.checkpoint.dp_zero`; this re-export goes once nothing imports it."""

from mindspeed_ha.checkpoint.dp_zero import (  # noqa: F401
    CHUNK_BYTES, STATE_KEYS, Bucket, DPZeroError, FilePlan, Group, ShardDigest, finalize, layout_of, ranges_dir,
    write_shard)
