"""Moved to :mod:`mindspeed_ha.checkpoint.leftovers`; this re-export goes once nothing imports it."""

from mindspeed_ha.checkpoint.leftovers import (  # noqa: F401
    ASIDE_PREFIX, remove, set_aside, sweep, unpublished)
