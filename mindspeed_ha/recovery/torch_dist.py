"""Moved to :mod:`mindspeed_ha.checkpoint.torch_dist_parts`; this re-export goes once nothing imports it."""

from mindspeed_ha.checkpoint.torch_dist_parts import (  # noqa: F401
    BACKEND, COMMON_FILE, CONFIG_FILE, METADATA_FILE, TorchDistCheckpointError, merge_parts, split_common,
    validate_checkpoint_dir, validate_metadata, write_common, write_part)
