"""recovery/progress.py: the progress message a restarted process (ARF) receives."""

import random
import types

import numpy as np
import pytest
import torch

from mindspeed_ha.recovery import progress


def _rng_state():
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
            "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}


def test_round_trip_restores_every_field():
    state = _rng_state()
    args = types.SimpleNamespace(iteration=7, consumed_train_samples=56, skipped_train_samples=0,
                                 consumed_valid_samples=8, num_floating_point_operations_so_far=1.5e12)
    sched = {"max_lr": 1e-3, "num_steps": 56, "lr_decay_style": "cosine"}
    msg = progress.decode(progress.encode(progress.capture(args, 7, sched, state, flops=2.5e12)))
    fresh = types.SimpleNamespace(iteration=0, consumed_train_samples=0)
    progress.apply(msg, fresh)
    assert (fresh.iteration, fresh.consumed_train_samples, fresh.num_floating_point_operations_so_far) == (7, 56, 2.5e12)
    assert msg["scheduler"] == sched
    back = progress.decode_rng(msg["rng"])
    assert back["random_rng_state"] == state["random_rng_state"]
    assert np.array_equal(back["np_rng_state"][1], state["np_rng_state"][1])
    assert back["np_rng_state"][2:] == tuple(state["np_rng_state"][2:])
    assert torch.equal(back["torch_rng_state"], state["torch_rng_state"])
    torch.set_rng_state(back["torch_rng_state"])
    a = torch.rand(3)
    torch.set_rng_state(state["torch_rng_state"])
    assert torch.equal(a, torch.rand(3))


def test_bad_messages_are_refused():
    with pytest.raises(progress.ProgressError, match="version"):
        progress.decode(progress.encode({"v": 99}))
    with pytest.raises(progress.ProgressError, match="bytes"):
        progress.decode(b"x" * (progress.MAX_BYTES + 1))
    with pytest.raises(progress.ProgressError):
        progress.decode(b"\xc1")


def test_forward_part_round_trips_the_losses_bit_for_bit():
    """Roll forward with rejoin: the holder's per-micro-batch losses of step j (Megatron-LM's
    loss functions return tensors or (sum, count) tuples of tensors) come back with their
    dtype, shape, bits and container types; the other fields as given."""
    losses = [{"lm loss": (torch.tensor(2.0625, dtype=torch.float32).add(1e-7), torch.tensor(64))},
              {"lm loss": torch.tensor([1.5, float.fromhex("0x1.fffffep-1")], dtype=torch.float32), "n": 3}]
    part = progress.forward_part(6, losses, 0.73125, None, 8)
    msg = progress.capture(types.SimpleNamespace(consumed_train_samples=40), 5, None, None, forward=part)
    back = progress.decode(progress.encode(msg))
    assert back["args"]["iteration"] == 5 and back["args"]["consumed_train_samples"] == 40
    fwd = back["forward"]
    assert (fwd["iteration"], fwd["grad_norm"], fwd["num_zeros"], fwd["samples"]) == (6, 0.73125, None, 8)
    got = progress.decode_value(fwd["losses"])
    assert isinstance(got, list) and isinstance(got[0]["lm loss"], tuple) and got[1]["n"] == 3
    for a, b in ((got[0]["lm loss"][0], losses[0]["lm loss"][0]), (got[0]["lm loss"][1], losses[0]["lm loss"][1]),
                 (got[1]["lm loss"], losses[1]["lm loss"])):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    with pytest.raises(progress.ProgressError):
        progress.encode_value(object())
