"""The hot switch's two-process link (recovery/pair_link.py): the outgoing and the new process
of one rank meet in a size-2 gloo group under the switch's own store prefix, and the progress
message crosses it (two threads of this process stand for the two processes)."""

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mindspeed_ha.recovery import progress
from mindspeed_ha.recovery.pair_link import INCOMING, OUTGOING, PairLink


def _both(fn_out, fn_in):
    errors, out = [], {}

    def run(fn, key):
        try:
            out[key] = fn()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn_out, "out")), threading.Thread(target=run, args=(fn_in, "in"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def test_state_and_progress_cross_the_link():
    store = dist.HashStore()
    sent = {"v": progress.VERSION, "args": {"iteration": 7}, "scheduler": {"num_steps": 56}, "rng": None,
            "rerun_iteration": None, "forward": None, "ckpt_call_idx": None}

    def outgoing():
        link = PairLink(store, 3, 1, OUTGOING, timedelta(seconds=20))
        link.send(torch.arange(6, dtype=torch.float32), INCOMING)
        progress.send(sent, INCOMING, link)
        link.close()

    def incoming():
        link = PairLink(store, 3, 1, INCOMING, timedelta(seconds=20))
        t = torch.zeros(6)
        link.recv(t, OUTGOING)
        got = progress.recv(OUTGOING, link)
        link.close()
        return t, got

    t, got = _both(outgoing, incoming)["in"]
    assert torch.equal(t, torch.arange(6, dtype=torch.float32))
    assert got["args"] == {"iteration": 7} and got["scheduler"] == {"num_steps": 56}


def test_a_link_of_another_switch_never_meets_this_one():
    """The store prefix names the generation and the rank: ends of different switches do not pair."""
    store = dist.HashStore()
    with pytest.raises(RuntimeError):
        PairLink(store, 1, 0, OUTGOING, timedelta(seconds=1))  # its peer (generation 1, rank 0) never comes
    with pytest.raises(ValueError, match="me must be"):
        PairLink(store, 1, 0, 2, timedelta(seconds=1))
