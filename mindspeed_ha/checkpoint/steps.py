"""Timing and garbage-collection control for the phases of a dying checkpoint."""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from typing import Dict


class Steps:
    """Seconds per named step of one phase on one rank (for the action's result line).

    ``with steps("write"): ...`` adds the block's wall time to ``write``; ``str(steps)``
    is ``"write=0.123s fsync=0.045s"`` in the order the steps first ran.
    """

    def __init__(self):
        self.seconds: Dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def __str__(self) -> str:
        return " ".join(f"{k}={v:.3f}s" for k, v in self.seconds.items())


@contextmanager
def gc_paused():
    """No cyclic garbage collection meanwhile: a full collection of a training process's
    heap takes tenths of a second (measured: 0.2-0.4 s in a stock Megatron-LM rank, hidden
    512), time a dying checkpoint does not have. The training thread is frozen; what the
    dump allocates is mostly tensors freed by reference counting."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
