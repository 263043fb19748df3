"""UCE repair by in-memory state transfer, and rollback of an aborted step, on real
megatron-core with gloo (recovery/transfer.py, recovery/rollback.py).

The multi-process tests run this file as a script, one process per rank (``_worker``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.abspath(__file__)


# ------------------------------------------------------------------ ReplayIterator
def test_replay_serves_the_items_since_the_last_mark_again_then_continues():
    from mindspeed_ha.recovery.rollback import ReplayIterator

    it = ReplayIterator(iter(range(100)))
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.mark(1)
    assert [next(it) for _ in range(2)] == [3, 4]
    assert it.rewind() == 2
    assert [next(it) for _ in range(4)] == [3, 4, 5, 6]
    assert it.rewind() == 4  # a fault during the replayed step: the same items once more
    assert [next(it) for _ in range(4)] == [3, 4, 5, 6]
    it.mark(2)
    assert it.recorded == 0 and it.marked == 2
    assert it.rewind() == 0
    assert next(it) == 7


def test_mark_keeps_recorded_items_not_served_again_yet():
    from mindspeed_ha.recovery.rollback import ReplayIterator

    it = ReplayIterator(iter(range(10)))
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.rewind()
    assert next(it) == 0
    it.mark(1)  # 1 and 2 were recorded but not consumed by a completed iteration
    assert it.recorded == 2
    assert [next(it) for _ in range(3)] == [1, 2, 3]
    it.rewind()
    assert [next(it) for _ in range(3)] == [1, 2, 3]


def test_replay_of_an_exhausted_iterator_then_stop_iteration():
    from mindspeed_ha.recovery.rollback import ReplayIterator

    it = ReplayIterator([1, 2])
    assert list(it) == [1, 2]
    it.rewind()
    assert list(it) == [1, 2]


def test_wrap_data_iterator_none_list_and_rerun_data_iterator():
    from megatron.core.rerun_state_machine import RerunDataIterator

    from mindspeed_ha.recovery.rollback import ReplayIterator, wrap_data_iterator

    assert wrap_data_iterator(None) == (None, [])
    rerun = RerunDataIterator(iter("abcd"))
    out, replays = wrap_data_iterator([rerun, iter("xyz"), None])
    assert out[0] is rerun and isinstance(rerun.iterable, ReplayIterator)
    assert isinstance(out[1], ReplayIterator) and out[2] is None and len(replays) == 2
    assert next(out[0]) == "a" and next(out[1]) == "x"
    for r in replays:
        r.rewind()
    assert next(out[0]) == "a" and next(out[1]) == "x" and next(out[1]) == "y"
    again, replays2 = wrap_data_iterator(out)  # wrapping twice wraps nothing more
    assert again[0].iterable is out[0].iterable and replays2 == replays


# ------------------------------------------------------------------ timers, rerun state machine
def test_stop_timers_keeps_elapsed_totals(monkeypatch):
    import torch
    from megatron.core.timers import Timers

    from mindspeed_ha.recovery.rollback import stop_timers

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    timers = Timers(log_level=2, log_option="minmax")
    timers("forward-backward", log_level=1).start()
    timers("forward-backward").stop()
    total = timers("forward-backward")._elapsed
    timers("forward-backward").start()  # the aborted step
    timers("optimizer", log_level=1).start()
    assert stop_timers(timers) == ["forward-backward", "optimizer"]
    assert timers("forward-backward")._elapsed == total
    timers("forward-backward").start()  # the re-run: no "timer has already been started"
    timers("forward-backward").stop()
    assert stop_timers(timers) == []


def test_rerun_machine_back_between_iterations():
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    from mindspeed_ha.recovery.rollback import capture_rerun_machine, reset_rerun_machine

    sm = get_rerun_state_machine()
    while sm.should_run_forward_backward(None):  # one complete iteration
        pass
    captured = capture_rerun_machine()
    assert sm.should_run_forward_backward(None) and sm.state is RerunState.INITIAL_RUN  # aborted inside
    reset_rerun_machine()
    assert (sm.state, sm.current_iteration) == (captured["state"], captured["current_iteration"])
    assert sm.should_run_forward_backward(None)
    assert not sm.should_run_forward_backward(None)  # aborted after the loop (in the optimizer)
    reset_rerun_machine(captured)
    assert (sm.state, sm.current_iteration) == (captured["state"], captured["current_iteration"])


# ------------------------------------------------------------------ multi-process
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(scenario: str, nproc: int, out_dir, timeout_s: float):
    """Run ``_worker(scenario)`` on ``nproc`` ranks; return each rank's JSON result."""
    port = _free_port()
    procs = []
    try:
        for rank in range(nproc):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            env.pop("MINDSPEED_HA_INJECT", None)
            procs.append(subprocess.Popen([sys.executable, HERE, scenario, str(out_dir)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{text[-4000:]}"
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(nproc)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", ["transfer", "transfer_bf16"])
def test_transfer_repairs_every_tensor_of_a_replica_holder(tmp_path, scenario):
    """DP4, distributed optimizer with 2 instances: ranks 2 and 3 hold the shards of 0 and 1
    (fp32; bf16: bf16 parameters in DDP's buffer, fp32 main parameters, two dtypes).
    After 2 steps ranks 2 and 3 overwrite every state tensor with garbage, receive their
    holder's state, and are bitwise equal to it; the next step keeps them equal (the in-place
    copies reached DDP's buffers and the optimizer's views). A mismatching state fails on
    both sides, naming the tensor."""
    res = _run_ranks(scenario, 4, tmp_path, timeout_s=240)
    by_rank = {r["rank"]: r for r in res}
    for recv, send in ((2, 0), (3, 1)):
        r, s = by_rank[recv], by_rank[send]
        assert r["peer"] == send and s["peer"] == recv
        assert r["tensors"] == s["tensors"] > 0 and r["bytes"] == s["bytes"] > 0
        assert r["damaged"] != s["before"], "the damage did not change the receiver's state"
        assert r["after"] == s["before"], "the receiver is not bitwise equal to its holder"
        assert r["next_step"] == s["next_step"], "the repaired rank diverged on the next step"
        assert r["names"] == s["names"] and "exp_avg_sq" in " ".join(r["names"])
        assert r["messages"] == (2 if scenario == "transfer_bf16" else 1)  # one per dtype
    assert by_rank[0]["after"] != by_rank[1]["after"]  # different shards: a real comparison
    assert by_rank[2]["big_digest"] == by_rank[0]["big_digest"] and by_rank[2]["big_messages"] == 4
    assert "tensor 0 differs" in by_rank[1]["mismatch"] and "model0.param.bias (5,)" in by_rank[1]["mismatch"]
    assert "at tensor 0" in by_rank[0]["mismatch"]
    print(json.dumps({r["rank"]: r.get("measured") for r in res}))


@pytest.mark.timeout(300)
def test_rollback_after_a_step_aborted_mid_grad_sync_is_bitwise_the_uninterrupted_run(tmp_path):
    """DP2, overlapped grad reduce in several buckets, dropout on: iteration 3 is aborted
    on both ranks inside the backward, after the first bucket's all-reduce was launched.
    clean() + RNG restore + data replay, then iteration 3 again: the losses of iterations
    1-5 equal those of an uninterrupted run bit for bit. Without clean() the re-run fails.
    Also: the non-distributed (every DP rank holds everything) optimizer's state transfers."""
    res = _run_ranks("rollback", 2, tmp_path, timeout_s=240)
    for r in res:
        assert r["dirty"]["handles"] > 0 and r["dirty"]["rerun_state"] == "INITIAL_RUN"
        assert "Should not have multiple communication calls outstanding" in r["without_clean"]
        assert r["replayed"] > 0
        assert r["losses"] == r["reference"] and len(r["reference"]) == 5
    assert res[1]["after"] == res[0]["before"] != res[1]["damaged"]


# ------------------------------------------------------------------ worker side
def _batches(args, dp_rank: int):
    """Deterministic synthetic micro-batches (Megatron GPTDataset's keys)."""
    import torch

    s, b = args.seq_length, args.micro_batch_size
    mask = (torch.tril(torch.ones((s, s))) < 0.5).unsqueeze(0)
    j = 0
    while True:
        g = torch.Generator().manual_seed(1000 * j + dp_rank)
        tokens = torch.randint(0, 250, (b, s + 1), generator=g)
        yield {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
               "loss_mask": torch.ones((b, s)), "attention_mask": mask.expand(b, 1, s, s).clone(),
               "position_ids": torch.arange(s).expand(b, s).clone()}
        j += 1


def _damage(model, optimizer) -> None:
    import torch

    from mindspeed_ha.recovery.transfer import state_tensors

    with torch.no_grad():
        for _, t in state_tensors(model, optimizer):
            t.fill_(float("nan") if t.is_floating_point() else 12345)


def _step(T, G, it, model, optimizer, sched, config):
    loss_dict = T.train_step(G.forward_step, it, model, optimizer, sched, config)[0]
    loss = loss_dict.get("lm loss")
    return float(loss).hex() if loss is not None else None


def _prepare(model, optimizer):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if model[0].ddp_config.overlap_grad_reduce:  # Megatron-LM's setup for --overlap-grad-reduce
        config.no_sync_func = model[0].no_sync
    for chunk in model:
        chunk.train()
    return config


def _transfer_worker(out: dict, bf16: bool = False) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.enums import ModelType

    from mindspeed_ha import replica
    from mindspeed_ha.patches.registry import enable
    from mindspeed_ha.recovery import transfer
    from mindspeed_ha.testing.harness import tiny_gpt_args
    from mindspeed_ha.testing.trainer import pretrain_gpt as G
    from mindspeed_ha.testing.trainer import training as T
    from mindspeed_ha.testing.trainer.initialize import initialize_megatron

    enable("replica")
    args = initialize_megatron(argv=tiny_gpt_args(num_distributed_optimizer_instances=2, bf16=bf16))
    model, optimizer, sched = T.setup_model_and_optimizer(G.model_provider, ModelType.encoder_or_decoder)
    config = _prepare(model, optimizer)
    it = _batches(args, mpu.get_data_parallel_rank())
    for _ in range(2):
        _step(T, G, it, model, optimizer, sched, config)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    mine = replica.instance_and_shard(dp_rank, dp, 2)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (dist.get_rank(), mine))
    peer = next(r for r, (inst, shard) in every if shard == mine[1] and inst != mine[0])
    tensors = transfer.state_tensors(model, optimizer)
    out.update(peer=peer, names=[n for n, _ in tensors], before=transfer.state_digest(model, optimizer))
    if mine[0] == 1:
        _damage(model, optimizer)
        out["damaged"] = transfer.state_digest(model, optimizer)
        stats = transfer.recv_state(model, optimizer, src=peer)
    else:
        stats = transfer.send_state(model, optimizer, dst=peer)
    out.update(tensors=stats.tensors, bytes=stats.bytes, seconds=stats.seconds, messages=stats.messages,
               after=transfer.state_digest(model, optimizer), stats=str(stats))
    _step(T, G, it, model, optimizer, sched, config)
    out["next_step"] = transfer.state_digest(model, optimizer)
    # a bigger state, for a figure: 16 x 1024 x 1024 fp32 (64 MiB), 0 -> 2, in 16 MiB messages
    if dist.get_rank() in (0, 2):
        torch.manual_seed(dist.get_rank())
        big = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)])
        fn = transfer.send_state if dist.get_rank() == 0 else transfer.recv_state
        s = fn(big, None, 2 - dist.get_rank(), max_message_bytes=16 * 2**20)
        out.update(measured=str(s), big_messages=s.messages, big_digest=transfer.state_digest(big, None))
    # a mismatch: 0 sends a Linear(3, 4), 1 expects a Linear(3, 5)
    if dist.get_rank() in (0, 1):
        try:
            if dist.get_rank() == 0:
                transfer.send_state(torch.nn.Linear(3, 4), None, dst=1)
            else:
                transfer.recv_state(torch.nn.Linear(3, 5), None, src=0)
        except transfer.StateMismatch as exc:
            out["mismatch"] = str(exc)


def _rollback_worker(out: dict) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.core.utils import get_model_config

    from mindspeed_ha.recovery import rollback, transfer
    from mindspeed_ha.testing.harness import tiny_gpt_args
    from mindspeed_ha.testing.trainer import pretrain_gpt as G
    from mindspeed_ha.testing.trainer import training as T
    from mindspeed_ha.testing.trainer.initialize import _set_random_seed, initialize_megatron

    args = initialize_megatron(argv=tiny_gpt_args(use_distributed_optimizer=False))
    iters = 5

    def build():
        _set_random_seed(args.seed)
        model = T.get_model(G.model_provider, wrap_with_ddp=False)
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=20000,
                                                   use_distributed_optimizer=False, check_for_nan_in_grad=False)
        model = [DDP(config=get_model_config(m), ddp_config=ddp_config, module=m) for m in model]
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            clip_grad=args.clip_grad, params_dtype=torch.float32), model)
        return model, optimizer, T.get_optimizer_param_scheduler(optimizer), _prepare(model, optimizer)

    dp_rank = mpu.get_data_parallel_rank()
    model, optimizer, sched, config = build()
    assert len(model[0].bucket_groups) > 1, "the test needs several buckets"
    it = _batches(args, dp_rank)
    out["reference"] = [_step(T, G, it, model, optimizer, sched, config) for _ in range(iters)]
    del model, optimizer, sched

    model, optimizer, sched, config = build()
    data, replays = rollback.wrap_data_iterator(_batches(args, dp_rank))
    original = pgb._ParamAndGradBucketGroup.start_grad_sync
    fault = {"armed": False, "calls": 0}

    def start_grad_sync(self):
        original(self)
        if fault["armed"]:
            fault["calls"] += 1
            if fault["calls"] == 1:  # the first bucket's all-reduce is under way on both ranks
                fault["armed"] = False
                self.grad_reduce_handle.wait()  # (gloo: let it land before the buffers are zeroed)
                raise RuntimeError("injected: Connection reset by peer")

    pgb._ParamAndGradBucketGroup.start_grad_sync = start_grad_sync
    losses = []
    rng, rerun = rollback.capture_rng(), rollback.capture_rerun_machine()
    k = 1
    tried = False
    while k <= iters:
        fault["armed"] = k == 3 and not tried
        tried = tried or fault["armed"]
        try:
            loss = _step(T, G, data, model, optimizer, sched, config)
        except RuntimeError as exc:
            assert "Connection reset by peer" in str(exc), exc
            bgs = model[0].bucket_groups
            out["dirty"] = {"handles": sum(bg.grad_reduce_handle is not None for bg in bgs),
                            "rerun_state": get_rerun_state_machine().state.name}
            rollback.reset_rerun_machine(rerun)
            try:  # without clean(): the bucket's handle is still there
                T.train_step(G.forward_step, data, model, optimizer, sched, config)
            except AssertionError as again:
                out["without_clean"] = str(again)
            rollback.clean(model, optimizer, rerun_state=rerun)
            rollback.restore_rng(rng)
            out["replayed"] = sum(r.rewind() for r in replays)
            continue
        losses.append(loss)
        for r in replays:
            r.mark(k)
        rng, rerun = rollback.capture_rng(), rollback.capture_rerun_machine()
        k += 1
    pgb._ParamAndGradBucketGroup.start_grad_sync = original
    out["losses"] = losses
    # every DP rank holds the whole (FP32Optimizer) state: rank 1 repaired from rank 0
    out["before"] = transfer.state_digest(model, optimizer)
    if dist.get_rank() == 1:
        _damage(model, optimizer)
        out["damaged"] = transfer.state_digest(model, optimizer)
        transfer.recv_state(model, optimizer, src=0)
    else:
        transfer.send_state(model, optimizer, dst=1)
    out["after"] = transfer.state_digest(model, optimizer)


def _worker(scenario: str, out_dir: str) -> int:
    import mindspeed_ha  # noqa: F401  (patch registry, CPU backend)

    out = {"rank": int(os.environ["RANK"])}
    {"transfer": _transfer_worker, "transfer_bf16": lambda o: _transfer_worker(o, bf16=True),
     "rollback": _rollback_worker}[scenario](out)
    import torch.distributed as dist

    dist.barrier()
    with open(os.path.join(out_dir, f"rank{out['rank']}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2]))
