"""Recovery state is complete (unit, one process, real megatron-core on gloo): after a
state transfer (recovery/transfer.py, what a UCE repair and an ARF rejoin run) the receiver
holds every key a regular checkpoint holds, tensor or not, equal to the sender's (the
uninterrupted run), and the next steps stay bitwise equal: megatron-core's
``optimizer.state_dict()`` (param groups, grad scaler: ``growth_tracker`` and
``hysteresis_tracker`` are Python ints), the inner torch optimizer's ``state_dict()``
(Adam state), the model chunks' ``state_dict()``; fp32, bf16 and fp16 (dynamic loss scale).

The two sides run in two threads of this process; the transfer's point-to-point messages go
through an in-memory loopback instead of the process group (the protocol is the same).
"""

from __future__ import annotations

import queue
import threading

import pytest

pytestmark = pytest.mark.timeout(300)

VOCAB, SEQ = 128, 16


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """torch.distributed and megatron-core's parallel state for one rank (TP1 PP1 DP1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        mpu.initialize_model_parallel()
        yield
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


def _build(precision: str, distributed: bool, seed: int):
    """A tiny megatron-core GPT (local layers), Float16Module for bf16/fp16, DDP, and
    megatron-core's optimizer (Adam; fp16: a dynamic grad scaler whose trackers move within
    a few steps: loss scale 2^20 overflows, backs off after hysteresis 2, grows every 2
    clean steps; here steps 0-2 and 4 overflow, the scale grows at 6, 7 and 8 overflow)."""
    import torch
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    fp16, bf16 = precision == "fp16", precision == "bf16"
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, fp16=fp16, bf16=bf16, params_dtype=dtype,
        pipeline_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0, persist_layer_norm=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False)
    module = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                      max_sequence_length=SEQ, parallel_output=True)
    if fp16 or bf16:
        module = Float16Module(config, module)
    ddp = DDP(config=config, module=module, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=fp16 or bf16, use_distributed_optimizer=distributed, check_for_nan_in_grad=False))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0, fp16=fp16, bf16=bf16, params_dtype=dtype,
        use_distributed_optimizer=distributed, initial_loss_scale=2.0 ** 20 if fp16 else None,
        loss_scale_window=2, hysteresis=2), [ddp])
    return [ddp], optimizer


def _step(model, optimizer, j: int) -> str:
    """One training step on batch ``j`` (the learning rate set as a scheduler would); the loss, hex."""
    import torch

    for group in optimizer.param_groups:
        group["lr"] = 1e-3 / (1 + j)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(j))
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    out = model[0](tokens[:, :-1], torch.arange(SEQ).expand(2, SEQ), None, labels=tokens[:, 1:])
    loss = out.float().mean()
    optimizer.scale_loss(loss).backward()
    for chunk in model:
        chunk.finish_grad_sync()
    optimizer.step()
    return float(loss.detach()).hex()


def _flat(obj, prefix: str, out: dict) -> dict:
    """Every leaf of a state dict by its path (dicts, lists, tuples walked)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flat(v, f"{prefix}.{k}", out)
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) or hasattr(v, "dtype")
                                                for v in obj):
        for i, v in enumerate(obj):
            _flat(v, f"{prefix}[{i}]", out)
    else:
        out[prefix] = obj
    return out


def _checkpoint_view(model, optimizer) -> dict:
    """What a regular checkpoint holds of model and optimizer, flattened: megatron-core's
    ``optimizer.state_dict()``, each inner torch optimizer's ``state_dict()`` (the
    distributed optimizer keeps its Adam state out of the former) and each model chunk's
    ``state_dict()``."""
    out: dict = {}
    _flat(optimizer.state_dict(), "optimizer", out)
    for j, opt in enumerate(getattr(optimizer, "chained_optimizers", None) or [optimizer]):
        _flat(opt.optimizer.state_dict(), f"inner{j}", out)
    for i, chunk in enumerate(model):
        _flat(chunk.state_dict(), f"model{i}", out)
    return out


def _bits(t):
    """The tensor's bytes (bitwise comparison: -0.0 and NaN payloads count)."""
    return t.detach().reshape(-1).contiguous().view(__import__("torch").uint8)


def _differences(mine: dict, theirs: dict) -> list:
    import torch

    diffs = [f"{k}: only on one side" for k in sorted(set(mine) ^ set(theirs))]
    for k in sorted(set(mine) & set(theirs)):
        a, b = mine[k], theirs[k]
        if torch.is_tensor(a) or torch.is_tensor(b):
            same = (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                    and torch.equal(_bits(a), _bits(b)))
        else:
            same = type(a) is type(b) and a == b
        if not same:
            diffs.append(f"{k}: {a!r} != {b!r}")
    return diffs


@pytest.fixture
def loopback(monkeypatch):
    """``transfer``'s point-to-point messages between fake ranks 0 and 1 through queues."""
    from mindspeed_ha.recovery import transfer

    boxes = {0: queue.Queue(), 1: queue.Queue()}  # by receiving rank

    def send(t, dst, group):
        boxes[dst].put(t.detach().clone())

    def recv(t, src, group):
        t.copy_(boxes[1 - src].get(timeout=60))

    monkeypatch.setattr(transfer, "_send", send)
    monkeypatch.setattr(transfer, "_recv", recv)


def _transfer(sender, receiver, materialize: bool):
    """Rank 0 sends its state to rank 1 (two threads)."""
    from mindspeed_ha.recovery import transfer

    failed = []

    def send():
        try:
            transfer.send_state(*sender, dst=1)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test thread
            failed.append(exc)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    transfer.recv_state(*receiver, src=0, materialize=materialize)
    t.join(60)
    assert not t.is_alive() and not failed, failed


# (precision, distributed optimizer, receiver): "fresh" = a restarted process (ARF rejoin:
# new model and optimizer, no Adam state yet); "behind" = a rank whose state is at another
# point (the UCE repair of a rank whose host state differs, e.g. an update that raised after
# its grad scaler moved)
CASES = [("fp32", True, "fresh"), ("bf16", True, "fresh"), ("fp16", True, "fresh"), ("fp16", False, "behind")]


@pytest.mark.parametrize("precision,distributed,receiver", CASES,
                         ids=[f"{p}-{'distopt' if d else 'mixed'}-{r}" for p, d, r in CASES])
def test_a_transfer_leaves_every_checkpoint_key_equal_to_the_uninterrupted_run(
        world_of_one, loopback, precision, distributed, receiver):
    sender = _build(precision, distributed, seed=1234)
    losses = [_step(*sender, j) for j in range(5)]
    late = _build(precision, distributed, seed=99)  # other initial values: every one must be overwritten
    if receiver == "behind":  # one step behind (its Adam state exists: the first 3 steps overflow)
        for j in range(4):
            _step(*late, j)
    before = _differences(_checkpoint_view(*late), _checkpoint_view(*sender))
    assert before, "the receiver already equals the sender: nothing to prove"
    if precision == "fp16":
        scaler = sender[1].chained_optimizers[0].grad_scaler.state_dict()
        # the trackers moved (an overflow and clean steps since): a fresh scaler's are (0, 2)
        assert (scaler["growth_tracker"], scaler["hysteresis_tracker"]) != (0, 2), scaler
        assert any("grad_scaler" in d for d in before), before

    _transfer(sender, late, materialize=receiver == "fresh")
    assert _differences(_checkpoint_view(*late), _checkpoint_view(*sender)) == []
    # ... and both go on as one (the sender is the uninterrupted run)
    after = [(_step(*sender, j), _step(*late, j)) for j in range(5, 9)]
    assert [a for a, _ in after] == [b for _, b in after], (losses, after)
    assert _differences(_checkpoint_view(*late), _checkpoint_view(*sender)) == []


def test_a_host_state_of_another_optimizer_is_refused_before_anything_is_written(world_of_one, loopback):
    """A receiver whose optimizer has another structure (here: a grad scaler the sender
    lacks) refuses the transfer on both sides, naming the difference, and keeps its state."""
    from mindspeed_ha.recovery import transfer

    sender, late = _build("bf16", True, 1234), _build("fp16", True, 99)
    digest = transfer.state_digest(*late)
    failed = []

    def send():
        try:
            transfer.send_state(*sender, dst=1)
        except transfer.StateMismatch as exc:
            failed.append(str(exc))

    t = threading.Thread(target=send, daemon=True)
    t.start()
    with pytest.raises(transfer.StateMismatch, match="host state: optimizer 0: grad scaler not sent"):
        transfer.recv_state(*late, src=0)
    t.join(60)
    assert failed and "grad scaler" in failed[0]
    assert transfer.state_digest(*late) == digest


def test_a_rollback_puts_the_grad_scaler_back_to_the_step_s_entry(world_of_one):
    """fp16: megatron-core updates the grad scaler in ``prepare_grads``, before the update
    bracket; a step aborted after that (e.g. in the grad-norm all-reduce) and re-run after
    ``rollback.clean`` must find the scaler of the step's entry, or it counts the step's
    inf/nan check twice."""
    from mindspeed_ha.recovery import rollback

    model, optimizer = _build("fp16", True, 1234)
    for j in range(4):
        _step(model, optimizer, j)
    scaler = optimizer.chained_optimizers[0].grad_scaler
    entry = rollback.capture_grad_scalers(optimizer)
    want = (float(scaler.scale), scaler.state_dict()["growth_tracker"], scaler.state_dict()["hysteresis_tracker"])
    _step(model, optimizer, 4)  # the attempt: step 4 overflows, the scaler backs off
    assert (float(scaler.scale), scaler._growth_tracker, scaler._hysteresis_tracker) != want
    done = rollback.clean(model, optimizer, grad_scalers=entry)
    assert "grad scalers back to the step's entry" in done
    assert (float(scaler.scale), scaler._growth_tracker, scaler._hysteresis_tracker) == want
    assert rollback.capture_grad_scalers(None) == [] and rollback.restore_grad_scalers(optimizer, None) == 0
