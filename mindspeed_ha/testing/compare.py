"""Compare two Megatron checkpoints bit for bit (shipped for users' own tests).

``compare_checkpoint_dirs(a, b)`` loads every ``.pt`` file under two ``iter_XXXXXXX``
directories and compares them recursively: tensors with ``torch.equal`` and equal dtype,
numpy arrays with ``array_equal``, containers element by element. Returns the list of
differences (empty: identical). Keys in ``ignore`` (default: ``args``, the run's
argument namespace, and ``num_floating_point_operations_so_far``, a statistic) are skipped.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, List


def _diff(a: Any, b: Any, path: str, out: List[str], ignore: frozenset) -> None:
    import numpy as np
    import torch

    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.dtype != b.dtype or a.shape != b.shape \
                or not torch.equal(a, b):
            out.append(f"{path}: tensors differ")
        return
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)):
            out.append(f"{path}: arrays differ")
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k in ignore:
                continue
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'b' if k not in a else 'a'}")
                continue
            _diff(a[k], b[k], f"{path}/{k}", out, ignore)
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{path}: lengths {len(a)} != {len(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out, ignore)
        return
    if a != b:
        out.append(f"{path}: {a!r} != {b!r}")


def compare_checkpoint_dirs(a: str, b: str,
                            ignore: Iterable[str] = ("args", "num_floating_point_operations_so_far")) -> List[str]:
    """Differences between checkpoint directories ``a`` and ``b`` (empty list: identical)."""
    import torch

    def files(root):
        return sorted(os.path.relpath(os.path.join(d, f), root)
                      for d, _, fs in os.walk(root) for f in fs if f.endswith(".pt"))

    fa, fb = files(a), files(b)
    out: List[str] = []
    if fa != fb:
        out.append(f"file sets differ: {sorted(set(fa) ^ set(fb))}")
    for rel in sorted(set(fa) & set(fb)):
        x = torch.load(os.path.join(a, rel), map_location="cpu", weights_only=False)
        y = torch.load(os.path.join(b, rel), map_location="cpu", weights_only=False)
        _diff(x, y, rel, out, frozenset(ignore))
    return out
