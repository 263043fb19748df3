"""``--overlap-grad-reduce`` still overlaps with optimizer replicas (HA on, N = 2).

The built-in trainer builds its DDP without overlap, so the ranks run it through a small
module (:data:`TRAINER`, written to a temp dir) that turns on what Megatron-LM's
``--overlap-grad-reduce`` turns on: ``DistributedDataParallelConfig(overlap_grad_reduce=True,
bucket_size=...)`` and ``config.no_sync_func`` (so grads are registered ready on the last
micro-batch only). It records, from outside upstream's code (wrappers put on after
mindspeed_ha's patches, so they see the bucket group as the training code does):

* ``start``: each ``_ParamAndGradBucketGroup.start_grad_sync`` call, whether it ran inside
  ``backward_step`` (i.e. from DDP's backward hook) and whether it left a
  ``grad_reduce_handle`` (an async collective in flight);
* ``backward_end``: at the return of each ``backward_step``, whether every bucket group
  holds a ``grad_reduce_handle``;
* ``finish``: at each ``finish_grad_sync`` entry, whether there was a handle to wait on.

The replica grad sync used to re-implement ``start_grad_sync`` synchronously, so every
record above read False (and ``finish_grad_sync`` ran the sync itself).
"""

import json
import os

import pytest

from mindspeed_ha.testing.harness import launch, launcher_command, tiny_gpt_args

#: Elements per DDP bucket: the tiny GPT (~0.2 M params) gets several bucket groups.
BUCKET_SIZE = 40000
ENV_RECORD = "OVERLAP_TEST_RECORD"
ENV_BUCKET_SIZE = "OVERLAP_TEST_BUCKET_SIZE"

TRAINER = '''
"""The built-in trainer with Megatron-LM's --overlap-grad-reduce settings, recording the
grad-sync handles (tests/test_overlap.py)."""
import json
import os
import runpy

import mindspeed_ha  # noqa: F401  (patch registry first, as pretrain_gpt does)
import wrapt
from megatron.core.distributed import param_and_grad_buffer as pgb
from megatron.core.pipeline_parallel import schedules
from megatron.core.utils import get_model_config

import mindspeed_ha.testing.trainer.training as tr

_ddp_config = tr.DistributedDataParallelConfig
_models = []
_in_backward = [False]
_path = os.environ.get("{record}")
if _path:
    _path = f"{{_path}}.rank{{os.environ['RANK']}}"


def _record(**row):
    if _path:
        with open(_path, "a") as f:
            f.write(json.dumps(row) + "\\n")


def _overlapped(*args, **kwargs):
    kwargs.update(overlap_grad_reduce=True, bucket_size=int(os.environ["{bucket}"]))
    return _ddp_config(*args, **kwargs)


tr.DistributedDataParallelConfig = _overlapped


@wrapt.patch_function_wrapper(tr, "get_model")
def _get_model(wrapped, instance, args, kwargs):
    model = wrapped(*args, **kwargs)
    get_model_config(model[0]).no_sync_func = model[0].no_sync  # as Megatron-LM's setup does
    _models.extend(model)
    return model


@wrapt.patch_function_wrapper(schedules, "backward_step")
def _backward_step(wrapped, instance, args, kwargs):
    _in_backward[0] = True
    try:
        return wrapped(*args, **kwargs)
    finally:
        _in_backward[0] = False
        groups = [g for m in _models for g in m.bucket_groups]
        _record(event="backward_end", groups=len(groups),
                handles=[g.grad_reduce_handle is not None for g in groups])


@wrapt.patch_function_wrapper(pgb, "_ParamAndGradBucketGroup.start_grad_sync")
def _start(wrapped, instance, args, kwargs):
    in_backward = _in_backward[0]
    result = wrapped(*args, **kwargs)
    _record(event="start", in_backward=in_backward, handle=instance.grad_reduce_handle is not None)
    return result


@wrapt.patch_function_wrapper(pgb, "_ParamAndGradBucketGroup.finish_grad_sync")
def _finish(wrapped, instance, args, kwargs):
    _record(event="finish", handle=instance.grad_reduce_handle is not None)
    return wrapped(*args, **kwargs)


runpy.run_module("mindspeed_ha.testing.trainer.pretrain_gpt", run_name="__main__", alter_sys=True)
'''.format(record=ENV_RECORD, bucket=ENV_BUCKET_SIZE)


def launch_overlapped(tmp_path, nproc, train_args, *, ha, record=None, timeout_s=240):
    """Run the built-in trainer with ``--overlap-grad-reduce`` semantics on ``nproc`` ranks.

    Args:
        ha: add ``--enable-high-availability`` (2 optimizer replicas by default).
        record: path prefix for the per-rank JSON-lines records (``<record>.rank<R>``).
    """
    module_dir = tmp_path / "overlap_trainer_module"
    module_dir.mkdir(exist_ok=True)
    (module_dir / "overlap_trainer.py").write_text(TRAINER)
    env = {"PYTHONPATH": os.pathsep.join([str(module_dir)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
           ENV_BUCKET_SIZE: str(BUCKET_SIZE)}
    if record:
        env[ENV_RECORD] = record
    args = list(train_args)
    if ha:
        args += ["--enable-high-availability", "--ha-controller-port", "0"]
    return launch(nproc, args, launcher=launcher_command(nproc), module="overlap_trainer", env=env,
                  timeout_s=timeout_s)


def read_records(prefix, world):
    out = {}
    for rank in range(world):
        with open(f"{prefix}.rank{rank}") as f:
            out[rank] = [json.loads(line) for line in f if line.strip()]
    return out


#: DP4, global batch 16: 2 micro-batches per rank, so ``no_sync`` matters too.
ITERS = 3


@pytest.mark.timeout(300)
def test_replica_grad_sync_dispatched_async_from_backward(tmp_path):
    record = str(tmp_path / "grad_sync")
    r = launch_overlapped(tmp_path, 4, tiny_gpt_args(train_iters=ITERS, global_batch_size=16),
                          ha=True, record=record)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "replica_count=2" in r.stderr, "the run did not use 2 optimizer replicas"
    assert sorted(r.losses) == list(range(1, ITERS + 1))
    for rank, rows in read_records(record, 4).items():
        starts = [row for row in rows if row["event"] == "start"]
        finishes = [row for row in rows if row["event"] == "finish"]
        ends = [row for row in rows if row["event"] == "backward_end"]
        groups = ends[0]["groups"]
        assert groups > 1, f"rank {rank}: one bucket group only; lower BUCKET_SIZE"
        # One sync per bucket group per iteration, each started by the backward hook and
        # left in flight (a handle), none deferred to finish_grad_sync.
        assert len(starts) == groups * ITERS and len(finishes) == groups * ITERS, (rank, rows)
        assert all(s["in_backward"] and s["handle"] for s in starts), (rank, starts)
        assert all(f["handle"] for f in finishes), (rank, finishes)
        # 2 micro-batches: after the first backward nothing is dispatched (no_sync), after
        # the last every bucket group's all-reduce is in flight before backward returns.
        assert [e["handles"] for e in ends] == [[False] * groups, [True] * groups] * ITERS, (rank, ends)
