"""Feature ``ha``: a restarted worker's start-up is replayed (``mindspeed_ha.recovery.rejoin``).

``distributed_c10d._new_process_group_helper`` -- what ``init_process_group``, ``new_group``
and ``recovery.groups`` call to make every group -- starts recording (incarnation 0) or
replaying (``MINDSPEED_HA_INCARNATION >= 1``) when the default group is made, and, while a
rejoining process replays its start-up, makes each group with the peer-less ``ha_deferred``
backend (the backend asked for is kept for ``rebuild_process_groups``). The collectives
themselves are recorded / served by the comm layer's hook (``patches.comm.RECORDER``).
The start-up's ``load_checkpoint`` (``--load``; Megatron-LM's ``setup_model_and_optimizer``
calls it by the name ``megatron.training.training.load_checkpoint``, which MindSpeed-LLM
replaces with its own wrapper: ours goes on top, see the registry; the built-in trainer's
too) is one entry of the record instead of its collectives, and is not run in a restarted
process (``rejoin.load_section``): its start-up sees the survivors' ``--load`` outcome even
when ``--load`` is ``--save`` and periodic checkpoints were written since.
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


def _load_section(wrapped, instance, args, kwargs):
    from mindspeed_ha.recovery import rejoin

    return rejoin.load_section(wrapped, instance, args, kwargs)


PATCHES += [
    Patch(name=f"ha.rejoin.load.{where}", module=module, attribute="load_checkpoint", wrapper=_load_section,
          feature="ha", versions=None,
          doc="the start-up's --load: one record entry (incarnation 0), not run in a restarted process (rejoin)")
    for where, module in (("megatron", "megatron.training.training"),
                          ("trainer", "mindspeed_ha.testing.trainer.training"))
]
