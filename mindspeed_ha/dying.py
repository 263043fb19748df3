"""Moved to :mod:`mindspeed_ha.checkpoint` (the dying checkpoint and its formats).

A re-export of the names the runtime and the fault injector import from here, until
they import the new modules (then this module goes):

* :mod:`mindspeed_ha.checkpoint.dying`: ``dump``, ``assemble``, ``commit``, ``discard``;
* :mod:`mindspeed_ha.checkpoint.state`: ``IterationSnapshot``, ``DyingContext``, ``staging_root``;
* :mod:`mindspeed_ha.checkpoint.integrity`: ``verify_state``, ``shard_file_digest``,
  ``model_state_digest``;
* :mod:`mindspeed_ha.checkpoint.shards`: ``unwrap_distributed_optimizer`` (was
  ``_unwrap_distributed_optimizer``);
* :mod:`mindspeed_ha.checkpoint.commit`: ``ENV_KEEP_FAILED_STAGING``;
* :mod:`mindspeed_ha.checkpoint.formats`: ``checkpoint_format``.
"""

from __future__ import annotations

from mindspeed_ha.checkpoint.commit import ENV_KEEP_FAILED_STAGING
from mindspeed_ha.checkpoint.dying import assemble, commit, discard, dump
from mindspeed_ha.checkpoint.formats import checkpoint_format
from mindspeed_ha.checkpoint.integrity import model_state_digest, shard_file_digest, verify_state
from mindspeed_ha.checkpoint.shards import unwrap_distributed_optimizer
from mindspeed_ha.checkpoint.state import DyingContext, IterationSnapshot, staging_root
from mindspeed_ha.errors import IntegrityError

_unwrap_distributed_optimizer = unwrap_distributed_optimizer  # the fault injector's old name

__all__ = [
    "ENV_KEEP_FAILED_STAGING", "DyingContext", "IntegrityError", "IterationSnapshot", "assemble",
    "checkpoint_format", "commit", "discard", "dump", "model_state_digest", "shard_file_digest",
    "staging_root", "unwrap_distributed_optimizer", "verify_state",
]
