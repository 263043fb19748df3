"""A two-process gloo link outside the job's process groups (the hot switch's handoff).

A hot switch's outgoing process and its new process hold the same global rank, so no
group of torch.distributed's registry can hold both. They meet in a plain
``ProcessGroupGloo`` of size 2 instead, made over the job's rendezvous store
(:func:`mindspeed_ha.recovery.groups.rendezvous_store`) under a key prefix unique to the
switch (generation and rank): index 0 is the outgoing process, 1 the new one. Only point
to point sends and receives run on it (:mod:`.transfer`, :mod:`.progress`), on CPU tensors
(gloo), then it is dropped.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

#: the store key prefix of every link (then ``g<generation>/r<rank>/``)
PREFIX = "mindspeed_ha/switch"
#: index of each end in the link
OUTGOING, INCOMING = 0, 1


class PairLink:
    """One end of the link (see the module doc).

    Args:
        store: the job's rendezvous store (both ends pass the same one).
        generation: the switch's process-group generation (the same on both ends).
        rank: the switched global rank.
        me: :data:`OUTGOING` or :data:`INCOMING`.
        timeout: bound on the rendezvous and on each send / receive.

    Raises:
        RuntimeError: (gloo) the other end did not come within ``timeout``.
    """

    device = torch.device("cpu")

    def __init__(self, store: Any, generation: int, rank: int, me: int, timeout: timedelta):
        import torch.distributed as dist

        if me not in (OUTGOING, INCOMING):
            raise ValueError(f"PairLink: me must be {OUTGOING} or {INCOMING}, got {me!r}")
        self.me, self.rank, self.generation = me, int(rank), int(generation)
        prefixed = dist.PrefixStore(f"{PREFIX}/g{int(generation)}/r{int(rank)}/", store)
        self._pg = dist.ProcessGroupGloo(prefixed, me, 2, timeout)

    def send(self, t: torch.Tensor, peer: int) -> None:
        """Send ``t`` (contiguous) to end ``peer``; returns once it went out."""
        self._pg.send([t.contiguous()], peer, 0).wait()

    def recv(self, t: torch.Tensor, peer: int) -> None:
        """Receive into ``t`` (contiguous) from end ``peer``."""
        self._pg.recv([t], peer, 0).wait()

    def close(self) -> None:
        """Drop the group (its connections close with it)."""
        self._pg = None


__all__ = ["INCOMING", "OUTGOING", "PREFIX", "PairLink"]
