"""The dying checkpoint and its formats.

* :mod:`.dying`: the three phases (dump, assemble, commit) and the clean-up (discard);
  :mod:`.commit` the format-independent publication (staging dir, validation, rename,
  tracker); :mod:`.leftovers` the ``iter_XXXXXXX`` the tracker does not name (published
  when complete, else moved aside: never deleted); :mod:`.staging` whose a staging dir
  is and whether it validated (start-up sweep); :mod:`.publish` the command that
  publishes a validated copy a failed commit kept.
* :mod:`.formats`: one registry keyed by ``--ckpt-format``; one module per format
  (:mod:`.formats.torch`, :mod:`.formats.torch_dist`) on the interface of
  :mod:`.formats.base`.
* :mod:`.state` (the snapshot of iteration ``k`` and the state dict built from it),
  :mod:`.shards` (this rank's distributed-optimizer shard), :mod:`.integrity` (the
  digests of the VERIFY round), :mod:`.steps` (timing, garbage collection paused).
* Reading and creating files: :mod:`.safe_load` (validation reads archives and pickles
  without running code from them), :mod:`.files` (new files ``O_EXCL | O_NOFOLLOW`` with
  Megatron-LM's modes).
* File mechanics: :mod:`.torch_file` (one ``torch.save`` archive written in place by
  several processes), :mod:`.dp_zero` (``distrib_optim.pt`` from the shard savers),
  :mod:`.torch_dist_parts` (a PyTorch Distributed Checkpoint from parts).

Megatron-LM's names and file contents come from :mod:`mindspeed_ha.integrations.megatron_lm`.
Importing this package imports nothing else (no torch).
"""
