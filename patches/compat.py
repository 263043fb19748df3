"""Feature ``core``: megatron-core 0.12 / Megatron-LM core_v0.12.1 against today's libraries.

Each shim acts only where the stock code would crash, on every device:

* numpy 2 removed ``np.product``; megatron-core's dist_checkpointing still calls it
  (``mapping.py``, ``validation.py``, ``exchange_utils.py``: every ``torch_dist`` save
  with the distributed optimizer). Those three modules get a numpy namespace with
  ``product = prod``; numpy itself is not touched.
* torch 2.13 added a required ``serialization_format`` argument to the private
  ``torch.distributed.checkpoint.filesystem._write_item``; megatron-core's
  ``filesystem_async.py`` calls it the old way (TypeError on every ``torch_dist``
  save). The name it imported gets the default torch itself uses (``TORCH_SAVE``).
* ``fix_fp8_params_lose_precision_when_loading_dist_ckpt`` (Megatron-LM
  ``megatron/training/checkpointing.py``) imports TransformerEngine on every
  ``torch_dist`` load; without TE there can be no fp8 tensor to fix: skipped.
"""

from __future__ import annotations

import importlib.util
import inspect
import types

from .registry import Patch


class _NumpyCompat(types.ModuleType):
    """numpy as megatron-core 0.12 expects it: everything forwarded, plus ``product``."""

    def __init__(self, np):
        super().__init__(np.__name__)
        self._np = np

    def __getattr__(self, name):
        if name == "product":
            return self._np.prod
        return getattr(self._np, name)


def _numpy_compat(np):
    if hasattr(np, "product") or isinstance(np, _NumpyCompat):
        return np
    return _NumpyCompat(np)


def _write_item(wrapped, instance, args, kwargs):
    params = _write_item_params(wrapped)
    if "serialization_format" in params and len(args) + len(kwargs) < len(params):
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        kwargs = dict(kwargs, serialization_format=SerializationFormat.TORCH_SAVE)
    return wrapped(*args, **kwargs)


_params_cache = {}


def _write_item_params(fn):
    params = _params_cache.get(fn)
    if params is None:
        params = _params_cache[fn] = tuple(inspect.signature(fn).parameters)
    return params


def _fp8_fix_needs_te(wrapped, instance, args, kwargs):
    if importlib.util.find_spec("transformer_engine") is None:
        return None  # no TE: no fp8 tensors to convert
    return wrapped(*args, **kwargs)


_DC = "megatron.core.dist_checkpointing"

PATCHES = [
    *[Patch(f"compat.numpy_product.{mod.rsplit('.', 1)[-1]}", mod, "np", _numpy_compat, "core",
            replace=True, doc="numpy 2: np.product -> np.prod for this module only")
      for mod in (f"{_DC}.mapping", f"{_DC}.validation", f"{_DC}.exchange_utils")],
    Patch("compat.dcp_write_item", f"{_DC}.strategies.filesystem_async", "_write_item", _write_item,
          "core", doc="torch 2.13: pass _write_item's new serialization_format (TORCH_SAVE)"),
    Patch("compat.fp8_fix_without_te", "megatron.training.checkpointing",
          "fix_fp8_params_lose_precision_when_loading_dist_ckpt", _fp8_fix_needs_te, "core",
          versions=None, doc="torch_dist load without TransformerEngine: no fp8 fix to run"),
]
