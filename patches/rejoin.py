"""Feature ``ha``: a restarted worker's start-up is replayed (``mindspeed_ha.recovery.rejoin``).

``distributed_c10d._new_process_group_helper`` -- what ``init_process_group``, ``new_group``
and ``recovery.groups`` call to make every group -- starts recording (incarnation 0) or
replaying (``MINDSPEED_HA_INCARNATION >= 1``) when the default group is made, and, while a
rejoining process replays its start-up, makes each group with the peer-less ``ha_deferred``
backend (the backend asked for is kept for ``rebuild_process_groups``). The collectives
themselves are recorded / served by the comm layer's hook (``patches.comm.RECORDER``).
Gated by ``ha``: without HA every call passes straight through.
"""

from __future__ import annotations

from .registry import Patch


def _group_helper(wrapped, instance, args, kwargs):
    from mindspeed_ha.recovery import rejoin

    return rejoin.group_helper(wrapped, instance, args, kwargs)


PATCHES = [
    Patch(name="ha.rejoin.group_helper", module="torch.distributed.distributed_c10d",
          attribute="_new_process_group_helper", wrapper=_group_helper, feature="ha", versions=None,
          doc="start-up collectives recorded (incarnation 0) or replayed with peer-less groups (rejoin)"),
]
