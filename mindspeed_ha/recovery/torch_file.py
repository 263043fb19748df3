"""Moved to :mod:`mindspeed_ha.checkpoint.torch_file`; this re-export goes once nothing imports it."""

from mindspeed_ha.checkpoint.torch_file import (  # noqa: F401
    Record, TorchFileError, TorchFileLayout, combine_ranges, crc32, crc32_combine, plan, pwrite_all, save)
