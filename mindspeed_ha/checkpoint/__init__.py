"""The dying checkpoint and its formats.

* :mod:`.dying`: the three phases (dump, assemble, commit) and the clean-up (discard);
  :mod:`.commit` the format-independent publication (staging dir, validation, rename,
  tracker, :mod:`.leftovers` of an interrupted regular save).
* :mod:`.formats`: one registry keyed by ``--ckpt-format``; one module per format
  (:mod:`.formats.torch`, :mod:`.formats.torch_dist`) on the interface of
  :mod:`.formats.base`.
* :mod:`.state` (the snapshot of iteration ``k`` and the state dict built from it),
  :mod:`.shards` (this rank's distributed-optimizer shard), :mod:`.integrity` (the
  digests of the VERIFY round), :mod:`.steps` (timing, garbage collection paused).
* File mechanics: :mod:`.torch_file` (one ``torch.save`` archive written in place by
  several processes), :mod:`.dp_zero` (``distrib_optim.pt`` from the shard savers),
  :mod:`.torch_dist_parts` (a PyTorch Distributed Checkpoint from parts).

Megatron-LM's names and file contents come from :mod:`mindspeed_ha.integrations.megatron_lm`.
Importing this package imports nothing else (no torch).
"""
