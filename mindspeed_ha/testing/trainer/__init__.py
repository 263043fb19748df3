"""Megatron-LM-shaped GPT pre-training on megatron-core (CPU/gloo, CUDA, NPU).

Modules mirror Megatron-LM core_v0.12.1's ``megatron/training`` names (arguments,
initialize, checkpointing, training) plus ``pretrain_gpt`` and ``data``, so one patch
set can target both ``megatron.training.X`` and ``mindspeed_ha.testing.trainer.X``.
"""
