"""Rebuild every process group in place after one was poisoned (recovery/groups.py).

4 real ranks on gloo with real megatron-core (TP1 PP2 DP2, and TP2 PP1 DP2): GPTModel in
DistributedDataParallel with the distributed optimizer. Each rank process (this file run
as a script, ``_worker``) trains the same 3 steps twice from the same seed:

* reference: 3 steps on the original groups;
* recovered: step 1; rank 0 launches an all-reduce on its DP(-with-CP) group -- the group
  of the distributed optimizer's reduce-scatter and all-gather -- and abandons it (its DP
  peer never joins: the group is poisoned for good, shared/docs/CPU_BACKEND_FACTS.md);
  rebuild (generation 1); step 2; rebuild again (generation 2, nothing poisoned); step 3.

Asserted on every rank: no holder of an old group is left (``stale_holders``), the default
(WORLD) group is new, nothing was left unswapped, the excluded group is untouched and still
works, a reused generation is refused, and the losses and grad norms of the recovered run
equal the reference bit for bit. The store is the parent's TCPStore (torchrun's agent
store, ``TORCHELASTIC_USE_AGENT_STORE``). The reference run's model and optimizer stay
alive (megatron DDP's grad-accumulator hooks hold it through the autograd graph, which the
gc cannot collect), so the rebuild swaps their groups too: each holder class shows twice.

A third test runs one rank with every other kind of holder (dict keys, set members,
``__slots__``, closure cells, tuples nested in gc-untracked dicts, ``functools.partial``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.abspath(__file__)
WORLD = 4
STEPS = 3


def _run_ranks(argv, world: int, out_dir, timeout_s: float):
    """Run this file with ``argv`` as ``world`` ranks on the parent's TCPStore; their JSON results."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    procs = []
    try:
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), OMP_NUM_THREADS="1",
                       TORCHELASTIC_USE_AGENT_STORE="True")
            env.pop("MINDSPEED_HA_INJECT", None)
            procs.append(subprocess.Popen([sys.executable, HERE, *argv, str(out_dir)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout_s  # one budget for all ranks
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        del store
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-4000:]}"
    results = []
    for rank in range(world):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)], ids=["tp1-pp2-dp2", "tp2-pp1-dp2"])
def test_rebuild_after_poisoned_dp_group_trains_bitwise_equal(tp, pp, tmp_path):
    results = _run_ranks([str(tp), str(pp)], WORLD, tmp_path, timeout_s=200)
    for rank, r in enumerate(results):
        for gen, report in (("1", r["report1"]), ("2", r["report2"])):
            assert report["unswapped"] == [], (rank, gen, report["unswapped"])
            assert report["groups_rebuilt"] == r["groups_before"], (rank, gen, report)
            # every holder is reachable from the known roots: the whole-heap walk was not needed
            assert report["unlisted"] == [], (rank, gen, report["unlisted"])
        assert r["retired"] == 2 * r["groups_before"]
        assert r["alive"] == 0 and r["stale"] == [], (rank, r["alive"], r["stale"])
        # the old generations were destroyed: their threads and sockets are gone (two rebuilds
        # of 21 gloo groups kept them all: +2 x 21 x 3 threads and more descriptors)
        grown = (r["threads_after"] - r["threads_before"], r["fds_after"] - r["fds_before"])
        assert max(grown) < r["groups_before"] // 4, (rank, grown)
        assert r["world_is_new"] and r["excluded_untouched"] and r["generation_reuse_refused"], r
        swapped = set(r["report1"]["swapped"])
        for holder in ("megatron.core.parallel_state._DATA_PARALLEL_GROUP",
                       "megatron.core.parallel_state._DATA_PARALLEL_GROUP_WITH_CP",
                       "megatron.core.parallel_state._DATA_PARALLEL_GROUP_GLOO",
                       "megatron.core.parallel_state._TENSOR_MODEL_PARALLEL_GROUP",
                       "mindspeed_ha.patches.replica._INSTANCE_GROUP"):
            assert holder in swapped, (rank, holder, sorted(swapped))
        for holder in ("<DistributedOptimizer>.data_parallel_group",
                       "<DistributedOptimizer>.data_parallel_group_gloo",
                       "<_ParamAndGradBucketGroup>.intra_distributed_optimizer_instance_group",
                       "<_ParamAndGradBuffer>.data_parallel_group",
                       "<Timer>._barrier_group", "_KEEP.partial.group", "._KEEP.tuple (tuple rebuilt)"):
            assert any(s.endswith(holder) for s in swapped), (rank, holder, sorted(swapped))
        assert r["recovered"]["grad_norms"] == r["reference"]["grad_norms"], (rank, r)
        assert r["recovered"]["losses"] == r["reference"]["losses"], (rank, r)
    last_stage = [r for r in results if r["reference"]["losses"]]
    assert len(last_stage) == WORLD // pp and all(len(r["reference"]["losses"]) == STEPS for r in last_stage)
    times = [tuple(round(r[k][f], 3) for f in ("seconds", "create_seconds", "swap_seconds", "destroy_seconds"))
             for r in results for k in ("report1", "report2")]
    print(f"\nrebuild TP{tp} PP{pp}, {results[0]['groups_before']} groups/rank, (total, create, swap, destroy s) "
          f"per rank and generation: {times}; holders swapped on rank 0: {results[0]['report1']['swapped']}")


@pytest.mark.timeout(120)
def test_every_kind_of_holder_is_swapped(tmp_path):
    """Dict keys (order kept), set members, __slots__, closure cells, tuples nested in a
    gc-untracked dict, functools.partial keywords: one rank, megatron's groups beside."""
    [r] = _run_ranks(["kinds"], 1, tmp_path, timeout_s=100)
    assert r["unswapped"] == [] and r["stale"] == [], r
    assert all(r["live"]), r["live"]
    for holder in ("_KEEP.keyed[<key ProcessGroup>]", "_KEEP.members (member)", "<_Slotted>.group", "closure cell",
                   "_KEEP.nested.inner (tuple rebuilt)", "_KEEP.nested.inner[1] (tuple rebuilt)", "_KEEP.kw.group"):
        assert any(holder in s for s in r["swapped"]), (holder, r["swapped"])


# ------------------------------------------------------------------ one rank (script mode)
_RETAIN_SCRIPT = r"""
import json, sys, psutil, torch, torch.distributed as dist
from mindspeed_ha.recovery import groups
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.new_group([0])
kept, rows = [], []
for gen in range(1, 7):
    # a finished Work of the generation about to be replaced, kept: it holds the gloo context,
    # and through it the device (C++ shared_ptr), as something in C++ did in the soak run
    w = dist.all_reduce(torch.ones(1), async_op=True)
    w.wait()
    kept.append(w)
    groups.rebuild_process_groups(gen)
    rows.append(psutil.Process().num_fds())
print(json.dumps(rows))
"""


def test_what_c_plus_plus_keeps_of_an_old_generation_holds_no_descriptor(tmp_path):
    """A rebuilt group uses its root's pooled gloo device (recovery/gloo_devices.py), so a
    context kept alive past its group's destruction keeps no socket, epoll or pipe. Without
    the pool: +4 descriptors per rebuild here (18, 22, 26, ...), the soak run's signature."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("GLOO_SOCKET_IFNAME", None)
    p = subprocess.run([sys.executable, "-c", _RETAIN_SCRIPT], capture_output=True, text=True, timeout=120,
                       env=env, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    fds = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(set(fds)) == 1, fds


_KEEP = {}  # module-level holders the rebuild must find (a tuple, a timer, a partial, the excluded group)


def _build(tp: int, pp: int, seed: int):
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed + 100 * mpu.get_pipeline_model_parallel_rank())
    tensor_parallel.model_parallel_cuda_manual_seed(seed + 100 * mpu.get_pipeline_model_parallel_rank())
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                     max_sequence_length=16, pre_process=mpu.is_pipeline_first_stage(),
                     post_process=mpu.is_pipeline_last_stage())
    for p in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    ddp = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=False, check_for_nan_in_grad=False))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0, bf16=False, fp16=False,
        params_dtype=torch.float32, use_distributed_optimizer=True), [ddp])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    return ddp, optimizer


def _batches(step: int):
    import torch
    from megatron.core import parallel_state as mpu

    out = []
    for micro in range(2):
        g = torch.Generator().manual_seed(1000 * step + 10 * mpu.get_data_parallel_rank() + micro)
        tokens = torch.randint(0, 128, (2, 17), generator=g)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 16),
                    "position_ids": torch.arange(16).repeat(2, 1)})
    return out


def _step(ddp, optimizer, step: int):
    """One training step; (lm loss hex on the last stage or None, grad norm hex)."""
    from functools import partial

    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.float().view(-1)
        mask = loss_mask.view(-1).float()
        loss = torch.cat([torch.sum(losses * mask).view(1), mask.sum().view(1)])
        reporting = loss.clone().detach()
        torch.distributed.all_reduce(reporting, group=mpu.get_data_parallel_group())
        tokens = loss[1].clone().detach().to(torch.int)
        return loss[0].clone(), tokens, {"lm loss": (reporting[0], reporting[1])}

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return out, partial(loss_func, b["loss_mask"])

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    reduced = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(_batches(step)), model=[ddp],
        num_microbatches=2, seq_length=16, micro_batch_size=2, forward_only=False)
    ok, grad_norm, _ = optimizer.step()
    assert ok
    loss = None
    if mpu.is_pipeline_last_stage():
        num = sum(x["lm loss"][0] for x in reduced)
        den = sum(x["lm loss"][1] for x in reduced)
        loss = float(num / den).hex()
    return loss, float(grad_norm).hex()


def _train(tp, pp, between=None):
    losses, norms = [], []
    ddp, optimizer = _build(tp, pp, seed=1234)
    # where the runtime keeps them in a real job (reachable from a module's globals)
    _KEEP.setdefault("models", []).append((ddp, optimizer))
    for step in range(1, STEPS + 1):
        if between is not None:
            between(step)
        loss, norm = _step(ddp, optimizer, step)
        norms.append(norm)
        if loss is not None:
            losses.append(loss)
    return {"losses": losses, "grad_norms": norms}


def _worker(tp: int, pp: int, out_dir: str) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(180, exit=True)
    import dataclasses
    import gc
    from datetime import timedelta
    from functools import partial

    import mindspeed_ha  # noqa: F401  (patch registry; CPU backend)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.timers import Timers
    from torch.distributed import distributed_c10d as c10d

    from mindspeed_ha.patches import replica
    from mindspeed_ha.recovery import groups

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    # like HARuntime._fallback_group: excluded. A local is invisible to the swap (CPython
    # 3.11's gc does not report frames' locals): it tells whether the holder was swapped.
    fallback = _KEEP["fallback"] = dist.new_group(backend="gloo")
    mpu.initialize_model_parallel(tp, pp)
    replica._INSTANCE_GROUP = dist.new_group(list(range(WORLD)))  # as the replica feature would
    timers = Timers(log_level=2, log_option="minmax")
    timers("step", log_level=0).set_barrier_group(mpu.get_data_parallel_group())
    _KEEP["timers"] = timers
    _KEEP["tuple"] = (mpu.get_tensor_model_parallel_group(), "a tuple holder")
    _KEEP["partial"] = partial(dist.all_reduce, group=mpu.get_pipeline_model_parallel_group())

    reference = _train(tp, pp)
    gc.collect()
    result = {"reference": reference}

    def between(step):
        if step == 2:
            dp = mpu.get_data_parallel_group(with_context_parallel=True)
            if rank == 0:  # launched and abandoned: the DP peer never joins
                _KEEP["abandoned"] = dist.all_reduce(torch.ones(8), group=dp, async_op=True)
            del dp
            old_world = c10d._get_default_group().group_name  # a name: a local group would be held
            result["groups_before"] = len(c10d._world.pg_map) - 1  # all but the fallback group
            result["fds_before"], result["threads_before"] = _resources()
            report = groups.rebuild_process_groups(1, exclude=[_KEEP["fallback"]])
            result["report1"] = dataclasses.asdict(report)
            # the runtime keeps no abandoned op (a Work keeps its backend's threads and sockets)
            _KEEP.pop("abandoned", None)
            result["world_is_new"] = (c10d._get_default_group().group_name != old_world
                                      and c10d._get_default_group() is groups.successor(old_world)
                                      and dist.get_rank() == rank)
        elif step == 3:
            report = groups.rebuild_process_groups(2, exclude=[_KEEP["fallback"]])
            result["report2"] = dataclasses.asdict(report)
            result["fds_after"], result["threads_after"] = _resources()
            try:
                groups.rebuild_process_groups(2, exclude=[_KEEP["fallback"]])
                result["generation_reuse_refused"] = False
            except ValueError:
                result["generation_reuse_refused"] = True

    result["recovered"] = _train(tp, pp, between)
    gc.collect()
    retired = groups.retired_groups()  # the replaced groups still alive: none
    result["retired"], result["alive"] = len(groups.retired_names()), len(retired)
    result["stale"] = groups.stale_holders(retired)
    del retired
    t = torch.ones(1)
    dist.all_reduce(t, group=_KEEP["fallback"])
    result["excluded_untouched"] = (_KEEP["fallback"] is fallback and t.item() == WORLD
                                    and groups.successor(fallback) is fallback)
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _resources():
    """(open file descriptors, threads) of this process."""
    import psutil

    me = psutil.Process()
    return me.num_fds(), me.num_threads()


class _Slotted:
    __slots__ = ("group",)


def _kinds_worker(out_dir: str) -> None:
    """One rank: every kind of holder the generic pass handles, beside megatron's groups."""
    from datetime import timedelta
    from functools import partial

    import mindspeed_ha  # noqa: F401
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from mindspeed_ha.recovery import groups

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mpu.initialize_model_parallel(1, 1)
    tp, dp, mp_ = (mpu.get_tensor_model_parallel_group(), mpu.get_data_parallel_group(),
                   mpu.get_model_parallel_group())
    slotted = _Slotted()
    slotted.group = dp
    closure = (lambda g: (lambda: g))(mp_)
    _KEEP.update(keyed={tp: "key", "other": 1}, members={dp}, slotted=slotted, closure=closure,
                 nested={"inner": (tp, ("deeper", dp))}, kw=partial(print, group=tp))
    del tp, dp, mp_, slotted, closure
    report = groups.rebuild_process_groups(1)
    new_tp, new_dp = mpu.get_tensor_model_parallel_group(), mpu.get_data_parallel_group()
    result = {
        "swapped": report.swapped, "unswapped": report.unswapped,
        "stale": groups.stale_holders(groups.retired_groups()),
        "live": [list(_KEEP["keyed"])[0] is new_tp, list(_KEEP["members"])[0] is new_dp,
                 _KEEP["slotted"].group is new_dp, _KEEP["closure"]() is mpu.get_model_parallel_group(),
                 _KEEP["nested"]["inner"][0] is new_tp, _KEEP["nested"]["inner"][1][1] is new_dp,
                 _KEEP["kw"].keywords["group"] is new_tp, list(_KEEP["keyed"]) == [new_tp, "other"]],
    }
    with open(os.path.join(out_dir, "rank0.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if sys.argv[1] == "kinds":
        _kinds_worker(sys.argv[2])
    else:
        _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
