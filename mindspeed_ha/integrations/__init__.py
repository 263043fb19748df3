"""Framework integrations: what mindspeed-ha must know about the training framework it serves.

``megatron_lm``: Megatron-LM core_v0.12.1 (checkpoint names and content for
``--ckpt-format torch``, RNG layout, args, model wrappers, atomic publication). The
runtime and the dying checkpoint reach Megatron-LM's formats only through it; the
built-in trainer (``mindspeed_ha.testing.trainer``) is one of its clients.
"""
