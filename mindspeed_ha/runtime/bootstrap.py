"""Start-up of a rank's HA side, once the model-parallel groups exist: its layout, the
job's auth key, the controller (without ``mindspeed-ha-run``), the processor thread and
the fallback group for deciding without the controller."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from mindspeed_ha import env as ha_env

log = logging.getLogger("mindspeed_ha.runtime")

#: bytes per rank and exchange over the fallback group (a JSON record: status, layout, digests)
EXCHANGE_BYTES = 4096


def layout_of_this_rank(args):
    """This rank's :class:`~mindspeed_ha.control.state.Layout` (TP/PP/DP/CP ranks, replica and shard)."""
    from megatron.core import parallel_state as mpu

    from mindspeed_ha import replica
    from mindspeed_ha.control.state import Layout

    n = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    dp = mpu.get_data_parallel_world_size(with_context_parallel=True)
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
    if getattr(args, "use_distributed_optimizer", False):
        instance_id, shard_id = replica.instance_and_shard(dp_rank, dp, n)
        replica_count = n
    else:  # every DP rank holds the whole optimizer state
        instance_id, shard_id, replica_count = dp_rank, 0, dp
    return Layout(
        tp_rank=mpu.get_tensor_model_parallel_rank(), tp_size=mpu.get_tensor_model_parallel_world_size(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(), pp_size=mpu.get_pipeline_model_parallel_world_size(),
        dp_rank=dp_rank, dp_size=dp, cp_rank=mpu.get_context_parallel_rank(),
        replica_count=replica_count, instance_id=instance_id, shard_id=shard_id,
        cp_size=mpu.get_context_parallel_world_size(),
    )


def agree_auth_key() -> bytes:
    """The job's CURVE key: the launcher's (environment), else one rank 0 draws and
    broadcasts once, at start-up (a collective of every rank)."""
    env = os.environ.get(ha_env.AUTH_KEY)
    if env:
        return bytes.fromhex(env)
    import torch
    import torch.distributed as dist

    from mindspeed_ha.accelerator import collective_device

    buf = torch.zeros(32, dtype=torch.uint8, device=collective_device())
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    key = bytes(buf.cpu().tolist())
    os.environ[ha_env.AUTH_KEY] = key.hex()
    return key


def ensure_controller(config, rank: int, key: bytes):
    """Without ``mindspeed-ha-run``, global rank 0 starts the controller as a detached
    process (returned; None elsewhere or with a hosted controller).

    Detached (own session) so that the controller outlives a SIGKILL of rank 0 and can
    still drive the dying checkpoint; it exits by itself when the job is over.

    Raises:
        ConfigError: ``--ha-controller-port 0`` without the launcher.
    """
    if os.environ.get(ha_env.CONTROLLER_HOSTED) == "1":
        return None
    if config.controller_port == 0:
        from mindspeed_ha.config import ConfigError

        raise ConfigError("--ha-controller-port 0 (pick a free port) needs the mindspeed-ha-run launcher")
    if rank != 0:
        return None
    env = dict(os.environ, **{ha_env.AUTH_KEY: key.hex()})
    cmd = [sys.executable, "-m", "mindspeed_ha.control.controller",
           "--world-size", os.environ.get("WORLD_SIZE", "1"),
           "--port", str(config.controller_port), "--bind", config.controller_addr]
    if config.events_file:
        cmd += ["--events-file", os.path.abspath(config.events_file)]
    if config.metrics_port is not None:
        cmd += ["--metrics-port", str(config.metrics_port), "--metrics-addr", config.metrics_addr]
    cmd += config.subhealth.to_argv()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    log.info("rank 0 started controller pid %d on port %d", proc.pid, config.controller_port)
    return proc


def make_processor(config, rank: int, layout, args, exit_handler, pause_task=None):
    """This rank's :class:`~mindspeed_ha.control.processor.Processor` (not started);
    ``pause_task(task) -> result``: the runtime's pause tasks (``runtime/pause_tasks.py``)."""
    import torch.distributed as dist

    from mindspeed_ha.control.processor import Processor

    processor = Processor(config, rank, layout, getattr(args, "save", None),
                          world_size=dist.get_world_size(), exit_handler=exit_handler)
    # ARF: with --enable-worker-reboot a restarted process of this rank rejoins
    # (recovery/rejoin.py replays its start-up, rejoin_after_setup repairs it)
    processor.rejoins = bool(config.worker_reboot)
    from mindspeed_ha.recovery import comm, groups

    processor.set_recovery_hooks(abort=comm.abort, aborted=comm.CollectiveAborted,
                                 use_store=groups.use_rendezvous_store, pause_task=pause_task)
    return processor


def fallback_group(config):
    """A gloo group of every rank, made at start-up, for deciding without the controller.

    If the controller is lost, the ranks agree among themselves over it (the processor's
    ``on_controller_lost`` exchange, :func:`exchange`): its connections were made now, so
    it works when the controller, torchrun's store (both in the launcher process) and new
    groups are gone. Used from the processor's own thread only, never by the training
    thread, so it cannot interleave with training collectives. Its timeout bounds
    each exchange: ``action_timeout_s + heartbeat_timeout_s`` (a save step, plus the
    time ranks take to notice the loss); a dead rank fails it at once. Cost: one
    all-rank group at start-up (world - 1 connections per rank), nothing per iteration.
    """
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=config.action_timeout_s + config.heartbeat_timeout_s)
    group = dist.new_group(backend="gloo", timeout=timeout)
    # the processor thread uses it while a recovery has aborted the training collectives
    from mindspeed_ha.recovery import comm

    comm.exempt(group)
    return group


def exchange(group, record: dict) -> list:
    """All-gather one JSON record per rank over ``group`` (rank order).

    Raises:
        ValueError: the record is larger than ``EXCHANGE_BYTES``.
        RuntimeError: (gloo) a rank is gone, or silent past the group's timeout.
    """
    import json

    import torch
    import torch.distributed as dist

    data = json.dumps(record, sort_keys=True).encode()
    if len(data) > EXCHANGE_BYTES - 4:
        raise ValueError(f"exchange record of {len(data)} bytes > {EXCHANGE_BYTES - 4}")
    buf = torch.zeros(EXCHANGE_BYTES, dtype=torch.uint8)
    buf[:4] = torch.tensor(list(len(data).to_bytes(4, "big")), dtype=torch.uint8)
    buf[4:4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.zeros_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, buf, group=group)
    records = []
    for t in out:
        raw = bytes(t.tolist())
        n = int.from_bytes(raw[:4], "big")
        records.append(json.loads(raw[4:4 + n].decode()))
    return records


def sweep_save_dir(save_dir: str) -> None:
    """What killed dying checkpoints left in ``save_dir``, before any save of this run
    (:func:`mindspeed_ha.checkpoint.leftovers.at_start_up`; each directory logged)."""
    from mindspeed_ha.checkpoint import leftovers

    try:
        leftovers.at_start_up(save_dir, os.environ.get(ha_env.KEEP_FAILED_STAGING) == "1")
    except OSError as exc:  # a start-up clean-up never stops the run
        log.warning("%s: start-up clean-up of dying checkpoint leftovers failed: %s", save_dir, exc)
